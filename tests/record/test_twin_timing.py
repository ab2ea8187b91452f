"""The fleet twin (`simulate --workers N`) timed as the single-worker simulator is: `--cost-jitter`'s
draws, each worker from its own generator and its own cost file's residuals, and a fitted cost
file's client path (arrive_s, publish_s) on the simulated clock (docs/debugging.md#jitter)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stepwise import simulate as sim
from tests.record.conftest import write_trace

pytestmark = pytest.mark.timeout(120)

ARRIVE, PUBLISH = 0.0031, 0.0012
# Residuals spread wide enough that each draw moves a step visibly.
SPREAD = [-0.004, 0.0, 0.003, 0.03]


def _cost(tmp_path: Path, name: str, **extra: object) -> Path:
    """A fitted cost file (what `simulate --fit-cost --json` writes): 10 ms a step, plus `extra`."""
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"a": 0.01, "b": 1e-5, "c": 0.0, "d": 0.0, **extra}))
    return path


def _requests(n: int = 40) -> list[dict]:
    """Arrivals 20 ms apart, prompts and outputs of varied lengths, some sharing a prefix."""
    return [
        {"rid": f"r{i}", "arrival": 0.02 * i, "prompt_len": 30 + (53 * i) % 200}
        | {"prefix_group": i % 3, "prefix_len": 16, "max_new_tokens": 6 + (11 * i) % 30}
        for i in range(n)
    ]


def _run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], requests: list[dict], *flags: str
) -> tuple[str, dict[str, dict]]:
    """stdout, and the per-request rows by rid when --per-request is among the flags' effects."""
    trace = write_trace(tmp_path / "trace.jsonl", requests)
    rows_path = tmp_path / "rows.jsonl"
    rows_path.unlink(missing_ok=True)
    capsys.readouterr()
    assert sim.main([str(trace), *flags]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    rows = {}
    if rows_path.exists():
        rows = {r["rid"]: r for r in map(json.loads, rows_path.read_text().splitlines())}
    return out, rows


def _fleet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], requests: list[dict], *flags: str
) -> tuple[str, dict[str, dict]]:
    return _run(
        tmp_path, capsys, requests, "--summary-only", "--per-request", str(tmp_path / "rows.jsonl"), *flags
    )


def test_a_jittered_fleet_prints_the_same_bytes_twice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Jitter, a client path, quotas (the trace's requests are the default tenant's) and a kill:
    two runs print the same bytes, per-request rows included; another seed draws otherwise."""
    cost = _cost(tmp_path, "fit", residual_quantiles_s=SPREAD, arrive_s=ARRIVE, publish_s=PUBLISH)
    tenants = tmp_path / "tenants.toml"
    tenants.write_text("[defaults]\nmax_concurrent_requests = 6\n")
    flags = ("--workers", "3", "--cost", str(cost), "--cost-jitter", "--event", "kill:1@0.3")
    flags += ("--tenants", str(tenants))
    first = _fleet(tmp_path, capsys, _requests(), *flags)
    second = _fleet(tmp_path, capsys, _requests(), *flags)
    assert first == second
    assert any(r["finish"] == "refused: max_concurrent_requests" for r in first[1].values())
    other_seed = _fleet(tmp_path, capsys, _requests(), *flags, "--sim-seed", "5")
    assert other_seed[0] != first[0]


def test_jitter_moves_step_times_not_which_requests_complete(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cost = _cost(tmp_path, "fit", residual_quantiles_s=SPREAD)
    plain_out, plain = _fleet(tmp_path, capsys, _requests(), "--workers", "3", "--cost", str(cost))
    jitter_out, jittered = _fleet(
        tmp_path, capsys, _requests(), "--workers", "3", "--cost", str(cost), "--cost-jitter"
    )
    done = {rid for rid, r in plain.items() if r["finish"] in ("stop", "length")}
    assert done == set(plain) == {rid for rid, r in jittered.items() if r["finish"] in ("stop", "length")}
    assert {rid: r["output_tokens"] for rid, r in plain.items()} == {
        rid: r["output_tokens"] for rid, r in jittered.items()
    }
    moved = [rid for rid in plain if plain[rid]["e2e_s"] != jittered[rid]["e2e_s"]]
    assert len(moved) > len(plain) // 2
    summary = json.loads(jitter_out.splitlines()[0])["summary"]
    assert summary["simulated_s"] != json.loads(plain_out.splitlines()[0])["summary"]["simulated_s"]


def test_each_workers_draws_are_its_own(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Worker i draws from its own generator (seeded by --sim-seed and i): a third worker with a
    request of its own leaves the first two workers' requests timed exactly as before."""
    cost = _cost(tmp_path, "fit", residual_quantiles_s=SPREAD)
    lone = [
        {"rid": f"r{i}", "arrival": 0.0, "prompt_len": 40 + 10 * i, "max_new_tokens": 40, "ignore_eos": True}
        for i in range(3)
    ]
    flags = ("--routing-policy", "least-loaded", "--cost", str(cost), "--cost-jitter")
    _, two = _fleet(tmp_path, capsys, lone[:2], "--workers", "2", *flags)
    _, three = _fleet(tmp_path, capsys, lone, "--workers", "3", *flags)
    assert [three[f"r{i}"]["workers"] for i in range(3)] == [["0"], ["1"], ["2"]]
    for rid in ("r0", "r1"):
        assert three[rid] == two[rid]
    # And the workers' draws differ from one another: the same request on worker 0 and on worker 1
    # takes different times.
    same = [r | {"prompt_len": 40} for r in lone[:2]]
    _, pair = _fleet(tmp_path, capsys, same, "--workers", "2", *flags)
    assert pair["r0"]["workers"] == ["0"] and pair["r1"]["workers"] == ["1"]
    assert pair["r0"]["e2e_s"] != pair["r1"]["e2e_s"]


