"""One parser for a step cost 'a,b,c[,d]' (flagtypes.cost): --sim-cost, --cost and --slo-cost accept
and refuse the same coefficients, each refusal one line naming its flag."""

from __future__ import annotations

import argparse

import pytest

from flagtypes.cost import linear_cost

REFUSED = ("1,2", "1,2,3,4,5", "a,b,c", "-1,0,0,0", "0,0,nan,0", "0,0,inf,0", "0.01,0.001,0,-0.002", "")


def test_three_or_four_terms_with_a_decode_credit_down_to_minus_b() -> None:
    assert linear_cost("0.01,0.001,0.0001") == (0.01, 0.001, 0.0001)
    assert linear_cost("0.01,0.001,0,-0.001") == (0.01, 0.001, 0.0, -0.001)
    assert linear_cost("0,0,0,0", terms=(4,)) == (0.0, 0.0, 0.0, 0.0)
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected 'a,b,c,d' in seconds, got '1,2,3'"):
        linear_cost("1,2,3", terms=(4,))


@pytest.mark.parametrize("text", REFUSED)
def test_every_cost_flag_refuses_alike_naming_itself(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    from data_plane.sim import CostModel
    from stepwise import cli
    from stepwise.costs import parse_cost

    with pytest.raises(argparse.ArgumentTypeError):
        linear_cost(text)
    with pytest.raises(ValueError, match=r"^--sim-cost: expected"):
        CostModel.parse(text)
    if text:  # '' is no file name: --cost refuses it in words of its own
        with pytest.raises(ValueError, match=r"^--cost: expected"):
            parse_cost(text)
    with pytest.raises(SystemExit) as exited:
        cli.COMMANDS["control"].parser().parse_args(["--slo-cost", text or ","])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.splitlines()) == 1 and "--slo-cost: expected" in err, err


def test_an_empty_slo_cost_is_no_slo_admission() -> None:
    from stepwise import cli

    assert cli.COMMANDS["control"].parser().parse_args(["--slo-cost", " "]).slo_cost == ()
