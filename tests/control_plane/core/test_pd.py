"""Prefill and decode workers (docs/migration.md#prefill-and-decode-workers): engines over FakeWorkers
that share a network, wired as the server wires them. New requests go to the prefill worker, which
hands each to a decode worker with its KV after its first token; every stream is what it is on one
worker."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from control_plane.config import Limits
from control_plane.core.engine import Engine
from control_plane.core.fleet import Fleet, Router
from control_plane.core.worker_checks import hello_refusal
from control_plane.request import FinishKind, RequestParams
from protos.worker import SamplerParams, WorkerLimits
from tests.control_plane.core.test_migration_engine import _alone
from tests.control_plane.fake_core import FakeHub, make_engine, submit

pytestmark = pytest.mark.timeout(60)


def _params(max_new: int) -> RequestParams:
    return RequestParams(max_new_tokens=max_new, ignore_eos=True, sampler=SamplerParams(temperature=0.0))


class Plane:
    """Engines by worker id behind one router; `roles` and `capacities` by worker id."""

    def __init__(self, roles: dict[str, str], capacities: dict[str, int] | None = None) -> None:
        self.hub, self.router = FakeHub(), Router[Engine]("test")
        fleet = Fleet(self.router)
        network: dict[str, list[tuple[int, int]]] = {}
        self.engines: dict[str, Engine] = {}
        for worker, role in roles.items():
            engine, _, _ = make_engine(
                1000,
                capacity=(capacities or {}).get(worker, 2000),
                step_s=0.002,
                worker_id=worker,
                hub=self.hub,
                fleet=fleet,
                network=network,
                role=role,
            )
            self.router.attach(engine)
            self.engines[worker] = engine
        self.network = network
        self.tasks = [asyncio.create_task(e.run()) for e in self.engines.values()]

    def send(self, rid: str, prompt: list[int], max_new: int) -> tuple[int, Engine]:
        engine = self.router.pick(input_ids=None)
        assert engine is not None
        [uid] = submit(engine, rid, prompt, _params(max_new))
        return uid, engine

    async def close(self) -> None:
        for engine in self.engines.values():
            engine.stop()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


@contextlib.asynccontextmanager
async def _plane(roles: dict[str, str], capacities: dict[str, int] | None = None) -> AsyncIterator[Plane]:
    plane = Plane(roles, capacities)
    try:
        yield plane
    finally:
        await plane.close()


async def _settled(plane: Plane) -> None:
    deadline = asyncio.get_running_loop().time() + 10
    while not all(
        e.scheduler.books() == (0, 0) and not e.migration.busy and e.scheduler.is_idle
        for e in plane.engines.values()
    ):
        assert asyncio.get_running_loop().time() < deadline, "books did not settle"
        await asyncio.sleep(0.005)
    assert plane.network == {}


PROMPTS = [[5 + i, 6, 7, 8, 9, 10, 11, 12, 13, 14] for i in range(6)]


async def test_requests_prefill_on_the_prefill_worker_and_decode_on_the_decode_workers() -> None:
    async with _plane({"p": "prefill", "d1": "decode", "d2": "decode"}) as plane:
        sent = [plane.send(f"r{i}", p, 40) for i, p in enumerate(PROMPTS)]
        assert {engine.worker for _, engine in sent} == {"p"}, "new requests go to the prefill worker"
        for uid, _ in sent:
            await asyncio.wait_for(plane.hub.stream(uid).done.wait(), 30)
        for (uid, _), prompt in zip(sent, PROMPTS, strict=True):
            stream = plane.hub.stream(uid)
            assert stream.finished is not None and stream.finished.kind is FinishKind.LENGTH
            assert stream.tokens == await _alone(40, prompt)
        p, d1, d2 = (plane.engines[w] for w in ("p", "d1", "d2"))
        assert p.migration.migrated_out == len(PROMPTS), "every request left the prefill worker"
        assert d1.migration.migrated_in > 0 and d2.migration.migrated_in > 0, "both decode workers took some"
        assert d1.migration.migrated_in + d2.migration.migrated_in == len(PROMPTS)
        # The decode workers prefilled nothing but each request's one continuation token.
        for d in (d1, d2):
            computed = d.step_log.prompt_tokens_total - d.step_log.cached_tokens_total
            assert computed == d.migration.migrated_in
        await _settled(plane)


async def test_a_request_decodes_on_the_prefill_worker_when_no_decode_worker_has_room() -> None:
    async with _plane({"p": "prefill", "d": "decode"}, {"d": 20}) as plane:
        uid, _ = plane.send("r", PROMPTS[0], 30)
        await asyncio.wait_for(plane.hub.stream(uid).done.wait(), 30)
        assert plane.hub.stream(uid).tokens == await _alone(30, PROMPTS[0])
        assert plane.engines["p"].migration.migrated_out == 0
        await _settled(plane)


async def test_new_requests_go_to_decode_workers_only_when_no_other_serves() -> None:
    async with _plane({"d": "decode", "m": "mixed"}) as plane:
        assert {plane.router.pick(input_ids=None).worker for _ in range(4)} == {"m"}  # type: ignore[union-attr]
        plane.engines["m"].stop()
        await asyncio.sleep(0.05)
        picked = plane.router.pick(input_ids=None)
        assert picked is not None and picked.worker == "d"


def test_a_hello_with_an_unknown_role_or_a_role_without_a_transfer_link_is_refused() -> None:
    def refusal_of(limits: WorkerLimits) -> str:
        return hello_refusal(limits, Limits(), tokenizer_vocab=1000)

    assert refusal_of(WorkerLimits("w", 1000, 1, 2048, 1000, transfer_address="w:1", role="prefill")) == ""
    assert "role 'sideways' is not one of mixed, prefill, decode" in refusal_of(
        WorkerLimits("w", 1000, 1, 2048, 1000, transfer_address="w:1", role="sideways")
    )
    refusal = refusal_of(WorkerLimits("w", 1000, 1, 2048, 1000, role="decode"))
    assert "a decode worker must serve a KV transfer link" in refusal
