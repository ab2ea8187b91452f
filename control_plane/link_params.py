"""A call's checked parameters on the frontend link (frontend.proto: Arrival, CheckedParams).

The frontend writes the RequestParams it checked from the client's request (frontend/client_codec.py), its
grammar compiled and stamped with the backend that compiled it; the core reads them back as they
are. The core trusts its frontends (its own processes, behind its socket), so nothing here checks:
what a client may send is the frontend's to refuse, with the field named.
"""

from __future__ import annotations

from control_plane.request import RequestParams
from protos import worker_codec
from protos.stepwise.v1 import frontend_pb2 as fe_pb


def to_proto(params: RequestParams) -> fe_pb.CheckedParams:
    """The link's form of what the core reads of RequestParams beside the arrival's own fields
    (priority, routing key, tenant and latency objectives)."""
    return fe_pb.CheckedParams(
        max_new_tokens=params.max_new_tokens,
        min_new_tokens=params.min_new_tokens,
        stop=params.stop,
        stop_token_ids=sorted(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        sampler=worker_codec.sampler_to_proto(params.sampler),
        logprobs=params.logprobs,
        logprob_start_len=params.logprob_start_len if params.logprob_start_len >= 0 else None,
    )


def from_arrival(msg: fe_pb.Arrival) -> RequestParams:
    """The arrival's parameters as its frontend checked them; the tenant is the one the client
    named (the core resolves it against the caller's key)."""
    p = msg.params
    return RequestParams(
        max_new_tokens=p.max_new_tokens if p.HasField("max_new_tokens") else None,
        min_new_tokens=p.min_new_tokens,
        stop=tuple(p.stop),
        stop_token_ids=frozenset(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        sampler=worker_codec.sampler_from_proto(p.sampler),
        priority=msg.priority if msg.has_priority else None,
        routing_key=msg.routing_key,
        logprobs=p.logprobs,
        logprob_start_len=p.logprob_start_len if p.HasField("logprob_start_len") else -1,
        tenant=msg.tenant,
        ttft_slo_ms=msg.ttft_slo_ms,
        tpot_slo_ms=msg.tpot_slo_ms,
    )
