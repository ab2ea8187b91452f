"""The tenant and SLO fields from the client protocol and the gateway into RequestParams."""

from __future__ import annotations

import pytest

from clients.client import generate_request
from control_plane.frontend import client_codec
from gateway.schemas import CompletionRequest
from protos.stepwise.v1 import generation_pb2 as gen_pb


def test_generate_request_fields_reach_request_params() -> None:
    msg = generate_request("hi", tenant="alice", ttft_slo_ms=1500.0, tpot_slo_ms=80.0)
    params = client_codec.generate_input_from_proto(msg).params
    assert (params.tenant, params.ttft_slo_ms, params.tpot_slo_ms) == ("alice", 1500.0, 80.0)
    # Unset: no tenant named, no objectives.
    params = client_codec.generate_input_from_proto(gen_pb.GenerateRequest(text="hi")).params
    assert (params.tenant, params.ttft_slo_ms, params.tpot_slo_ms) == ("", 0.0, 0.0)


@pytest.mark.parametrize("name", ["ttft_slo_ms", "tpot_slo_ms"])
@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_bad_objectives_are_refused_naming_the_field(name: str, value: float) -> None:
    msg = gen_pb.GenerateRequest(text="hi", **{name: value})
    with pytest.raises(client_codec.InvalidArgument, match=f"^{name}: "):
        client_codec.generate_input_from_proto(msg)


def test_an_overlong_tenant_is_refused_naming_the_field() -> None:
    msg = gen_pb.GenerateRequest(text="hi", tenant="x" * 257)
    with pytest.raises(client_codec.InvalidArgument, match=r"^tenant: 257 characters"):
        client_codec.generate_input_from_proto(msg)


def test_gateway_body_names_the_tenant_else_user() -> None:
    body = CompletionRequest(model="m", prompt="hi", user="u1", ttft_slo_ms=900, tpot_slo_ms=50)
    req = body.grpc_request("hi", "r1")
    assert (req.tenant, req.routing_key, req.ttft_slo_ms, req.tpot_slo_ms) == ("u1", "u1", 900.0, 50.0)
    body = CompletionRequest(model="m", prompt="hi", user="u1", tenant="team-a")
    assert body.grpc_request("hi", "r1").tenant == "team-a"
    assert CompletionRequest(model="m", prompt="hi").grpc_request("hi", "r1").tenant == ""