def test_each_worker_draws_its_own_cost_files_residuals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--worker-cost 1=FILE: worker 1 draws from FILE's residuals (every quantile +10 ms: each of its
    steps is 10 ms longer), worker 0 from --cost's (all zero: its steps are the model's)."""
    base = _cost(tmp_path, "base", residual_quantiles_s=[0.0, 0.0, 0.0])
    slow = _cost(tmp_path, "slow", residual_quantiles_s=[0.01, 0.01, 0.01])
    one = {"prompt_len": 50, "max_new_tokens": 1, "arrival": 0.0}
    requests = [{"rid": "a"} | one, {"rid": "b"} | one]
    flags = ("--workers", "2", "--routing-policy", "least-loaded", "--cost", str(base))
    _, plain = _fleet(tmp_path, capsys, requests, *flags)
    _, jittered = _fleet(tmp_path, capsys, requests, *flags, "--worker-cost", f"1={slow}", "--cost-jitter")
    assert jittered["a"]["workers"] == ["0"] and jittered["b"]["workers"] == ["1"]
    assert jittered["a"]["ttft_s"] == plain["a"]["ttft_s"]
    assert jittered["b"]["ttft_s"] - plain["b"]["ttft_s"] == pytest.approx(0.01, abs=1e-6)
    # A worker an `add` event attaches draws from its role's cost (worker 0's index wins over it).
    added = ("--workers", "1", "--event", "add@0", "--worker-cost", f"0={base};mixed={slow}")
    _, plain = _fleet(tmp_path, capsys, requests, *added, *flags[2:])
    _, jittered = _fleet(tmp_path, capsys, requests, *added, *flags[2:], "--cost-jitter")
    assert jittered["a"]["workers"] == ["0"] and jittered["b"]["workers"] == ["1"]
    assert jittered["a"]["ttft_s"] == plain["a"]["ttft_s"]
    assert jittered["b"]["ttft_s"] - plain["b"]["ttft_s"] == pytest.approx(0.01, abs=1e-6)
    # A worker's cost that is not a fitted file has no residuals to draw: one line naming it.
    trace = write_trace(tmp_path / "trace.jsonl", requests)
    assert sim.main([str(trace), *flags, "--worker-cost", "1=0.01,0,0", "--cost-jitter"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--worker-cost" in err[0] and "residual_quantiles_s" in err[0], err


def test_the_client_path_shifts_each_requests_latencies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fitted file's arrive_s delays each request's reaching the router and scheduler, its
    publish_s each token's and finish's publication: on two workers with a request each, TTFT and
    end to end grow by exactly arrive_s + publish_s, the queue time by arrive_s."""
    requests = [
        {"rid": "a", "arrival": 1.0, "prompt_len": 50, "max_new_tokens": 5},
        {"rid": "b", "arrival": 1.0, "prompt_len": 80, "max_new_tokens": 3},
    ]
    flags = ("--workers", "2", "--routing-policy", "least-loaded")
    _, without = _fleet(tmp_path, capsys, requests, *flags, "--cost", str(_cost(tmp_path, "without")))
    with_path = _cost(tmp_path, "with", arrive_s=ARRIVE, publish_s=PUBLISH)
    _, with_ = _fleet(tmp_path, capsys, requests, *flags, "--cost", str(with_path))
    assert with_["a"]["workers"] == ["0"] and with_["b"]["workers"] == ["1"]
    for rid in ("a", "b"):
        for key in ("ttft_s", "e2e_s"):
            assert with_[rid][key] - without[rid][key] == pytest.approx(ARRIVE + PUBLISH, abs=2e-6)
        assert with_[rid]["queue_s"] - without[rid]["queue_s"] == pytest.approx(ARRIVE, abs=2e-6)
        assert with_[rid]["tpot_s"] == without[rid]["tpot_s"]
    # A lone request on an idle worker: its first token is one 10 ms prefill step (a + b·50) after
    # it reaches the scheduler, published publish_s later.
    assert with_["a"]["ttft_s"] == pytest.approx(ARRIVE + 0.01 + 50e-5 + PUBLISH, abs=2e-6)


@pytest.mark.parametrize(
    "extra",
    [
        {"residual_quantiles_s": SPREAD},
        {"arrive_s": ARRIVE, "publish_s": PUBLISH},
        {"arrive_s": ARRIVE, "publish_s": PUBLISH, "residual_quantiles_s": SPREAD},
    ],
)
def test_one_worker_prints_what_simulate_prints_jittered_and_with_a_client_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: dict
) -> None:
    """Worker 0 draws what the single-worker simulator draws (the --sim-seed generator itself) and
    the client path is applied as it applies it: --workers 1 prints the same bytes."""
    cost = _cost(tmp_path, "fit", **extra)
    jitter = ("--cost-jitter",) if "residual_quantiles_s" in extra else ()
    flags = ("--cost", str(cost), *jitter, "--sim-seed", "3")
    plain, _ = _run(tmp_path, capsys, _requests(), *flags)
    fleet, _ = _run(tmp_path, capsys, _requests(), "--workers", "1", *flags)
    assert fleet == plain
