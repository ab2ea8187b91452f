"""The tenant file: what it accepts, how it refuses (naming the field), and key→tenant binding."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import pytest

from control_plane.tenants.table import (
    DEFAULT_TENANT,
    TenantFileError,
    TenantRefused,
    TenantTable,
    check_objectives,
    load,
    parse,
)

KEY_A = "key:0123456789ab"
KEY_B = "key:ba9876543210"

GOOD = f"""
prompt_weight = 1
output_weight = 2

[defaults]
max_concurrent_requests = 4
token_rate = 100.0

[tenants.alice]
weight = 2
keys = ["{KEY_A}"]
may_name = ["alice-batch"]
max_queued_requests = 8
token_rate = 1000.0
token_burst = 5000.0
ttft_slo_ms = 2000

[tenants.gateway]
keys = ["{KEY_B}"]
may_name = ["*"]
"""


def test_a_good_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(GOOD)
    table = load(path)
    alice = table.entry("alice")
    assert (alice.weight, alice.max_queued_requests) == (2, 8)
    assert (alice.token_rate, alice.token_burst) == (1000, 5000)
    assert alice.ttft_slo_ms == 2000
    # Unlisted tenants get the default entry under their own name.
    stranger = table.entry("stranger")
    assert (stranger.name, stranger.max_concurrent_requests, stranger.token_rate) == ("stranger", 4, 100)
    # A rate without a burst: a second's worth.
    assert stranger.token_burst == 100
    assert table.bound == {KEY_A: "alice", KEY_B: "gateway"}


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("[tenants.a]\nwieght = 2\n", "tenants.a.wieght: unknown field"),
        ("colour = 1\n", "colour: unknown field"),
        ("[tenants.a]\nweight = 0\n", "tenants.a.weight: must be > 0"),
        ("[tenants.a]\ntoken_rate = -1\n", "tenants.a.token_rate: must be >= 0"),
        ("[tenants.a]\ntoken_rate = nan\n", "tenants.a.token_rate: must be a finite number"),
        ("[tenants.a]\nmax_concurrent_requests = 1.5\n", "tenants.a.max_concurrent_requests: must be"),
        ("[tenants.a]\ntoken_burst = 10\n", "tenants.a.token_burst: needs token_rate"),
        ("[tenants.a]\ntoken_rate = 10000\ntoken_burst = 1\n", "tenants.a.token_burst: 1.0 is infeasible"),
        ("[tenants.a]\nkeys = ['sk-secret']\n", "tenants.a.keys: 'sk-secret' is not a key id"),
        (f"[tenants.a]\nkeys = ['{KEY_A}']\n[tenants.b]\nkeys = ['{KEY_A}']\n", "tenants.b.keys:"),
        ("[defaults]\nkeys = []\n", "defaults.keys: only a named tenant"),
        ("max_metric_tenants = 0\n", "max_metric_tenants: must be at least 1"),
        ("tenants = 3\n", "tenants: must be a table"),
    ],
)
def test_a_bad_file_names_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    with pytest.raises(TenantFileError) as caught:
        load(path)
    assert str(caught.value).startswith(field), str(caught.value)
    assert "\n" not in str(caught.value)


def test_unreadable_and_not_toml(tmp_path: Path) -> None:
    with pytest.raises(TenantFileError, match="--tenants: cannot read"):
        load(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[tenants\n")
    with pytest.raises(TenantFileError, match="is not TOML"):
        load(bad)


def test_without_keys_any_name_goes() -> None:
    table = parse({})
    assert table.resolve("ipv4:127.0.0.1:5000", False, "") == DEFAULT_TENANT
    assert table.resolve("ipv4:127.0.0.1:5000", False, "bob") == "bob"


def test_a_bound_key_is_its_tenant_and_names_only_what_it_may() -> None:
    table = load_text(GOOD)
    assert table.resolve(KEY_A, True, "") == "alice"
    assert table.resolve(KEY_A, True, "alice") == "alice"
    assert table.resolve(KEY_A, True, "alice-batch") == "alice-batch"
    with pytest.raises(TenantRefused, match="tenant: this API key may not name tenant 'bob'"):
        table.resolve(KEY_A, True, "bob")
    # A key allowed "*" names anyone (a trusted gateway's key, say).
    assert table.resolve(KEY_B, True, "bob") == "bob"


def test_an_unbound_key_is_a_tenant_of_its_own() -> None:
    table = load_text(GOOD)
    other = "key:ffffffffffff"
    assert table.resolve(other, True, "") == other
    with pytest.raises(TenantRefused):
        table.resolve(other, True, "alice")


def load_text(text: str) -> TenantTable:
    return parse(tomllib.loads(text))


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("[tenants.a]\nttft_slo_ms = 5\n", "tenants.a.ttft_slo_ms"),
        ("[defaults]\ntpot_slo_ms = 9.5\n", "defaults.tpot_slo_ms"),
    ],
)
def test_an_objective_no_step_can_meet_is_infeasible_under_the_cost_model(text: str, field: str) -> None:
    """With --slo-cost every step costs at least its `a` (10 ms here): an objective under it would
    refuse every request of the tenant, so the file is refused, naming the field."""
    table = parse(tomllib.loads(text))
    with pytest.raises(TenantFileError, match=rf"^{field}: .*infeasible.*10 ms"):
        check_objectives(table, (0.01, 0.001, 0.0, 0.0))
    check_objectives(table, ())  # without a cost model nothing is predicted: any objective stands
    feasible = parse({"defaults": {"tpot_slo_ms": 10}, "tenants": {"a": {"ttft_slo_ms": 10}}})
    check_objectives(feasible, (0.01, 0.001, 0.0, 0.0))


def test_the_start_refuses_an_infeasible_objective_with_one_error(tmp_path: Path) -> None:
    from control_plane import config as control_config

    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.a]\nttft_slo_ms = 1\n")
    parser = argparse.ArgumentParser()
    control_config.add_arguments(parser)
    ns = parser.parse_args(["--tenants", str(path), "--slo-cost", "0.01,0.001,0,0"])
    with pytest.raises(TenantFileError, match=r"^tenants\.a\.ttft_slo_ms: "):
        control_config.control_config_from_args(ns, tmp_path)


GOOD_YAML = f"""
prompt_weight: 1
output_weight: 2
defaults:
  max_concurrent_requests: 4
  token_rate: 100.0
