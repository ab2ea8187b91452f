"""Round trips through protobuf for every message the worker sends or receives; flag parsing."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib

import numpy as np
import pytest

from data_plane import codec
from data_plane.config import add_arguments, config_from_args
from data_plane.messages import (
    Hello,
    KvReport,
    KvTransfer,
    SamplerParams,
    Shutdown,
    StepResult,
    TokenLogprobs,
    Welcome,
)
from protos.stepwise.v1 import worker_pb2
from tests.data_plane.factories import Extend, make_plan, new_seq


def assert_same(a: object, b: object) -> None:
    """Field-by-field equality that understands numpy arrays inside (frozen) dataclasses."""
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        assert type(a) is type(b)
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def _wire(message):  # type: ignore[no-untyped-def]
    """Serialise and parse again, as the stream does."""
    return type(message).FromString(message.SerializeToString())


def test_step_plan_round_trip() -> None:
    sampler = SamplerParams(temperature=0.5, top_p=0.875, top_k=40, min_p=0.0625, seed=2**63 + 5, logprobs=3)
    plan = make_plan(
        2**40,
        new_seqs=[new_seq(2**64 - 1, sampler, np.array([4, 9], np.int64), history=[1, 2, 3])],
        extends=[
            Extend(2**64 - 1, 2, [7, 8, 9], np.array([10, 3, 2**40], np.int64)),
            Extend(5, 0, [1], np.array([6])),
        ],
        decodes=[(8, 12), (9, 13)],
        releases=[3, 4],
        offloads=[KvTransfer(6, np.array([1, 2], np.int64))],
        restores=[KvTransfer(7, np.array([5], np.int64))],
    )
    decoded = codec.control_from_proto(worker_pb2.ControlMessage(plan=_wire(codec.plan_to_proto(plan))))
    assert_same(decoded, plan)


def test_unset_proto_sampler_fields_mean_off() -> None:
    assert codec.sampler_from_proto(worker_pb2.SamplerParams()) == SamplerParams()


def test_step_result_round_trip() -> None:
    result = StepResult(
        step_id=9,
        handles=np.array([1, 2**64 - 1], np.uint64),
        token_ids=np.array([5, 1023], np.int64),
        kv=KvReport(live_seqs=2, seq_slots=40, capacity_tokens=4096, device_mem_used_bytes=123, host_seqs=1),
        forward_s=0.25,
        logprobs=(TokenLogprobs(-0.5, (5, 7), (-0.5, -1.5)), TokenLogprobs(-2.0)),
        error="",
    )
    assert_same(codec.result_from_proto(_wire(codec.result_to_proto(result)).result), result)


def test_hello_and_control_events_round_trip() -> None:
    hello = Hello(
        "w-1", "ab" * 32, 4096, 16, 2048, 1024, "float32", "cpu", (0, 2), host_pool_capacity_tokens=64
    )
    assert codec.hello_from_proto(_wire(codec.hello_to_proto(hello)).hello) == hello
    welcome = worker_pb2.ControlMessage(welcome=worker_pb2.Welcome(accepted=False, reason="fingerprint"))
    assert codec.control_from_proto(_wire(welcome)) == Welcome(False, "fingerprint")
    bye = worker_pb2.ControlMessage(shutdown=worker_pb2.Shutdown(reason="done"))
    assert codec.control_from_proto(_wire(bye)) == Shutdown("done")
    with pytest.raises(ValueError):
        codec.control_from_proto(worker_pb2.ControlMessage())


def test_flags_build_a_frozen_config() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ns = parser.parse_args(["--model", "/m", "--kv-tokens", "512", "--page-size", "16", "--control", "h:1"])
    config = config_from_args(ns)
    assert (config.model, config.kv_tokens, config.page_size, config.control) == (
        pathlib.Path("/m"),
        512,
        16,
        "h:1",
    )
    assert config.worker_id  # hostname-pid by default
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.page_size = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="page-size"):
        config_from_args(parser.parse_args(["--model", "/m", "--page-size", "0"]))
