"""Every flag is also an environment variable; flags win; `up` routes flags to the right child."""

from __future__ import annotations

import pytest

from stepwise.cli import _control_parser, _up_parser, _worker_parser
from stepwise.flags import apply_env_defaults, env_name
from stepwise.up import split_flags


def test_env_name() -> None:
    assert env_name("--max-queued-requests") == "STEPWISE_MAX_QUEUED_REQUESTS"


def test_environment_sets_defaults_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPWISE_SCHEDULE_POLICY", "lpm")
    monkeypatch.setenv("STEPWISE_MAX_QUEUED_REQUESTS", "7")
    monkeypatch.setenv("STEPWISE_ENABLE_MIXED_CHUNK", "true")
    parser = _control_parser()
    ns = parser.parse_args([])
    assert (ns.schedule_policy, ns.max_queued_requests, ns.enable_mixed_chunk) == ("lpm", 7, True)
    ns = parser.parse_args(["--schedule-policy", "fcfs", "--max-queued-requests", "3"])
    assert (ns.schedule_policy, ns.max_queued_requests) == ("fcfs", 3)


def test_scheduler_knobs_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from control_plane.config import scheduler_config_from_args

    monkeypatch.setenv("STEPWISE_INIT_NEW_TOKEN_RATIO", "0.5")
    monkeypatch.setenv("STEPWISE_TEST_RETRACT", "1")
    config = scheduler_config_from_args(_control_parser().parse_args(["--chunked-prefill-size", "-1"]))
    assert (config.init_new_token_ratio, config.test_retract, config.chunked_prefill_size) == (
        0.5,
        True,
        None,
    )


def test_the_in_batch_dedup_can_still_be_turned_off_with_minus_one() -> None:
    """SGLang's -1 disables the in-batch prefix dedup (docs/scheduler.md#in-batch-prefix-dedup)."""
    from control_plane.config import scheduler_config_from_args

    env = {"STEPWISE_IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD": "-1"}
    config = scheduler_config_from_args(_control_parser().parse_args([]), env)
    assert config.in_batch_prefix_check_threshold == -1
    with pytest.raises(ValueError, match="CHECK_THRESHOLD=-2"):
        scheduler_config_from_args(
            _control_parser().parse_args([]),
            {**env, "STEPWISE_IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD": "-2"},
        )


def test_invalid_combination_names_the_flag() -> None:
    from control_plane.config import scheduler_config_from_args

    with pytest.raises(ValueError, match="--enable-priority-scheduling"):
        scheduler_config_from_args(
            _control_parser().parse_args(["--enable-priority-scheduling", "--schedule-policy", "lpm"])
        )


def test_worker_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPWISE_KV_TOKENS", "1234")
    assert _worker_parser().parse_args([]).kv_tokens == 1234


def test_up_routes_each_flag_to_the_children_that_know_it() -> None:
    control, worker = split_flags(
        ["--page-size", "4", "--schedule-policy", "lpm", "--kv-tokens", "99", "--model", "embedded"],
        _control_parser(),
        _worker_parser(),
    )
    assert control == ["--page-size", "4", "--schedule-policy", "lpm", "--model", "embedded"]
    assert worker == ["--page-size", "4", "--kv-tokens", "99", "--model", "embedded"]
    with pytest.raises(ValueError, match="unknown flag --nope"):
        split_flags(["--nope"], _control_parser(), _worker_parser())


def test_apply_env_defaults_ignores_empty_values() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--x", type=int, default=5)
    apply_env_defaults(parser, {"STEPWISE_X": ""})
    assert parser.parse_args([]).x == 5
    apply_env_defaults(parser, {"STEPWISE_X": "6"})
    assert parser.parse_args([]).x == 6


def test_env_values_are_checked_like_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from stepwise.flags import ArgumentParser

    parser = ArgumentParser(prog="stepwise x")
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--policy", choices=("a", "b"), default="a")
    for env, complaint in (
        ({"STEPWISE_N": "abc"}, "stepwise x: STEPWISE_N=abc (--n): invalid int value\n"),
        (
            {"STEPWISE_POLICY": "c"},
            "stepwise x: STEPWISE_POLICY=c (--policy): invalid choice (choose from a, b)\n",
        ),
    ):
        with pytest.raises(SystemExit) as exited:
            apply_env_defaults(parser, env)
        assert exited.value.code == 2
        assert capsys.readouterr().err == complaint


