"""A call's checked parameters cross the frontend link unchanged: what the frontend checked (and
stamped: the grammar's backend, the logprobs mode) is what the core schedules."""

from __future__ import annotations

import pytest

from control_plane import link_params
from control_plane.request import RequestParams
from protos.stepwise.v1 import frontend_pb2 as fe_pb
from protos.worker import Grammar, SamplerParams

EVERYTHING = RequestParams(
    max_new_tokens=0,
    min_new_tokens=3,
    stop=("\n\n", "END"),
    stop_token_ids=frozenset({2, 7}),
    ignore_eos=True,
    sampler=SamplerParams(
        temperature=0.5,
        top_p=0.25,
        top_k=40,
        min_p=0.125,
        repetition_penalty=1.5,
        frequency_penalty=-0.5,
        presence_penalty=0.75,
        seed=(1 << 64) - 1,
        logit_bias=((3, -100.0), (9, 2.5)),
        logprobs=6,
        token_ids_logprob=(11, 4),
        processed_logprobs=True,
        grammar=Grammar("llguidance", "json_schema", '{"type": "object"}'),
    ),
    priority=-5,
    routing_key="conversation-1",
    logprobs=True,
    logprob_start_len=0,
    tenant="team-a",
    ttft_slo_ms=250.0,
    tpot_slo_ms=20.0,
)


def _over_the_link(params: RequestParams) -> RequestParams:
    """What the frontend sends (core_link._arrival's fields for them), as the core reads it."""
    arrival = fe_pb.Arrival(
        uids=[1],
        params=link_params.to_proto(params),
        routing_key=params.routing_key,
        has_priority=params.priority is not None,
        priority=params.priority or 0,
        tenant=params.tenant,
        ttft_slo_ms=params.ttft_slo_ms,
        tpot_slo_ms=params.tpot_slo_ms,
    )
    return link_params.from_arrival(fe_pb.Arrival.FromString(arrival.SerializeToString()))


@pytest.mark.parametrize("params", [RequestParams(), EVERYTHING], ids=["defaults", "everything"])
def test_checked_parameters_cross_the_link_unchanged(params: RequestParams) -> None:
    assert _over_the_link(params) == params


def test_an_unset_max_new_tokens_and_no_prompt_scoring_stay_unset() -> None:
    sent = link_params.to_proto(RequestParams())
    assert not sent.HasField("max_new_tokens") and not sent.HasField("logprob_start_len")
    assert not sent.sampler.HasField("grammar")
