"""`stepwise compare`: the ideal step count, the report, and one real run of every contender."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from clients.datasets import BenchRequest, uniform_requests
from stepwise import baselines, cli, compare, flags
from stepwise.baselines import CONTENDER_NAMES, Measurement, RawForwardContender, TransformersModel
from stepwise.compare import ideal_steps

ROOT = Path(__file__).resolve().parents[1]


def _load_perf_table():  # type: ignore[no-untyped-def]
    """bench/perf_table.py as a module (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("perf_table", ROOT / "bench" / "perf_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


perf_table = _load_perf_table()


# --- the ideal step count --------------------------------------------------------------------------


def test_ideal_steps_all_fit_is_one_prefill_then_the_longest_decode() -> None:
    assert ideal_steps([3, 5, 2], cap=8) == 1 + (5 - 1)


def test_ideal_steps_one_token_each_is_one_prefill_per_batch() -> None:
    assert ideal_steps([1] * 10, cap=4) == 3


def test_ideal_steps_cap_one_is_one_step_per_token() -> None:
    assert ideal_steps([4, 1, 3], cap=1) == 8


def test_ideal_steps_admits_as_soon_as_a_request_leaves() -> None:
    # cap 2: prefill A,B | decode (A done) | prefill C | decode | decode (B, C done)
    assert ideal_steps([2, 4, 3], cap=2) == 5


def test_ideal_steps_of_nothing_is_zero() -> None:
    assert ideal_steps([], cap=32) == 0


def test_ideal_steps_never_below_the_longest_request_nor_above_one_at_a_time() -> None:
    lens = [r.max_new_tokens for r in uniform_requests(64, (16, 128), (8, 256), seed=3)]
    steps = ideal_steps(lens, cap=32)
    assert max(lens) < steps < sum(lens)
    assert ideal_steps(lens, cap=64) == max(lens)


# --- pieces of the contenders ---------------------------------------------------------------------


def test_batches_keep_order_and_cut_the_last_one_short() -> None:
    requests = [BenchRequest([3], n) for n in range(1, 8)]
    cut = [[r.max_new_tokens for r in batch] for batch in baselines.batches(requests, 3)]
    assert cut == [[1, 2, 3], [4, 5, 6], [7]]


def test_make_contenders_refuses_an_unknown_name() -> None:
    with pytest.raises(ValueError, match="vllm"):
        baselines.make_contenders(["stepwise", "vllm"], Path("."))


def test_make_contenders_puts_each_variant_on_a_stack_of_its_own_after_the_named_ones() -> None:
    variants = [("mixed", ("--enable-mixed-chunk",)), ("lpm", ("--schedule-policy", "lpm"))]
    contenders = baselines.make_contenders(["stepwise", "static"], Path("."), variants)
    assert [c.name for c in contenders] == ["stepwise", "static", "mixed", "lpm"]
    servers = [c.server for c in contenders]  # type: ignore[attr-defined]
    assert servers[0] is servers[1]  # the named Stack contenders share one Stack
    assert len({id(server) for server in servers[1:]}) == 3
    assert [s.control_flags for s in servers] == [[], [], *([*flags] for _, flags in variants)]
    assert all(isinstance(c, baselines.StepwiseContender) for c in contenders[2:])


def test_make_contenders_refuses_a_variant_named_like_a_contender() -> None:
    with pytest.raises(ValueError, match="static"):
        baselines.make_contenders(["stepwise"], Path("."), [("static", ())])


@pytest.mark.timeout(30)
def test_descendant_cpu_counts_a_busy_child() -> None:
    # The child burns 0.5 s of CPU, says so, then sleeps; /proc counts in clock ticks and its figure
    # may trail the child's own clock by a tick or two, so the check asks for 0.3 s of the 0.5.
    busy = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n"
    child = subprocess.Popen(
        [sys.executable, "-c", busy + "print('burnt', flush=True)\ntime.sleep(30)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "burnt"
        assert child.pid in baselines._descendants(baselines.os.getpid())
        assert baselines._process_cpu_s(child.pid) >= 0.3
    finally:
        child.kill()
        child.wait()
    assert baselines._process_cpu_s(child.pid) == 0.0  # gone: counts nothing


# --- the report -------------------------------------------------------------------------------------


def _ns(**overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    ns = parser.parse_args([])
    for name, value in overrides.items():
        setattr(ns, name, value)
    return ns


def test_summarize_takes_medians_and_ratios_to_stepwise() -> None:
    requests = [BenchRequest([3, 4], 10), BenchRequest([5], 20)]
    results = {
        "stepwise": [Measurement(30, 1.0, 0.5, 7), Measurement(30, 3.0, 0.5, 9), Measurement(30, 2, 1, 8)],
        "raw-forward": [Measurement(30, 0.5, 0.5), Measurement(30, 0.5, 0.25), Measurement(30, 1, 0.5)],
    }
    report = compare.summarize(results, requests, _ns(concurrency=2, rounds=3))
    step, raw = report["contenders"]["stepwise"], report["contenders"]["raw-forward"]
    assert (step["tok_s"], step["vs_stepwise"], step["tok_per_cpu_s"], step["steps"]) == (15.0, 1.0, 60.0, 8)
    assert (raw["tok_s"], raw["vs_stepwise"], raw["tok_per_cpu_s"], raw["steps"]) == (60.0, 4.0, 60.0, None)
    assert report["workload"]["useful_tokens"] == 30
    assert report["ideal_steps"] == ideal_steps([10, 20], 2)
    text = compare.render(report)
    assert "4.00x" in text and f"ideal {report['ideal_steps']}" in text


def test_the_raw_loop_counts_every_row_it_computes_and_stepwise_is_measured_against_it() -> None:
    # Batches of 2: [10, 20] runs 20 steps on both rows, [5] runs 5: 45 forward tokens, 35 useful.
    requests = [BenchRequest([3, 4], 10), BenchRequest([5], 20), BenchRequest([6], 5)]
    assert RawForwardContender(TransformersModel(ROOT))._forward_tokens(requests, 2) == 45
    results = {
        "stepwise": [Measurement(35, 1.0, 1.0, 30)],
        "raw-forward": [Measurement(35, 0.5, 0.5, forward_tokens=45)],
    }
    report = compare.summarize(results, requests, _ns(concurrency=2, rounds=1))
    assert report["contenders"]["raw-forward"]["forward_tok_s"] == 90.0
    assert report["contenders"]["stepwise"]["forward_tok_s"] is None
    assert report["vs_raw_loop"] == round(35 / 90, 3)
    text = compare.render(report)
    assert "computes 90.0 tok/s" in text and "0.39x of that" in text
    block = perf_table.render_block(report, "stepwise compare --json", "Some CPU", "2026-12-01")
    assert "0.39x of that" in " ".join(block.splitlines())
    assert compare.summarize({"stepwise": results["stepwise"]}, requests, _ns())["vs_raw_loop"] is None


def test_variant_flags_parse_into_names_and_control_plane_flags() -> None:
    ns = _parse(["--variant", "mixed-lpm=--enable-mixed-chunk --schedule-policy lpm", "--variant", "plain="])
    assert ns.variants == [("mixed-lpm", ("--enable-mixed-chunk", "--schedule-policy", "lpm")), ("plain", ())]
    assert ns.contenders == CONTENDER_NAMES  # variants add to the contenders, never replace them


def test_no_variant_keeps_the_defaults() -> None:
    ns = _parse([])
    assert (ns.variants, ns.contenders) == ([], CONTENDER_NAMES)


def test_variant_quoting_follows_the_shell() -> None:
    ns = _parse(["--variant", "q=--schedule-policy 'lof' --random-seed=7"])
    assert ns.variants == [("q", ("--schedule-policy", "lof", "--random-seed=7"))]


def test_a_variant_from_the_environment_comes_before_those_on_the_command_line() -> None:
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    flags.apply_env_defaults(parser, {"STEPWISE_VARIANT": "m=--enable-mixed-chunk"})
    assert parser.parse_args(["--variant", "n="]).variants == [("m", ("--enable-mixed-chunk",)), ("n", ())]


def test_summarize_records_each_variants_flags() -> None:
    requests = [BenchRequest([3], 4)]
    results = {"stepwise": [Measurement(4, 1.0, 1.0, 4)], "mixed": [Measurement(4, 0.5, 1.0, 3)]}
    ns = _ns(variants=[("mixed", ("--enable-mixed-chunk", "--schedule-policy", "lpm"))])
    report = compare.summarize(results, requests, ns)
    assert report["variants"] == {"mixed": "--enable-mixed-chunk --schedule-policy lpm"}
    assert report["contenders"]["mixed"]["vs_stepwise"] == 2.0


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    return parser.parse_args(argv)


def test_summarize_without_stepwise_has_no_ratio() -> None:
    report = compare.summarize({"static": [Measurement(5, 1.0, 1.0, 3)]}, [BenchRequest([3], 5)], _ns())
    assert report["contenders"]["static"]["vs_stepwise"] is None
    assert "static" in compare.render(report)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--contenders", "stepwise,vllm"),
        ("--prompt-len", "9,3"),
        ("--output-len", "x"),
        ("--rounds", "0"),
        ("--variant", "no-equals-sign"),
        ("--variant", "=--enable-mixed-chunk"),
        ("--variant", "static=--enable-mixed-chunk"),  # a contender's name
        ("--variant", "x=--schedule-policy nope"),
        ("--variant", "x=--no-such-flag"),
        ("--variant", "x=--enable-mixed-chunk --chunked-prefill-size -1"),  # the control plane refuses
        ("--variant", "x='unterminated"),
    ],
)
def test_bad_flag_value_is_one_line_and_exit_2(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["compare", flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("stepwise compare:") and flag in err


def test_a_variant_named_twice_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["compare", "--variant", "a=--enable-mixed-chunk", "--variant", "a="])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'a' given twice" in err


# --- the README table ---------------------------------------------------------------------------------

BEGIN, END = perf_table.BEGIN, perf_table.END


def test_replace_block_swaps_only_what_lies_between_the_markers() -> None:
    text = f"# T\n\nbefore\n{BEGIN}\nold table\nold line\n{END}\nafter\n"
    assert perf_table.replace_block(text, "new\n") == f"# T\n\nbefore\n{BEGIN}\nnew\n{END}\nafter\n"


def test_the_performance_page_holds_the_block_perf_table_rewrites() -> None:
    # bench/perf_table.py rewrites docs/performance.md in place: the page keeps one block, intact.
    text = (ROOT / "docs" / "performance.md").read_text()
    block = text.split(BEGIN)[1].split(END)[0]
    assert perf_table.replace_block(text, block) == text
    assert "| contender | tokens/s |" in block


def test_replace_block_twice_is_the_same_as_once() -> None:
    text = f"a\n{BEGIN}{END}\nb"
    once = perf_table.replace_block(text, "| x |")
    assert once == f"a\n{BEGIN}\n| x |\n{END}\nb"
    assert perf_table.replace_block(once, "| x |") == once


@pytest.mark.parametrize(
    "text", ["no markers", f"{BEGIN} only", f"{END} before {BEGIN}", f"{BEGIN}{END}{BEGIN}{END}"]
)
def test_replace_block_refuses_missing_or_misplaced_markers(text: str) -> None:
    with pytest.raises(ValueError, match="perf-table"):
        perf_table.replace_block(text, "x")


def test_render_block_has_the_run_and_one_row_per_contender() -> None:
    requests = [BenchRequest([3, 4], 10), BenchRequest([5], 20)]
    results = {
        "stepwise": [Measurement(30, 0.01, 0.02, 1234)],
        "raw-forward": [Measurement(30, 0.005, 0.01)],
    }
    report = compare.summarize(results, requests, _ns(concurrency=2, rounds=1))
    where, command = "Some CPU, 2 logical cores", "stepwise compare --json"
    block = perf_table.render_block(report, command, where, "2026-12-01")
    about, table = block.split("\n\n")
    assert all(len(line) <= perf_table.WIDTH for line in about.splitlines())
    about = " ".join(about.splitlines())
    assert "2026-12-01" in about and where in about and f"`{command}`" in about
    lines = table.splitlines()
    ideal = ideal_steps([10, 20], 2)
    assert lines[0] == f"| contender | tokens/s | vs stepwise | tokens per CPU s | steps (ideal {ideal}) |"
    assert lines[2:] == [
        "| stepwise | 3,000 | 1.00x | 1,500 | 1,234 |",
        "| raw-forward | 6,000 | 2.00x | 3,000 | - |",
    ]


def test_perf_table_dry_run_prints_and_a_real_run_rewrites_the_readme(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    report = compare.summarize({"stepwise": [Measurement(4, 1.0, 1.0, 4)]}, [BenchRequest([3], 4)], _ns())
    asked: list[list[str]] = []

    def measure(args: list[str]) -> dict[str, object]:
        asked.append(args)
        return report

    monkeypatch.setattr(perf_table, "measure", measure)
    readme = tmp_path / "README.md"
    readme.write_text(f"top\n{BEGIN}\nold\n{END}\nbottom\n")
    assert perf_table.main(["--dry-run", "--rounds", "2", "--readme", str(readme)]) == 0
    assert "| stepwise | 4 | 1.00x | 4 | 4 |" in capsys.readouterr().out
    assert "old" in readme.read_text()
    assert perf_table.main(["--rounds", "2", "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "old" not in text and "| stepwise | 4 | 1.00x | 4 | 4 |" in text
    assert text.startswith(f"top\n{BEGIN}\n") and text.endswith(f"{END}\nbottom\n")
    assert asked == [["--rounds", "2", "--json"]] * 2


def test_machine_names_the_cpu_cores_and_torch() -> None:
    import torch

    where = perf_table.machine()
    assert where.endswith(f"torch {torch.__version__}") and "logical cores" in where


# --- every contender, for real ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_contender_serves_a_small_workload() -> None:
    args = ["--requests", "4", "--prompt-len", "4,16", "--output-len", "2,6", "--concurrency", "2"]
    args += ["--rounds", "1", "--json"]
    requests = uniform_requests(4, (4, 16), (2, 6))
    wanted = sum(r.max_new_tokens for r in requests)
    done = subprocess.run(
        [sys.executable, "-m", "stepwise.cli", "compare", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert list(report["contenders"]) == list(CONTENDER_NAMES)
    assert report["workload"]["useful_tokens"] == wanted
    for name, row in report["contenders"].items():
        assert row["tok_s"] > 0, name
        assert row["tok_per_cpu_s"] > 0, name
        assert [r["useful_tokens"] for r in row["rounds"]] == [wanted], name
    assert report["contenders"]["stepwise"]["vs_stepwise"] == 1.0
    assert report["contenders"]["stepwise"]["steps"] > 0
    assert report["contenders"]["static"]["steps"] > 0
    raw = report["contenders"]["raw-forward"]
    assert raw["forward_tok_s"] >= raw["tok_s"]
    assert report["vs_raw_loop"] > 0
    assert report["ideal_steps"] == ideal_steps([r.max_new_tokens for r in requests], 2)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_variant_runs_beside_stepwise_with_its_own_flags() -> None:
    # One request running at a time gets at most one token per step, so at least one step per
    # useful token; all 8 running at once need far fewer. The step counts show that the flags
    # reached the variant's Stack and only its Stack.
    args = ["--requests", "8", "--prompt-len", "4,16", "--output-len", "2,6", "--concurrency", "8"]
    args += ["--rounds", "1", "--contenders", "stepwise", "--variant", "serial=--max-running-requests 1"]
    done = subprocess.run(
        [sys.executable, "-m", "stepwise.cli", "compare", *args, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert list(report["contenders"]) == ["stepwise", "serial"]
    assert report["variants"] == {"serial": "--max-running-requests 1"}
    wanted = report["workload"]["useful_tokens"]
    plain, serial = report["contenders"]["stepwise"], report["contenders"]["serial"]
    assert plain["useful_tokens"] == serial["useful_tokens"] == wanted
    assert 0 < plain["steps"] < wanted <= serial["steps"]
    assert serial["tok_per_cpu_s"] > 0