tenants:
  alice:
    weight: 2
    keys: ["{KEY_A}"]
    may_name: [alice-batch]
    max_queued_requests: 8
    token_rate: 1000.0
    token_burst: 5000.0
    ttft_slo_ms: 2000
  gateway:
    keys: ["{KEY_B}"]
    may_name: ["*"]
"""


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_a_yaml_file_is_the_same_table(tmp_path: Path, suffix: str) -> None:
    """The issue's "YAML or TOML": a file named *.yaml or *.yml is read as YAML, into the same
    table, checked by the same rules."""
    toml, yaml = tmp_path / "t.toml", tmp_path / f"t{suffix}"
    toml.write_text(GOOD)
    yaml.write_text(GOOD_YAML)
    assert load(yaml) == load(toml)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("tenants:\n  a:\n    wieght: 2\n", "tenants.a.wieght: unknown field"),
        ("tenants:\n  a:\n    weight: 0\n", "tenants.a.weight: must be > 0"),
        ("tenants:\n  a:\n    token_rate:\n", "tenants.a.token_rate: must be a finite number, got None"),
        ("tenants:\n  a:\n    max_queued_requests: yes\n", "tenants.a.max_queued_requests: must be"),
        ("- a\n- b\n", "--tenants: "),
        ("tenants: [a\n", "--tenants: "),
    ],
)
def test_a_bad_yaml_file_is_one_line_naming_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    with pytest.raises(TenantFileError) as caught:
        load(path)
    assert str(caught.value).startswith(field), str(caught.value)
    assert "\n" not in str(caught.value)


def test_an_empty_yaml_file_is_an_empty_table(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yml"
    path.write_text("# no tenants yet\n")
    assert load(path) == parse({})