def test_env_values_for_switches_and_repeatable_flags() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--on", action="store_true")
    parser.add_argument("--no-cache", dest="cache", action="store_false")
    parser.add_argument("--stop", action="append", default=[])
    apply_env_defaults(parser, {"STEPWISE_ON": "Yes", "STEPWISE_NO_CACHE": "1", "STEPWISE_STOP": "a, b"})
    ns = parser.parse_args([])
    assert (ns.on, ns.cache, ns.stop) == (True, False, ["a, b"])
    assert parser.parse_args(["--stop", "x"]).stop == ["a, b", "x"]  # argparse appends to the default
    with pytest.raises(SystemExit):
        apply_env_defaults(parser, {"STEPWISE_ON": "maybe"})


def test_one_line_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from stepwise.flags import ArgumentParser

    parser = ArgumentParser(prog="stepwise x")
    parser.add_argument("--port", type=int)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--port", "abc"])
    assert exited.value.code == 2
    assert capsys.readouterr().err == "stepwise x: argument --port: invalid int value: 'abc'\n"


def _sections(help_text: str) -> dict[str, str]:
    """`--help`'s text by section title (a line that ends with ':' and starts a section)."""
    sections: dict[str, str] = {}
    title = ""
    for line in help_text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
            sections[title] = ""
        elif title:
            sections[title] += line + "\n"
    return sections


def _longs(parser) -> set[str]:  # type: ignore[no-untyped-def]
    return {s for action in parser._actions for s in action.option_strings if s.startswith("--")}


def test_up_help_says_which_child_gets_each_flag() -> None:
    """`up --help` lists every flag it passes on, grouped by the child (or children) that take it."""
    from stepwise.cli import _gateway_parser
    from stepwise.up import GATEWAY_FLAGS, SET_BY_UP

    sections = _sections(_up_parser().format_help())
    own = _longs(_up_parser())
    control, worker = _longs(_control_parser()) - own, _longs(_worker_parser()) - own - set(SET_BY_UP)
    expected = {
        "passed to the control plane (stepwise control)": control - worker,
        "passed to every worker (stepwise worker)": worker - control,
        "passed to the control plane and every worker": control & worker,
        "passed to the gateway too (with --gateway-port)": set(GATEWAY_FLAGS),
    }
    for title, names in expected.items():
        listed = {line.split()[0] for line in sections[title].splitlines() if line.startswith("  --")}
        assert listed == names, title
    assert set(GATEWAY_FLAGS) <= _longs(_gateway_parser()) and set(GATEWAY_FLAGS) <= control
    assert all(name in sections["set by up itself"] for name in SET_BY_UP)


def test_up_refuses_the_flags_it_sets_itself() -> None:
    with pytest.raises(ValueError, match="--worker-id is set by up itself"):
        split_flags(["--worker-id", "w"], _control_parser(), _worker_parser())


def test_up_gives_the_gateway_its_process_count_whatever_stepwise_workers_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """STEPWISE_WORKERS is `up --workers` (model workers) and `gateway --workers` alike, and `up`'s
    children inherit its environment: `up` always writes the gateway's count out."""
    from stepwise.cli import _gateway_parser
    from stepwise.up import gateway_args

    monkeypatch.setenv("STEPWISE_WORKERS", "5")
    args = gateway_args(["--model", "embedded", "--log-level", "warning"], "127.0.0.1", 0, "team/m", 2)
    ns = _gateway_parser().parse_args(args)
    assert (ns.workers, ns.served_model_name, ns.model, ns.log_level) == (
        2,
        ["team/m"],
        "embedded",
        "warning",
    )
    assert _gateway_parser().parse_args(gateway_args([], "127.0.0.1", 0)).workers == 1
    assert _up_parser().parse_args(["--gateway-workers", "3"]).gateway_workers == 3


def test_up_passes_its_chat_template_and_tool_call_parser_to_the_gateway() -> None:
    from stepwise.cli import _gateway_parser, _gateway_template_flags
    from stepwise.up import gateway_args

    ns, _ = _up_parser().parse_known_args(
        ["--gateway-port", "0", "--chat-template", "hermes", "--tool-call-parser", "llama3_json"]
    )
    gateway = _gateway_parser().parse_args(gateway_args([], "127.0.0.1", 0) + _gateway_template_flags(ns))
    assert (gateway.chat_template, gateway.tool_call_parser) == ("hermes", "llama3_json")
