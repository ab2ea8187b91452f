"""The search for a control plane: least-workers choice, the backoff, and searches against fake
control planes answering Census (plaintext and TLS)."""

from __future__ import annotations

import contextlib
import pathlib
import random
import types
from collections.abc import AsyncIterator

import grpc
import pytest

from data_plane import dialer as dialer_module
from data_plane.config import WorkerConfig
from data_plane.dialer import BACKOFF_BASE_S, Candidate, Dialer, Retry, backoff_delays, choose
from protos.targets import Address
from protos.worker import Census, WorkerLimits
from tests.certs import make_ca, make_cert
from tests.data_plane.fake_control import FakeControl, fake_control, free_port

MODEL = "fingerprint-of-our-model"
HELLO = WorkerLimits(
    "w-1", kv_capacity_tokens=1024, page_size=1, max_context=2048, vocab_size=1024, model_fingerprint=MODEL
)


def candidate(
    last_octet: int,
    workers: int,
    queued: int = 0,
    running: int = 0,
    accepting: bool = True,
    **census: str | bool,
) -> Candidate:
    address = Address(f"10.0.0.{last_octet}", 50052, "cp.svc")
    return Candidate(
        address, Census(workers=workers, queued=queued, running=running, accepting=accepting, **census)
    )


def chosen_octet(
    *candidates: Candidate, avoid: Candidate | None = None, refused: tuple[Candidate, ...] = ()
) -> int | None:
    chosen = choose(candidates, MODEL, avoid, refused)
    return None if chosen is None else int(chosen.address.ip.rsplit(".", 1)[1])


# ---- the choice --------------------------------------------------------------------------------


def test_the_fewest_workers_win() -> None:
    assert chosen_octet(candidate(1, 2), candidate(2, 0), candidate(3, 1)) == 2


def test_ties_go_to_the_least_loaded_then_the_lowest_address() -> None:
    assert chosen_octet(candidate(1, 1, queued=5), candidate(2, 1, queued=1, running=3), candidate(3, 2)) == 2
    assert (
        chosen_octet(
            candidate(3, 1, running=2), candidate(1, 1, queued=2), candidate(2, 1, queued=1, running=1)
        )
        == 1
    )


def test_those_not_accepting_or_serving_another_model_are_skipped() -> None:
    draining = candidate(1, 0, accepting=False)
    other_model = candidate(2, 0, model_fingerprint="another model")
    ours = candidate(3, 4, model_fingerprint=MODEL)
    assert chosen_octet(draining, other_model, ours) == 3
    assert chosen_octet(draining, other_model) is None
    assert chosen_octet() is None


def test_the_control_plane_to_avoid_is_skipped_only_while_another_fits() -> None:
    mover, other = candidate(1, 0), candidate(2, 5)
    assert chosen_octet(mover, other, avoid=mover) == 2
    assert chosen_octet(mover, candidate(2, 0, accepting=False), avoid=mover) == 1


def test_one_control_plane_on_two_addresses_is_avoided_on_both() -> None:
    """127.0.0.1 and ::1 may be one control plane: the id, not the address, says which it is."""
    left = candidate(1, 0, control_plane_id="cp-a")
    same_elsewhere, other = candidate(2, 0, control_plane_id="cp-a"), candidate(3, 3, control_plane_id="cp-b")
    assert chosen_octet(same_elsewhere, other, avoid=left) == 3


def test_a_control_plane_whose_census_refuses_this_worker_is_skipped() -> None:
    refusing = candidate(1, 0, hello_judged=True, refusal="page_size 1 differs from --page-size 16")
    assert chosen_octet(refusing, candidate(2, 4)) == 2
    assert chosen_octet(refusing) is None
    # Not judged (an older control plane): a refusal it could not have meant is not believed.
    assert chosen_octet(candidate(1, 0, refusal="stray"), candidate(2, 4)) == 1


def test_a_control_plane_that_refused_this_worker_is_never_chosen_again_even_to_avoid_another() -> None:
    refused, mover = candidate(1, 0, control_plane_id="cp-b"), candidate(2, 3, control_plane_id="cp-a")
    assert chosen_octet(refused, mover, refused=(refused,)) == 2
    # Unlike the control plane to avoid, a refusing one is not the fallback.
    assert chosen_octet(refused, mover, avoid=mover, refused=(refused,)) == 2
    assert chosen_octet(refused, refused=(refused,)) is None
    # The same control plane on another address is the same refusal; a restarted one (a new id) is not.
    assert chosen_octet(candidate(3, 0, control_plane_id="cp-b"), mover, refused=(refused,)) == 2
    assert chosen_octet(candidate(1, 0, control_plane_id="cp-b2"), mover, refused=(refused,)) == 1


# ---- the backoff -------------------------------------------------------------------------------


def test_delays_double_with_equal_jitter_up_to_the_cap() -> None:
    delays = backoff_delays(0.1, 5.0, random.Random(7))
    got = [next(delays) for _ in range(12)]
    steps = [min(0.1 * 2**i, 5.0) for i in range(12)]
    assert all(step / 2 <= d <= step for d, step in zip(got, steps, strict=True)), got
    assert max(got) <= 5.0 and min(got[8:]) >= 2.5  # capped, and never below half the cap
    assert len(set(got)) == len(got)  # jittered
    again = backoff_delays(0.1, 5.0, random.Random(7))
    assert [next(again) for _ in range(12)] == got  # the seed decides


def test_a_cap_below_the_base_caps_the_first_delay_too() -> None:
    delays = backoff_delays(0.1, 0.04, random.Random(1))
    assert all(0.02 <= next(delays) <= 0.04 for _ in range(5))


class VirtualTime:
    """The dialer's clock and sleep, moved only by its own sleeps: each wait is recorded and costs
    no real time, so a test sees exactly how long the backoff would have slept."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 1000.0
        self.slept: list[float] = []
        monkeypatch.setattr(dialer_module, "time", types.SimpleNamespace(monotonic=lambda: self.now))
        monkeypatch.setattr(dialer_module, "asyncio", types.SimpleNamespace(sleep=self.sleep))

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


async def test_retry_gives_up_at_the_deadline_until_first_welcomed(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = VirtualTime(monkeypatch)
    retry = Retry(cap_s=0.05, deadline=clock.now + 0.15, rng=random.Random(3))
    waits = 0
    while await retry.wait():
        waits += 1
    # Capped delays up to the deadline and not past it: the last one is cut short to end there.
    assert sum(clock.slept) == pytest.approx(0.15) and max(clock.slept) <= 0.05
    assert waits == retry.attempt == len(clock.slept) >= 3
    retry.welcomed()  # once attached, no deadline: the searches go on
    assert retry.deadline is None and retry.attempt == 0
    assert await retry.wait()


async def test_retry_after_welcome_starts_from_the_base_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = VirtualTime(monkeypatch)
    retry = Retry(cap_s=10.0, deadline=None, rng=random.Random(3))
    for _ in range(4):
        next(retry._delays)
    retry.welcomed()
    assert await retry.wait()
    assert len(clock.slept) == 1 and BACKOFF_BASE_S / 2 <= clock.slept[0] <= BACKOFF_BASE_S


# ---- searching fake control planes --------------------------------------------------------------


@contextlib.asynccontextmanager
async def control_planes(*censuses: Census | None) -> AsyncIterator[list[FakeControl]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(fake_control(census=c)) for c in censuses]


def dialer(control: str, **tls: object) -> Dialer:
    return Dialer(WorkerConfig(control=control, **tls), HELLO)  # type: ignore[arg-type]


async def test_the_search_attaches_to_the_fewest_workers_and_skips_the_unreachable() -> None:
    async with control_planes(Census(workers=2), Census(workers=0), Census(workers=1)) as planes:
        control = ",".join([f"127.0.0.1:{free_port()}", *(p.address for p in planes)])
        found = (await dialer(control).search()).chosen
    assert found is not None and found.address.target == planes[1].address


async def test_the_search_skips_a_control_plane_that_is_not_accepting() -> None:
    async with control_planes(Census(workers=0, accepting=False), Census(workers=3)) as planes:
        found = (await dialer(",".join(p.address for p in planes)).search()).chosen
    assert found is not None and found.address.target == planes[1].address


async def test_a_control_plane_without_census_counts_as_empty() -> None:
    async with control_planes(Census(workers=1), None) as planes:
        found = (await dialer(",".join(p.address for p in planes)).search()).chosen
    assert found is not None and found.address.target == planes[1].address


async def test_nothing_reachable_is_no_choice() -> None:
    found = await dialer(f"127.0.0.1:{free_port()}").search()
    assert found.chosen is None and found.refused_everywhere == ()


async def test_with_tls_the_address_is_dialled_and_the_name_verified(tmp_path: pathlib.Path) -> None:
    """The certificate names only "localhost": the census over 127.0.0.1 passes because the
    worker verifies the name it was given, and fails when told to verify another name."""
    ca = make_ca(tmp_path)
    cert = make_cert(ca, tmp_path, "control", ip=None, dns=("localhost",))
    creds = grpc.ssl_server_credentials([cert.key_and_chain()])
    async with fake_control(census=Census(workers=0), server_credentials=creds) as plane:
        found = (await dialer(f"localhost:{plane.port}", tls_ca=ca.cert).search()).chosen
        assert found is not None
        assert (found.address.target, found.address.host) == (plane.address, "localhost")
        wrong_name = dialer(f"localhost:{plane.port}", tls_ca=ca.cert, tls_server_name="elsewhere")
        assert (await wrong_name.search()).chosen is None


async def test_a_control_plane_serving_another_model_is_skipped() -> None:
    other = Census(workers=0, model_fingerprint="another model")
    async with control_planes(other, Census(workers=9, model_fingerprint=MODEL)) as planes:
        found = (await dialer(",".join(p.address for p in planes)).search()).chosen
    assert found is not None and found.address.target == planes[1].address


async def test_the_search_asks_about_this_worker_and_says_when_every_address_refuses_it() -> None:
    refusing = Census(workers=0, hello_judged=True, refusal="page_size 1 differs from --page-size 16")
    async with control_planes(refusing, Census(workers=2)) as planes:
        search = dialer(",".join(p.address for p in planes))
        found = await search.search()
        assert found.chosen is not None and found.chosen.address.target == planes[1].address
        assert found.refused_everywhere == ()
        asked = planes[0].census_hellos[0]
        assert asked is not None and asked.worker_id == HELLO.worker_id
        # The other one refuses at Connect: remembered, so now every address refuses.
        search.refused(found.chosen, "model_fingerprint differs")
        found = await search.search()
    assert found.chosen is None
    assert [(r.candidate.address.target, r.reason) for r in found.refused_everywhere] == [
        (planes[0].address, refusing.refusal),
        (planes[1].address, "model_fingerprint differs"),
    ]


async def test_a_refusal_remembered_is_said_for_each_address_the_control_plane_answers_on() -> None:
    """One control plane on two addresses (its id says so), refused on one: it refuses on both."""
    same = Census(control_plane_id="cp-b", workers=0)
    async with control_planes(same, same) as planes:
        search = dialer(",".join(p.address for p in planes))
        first = (await search.search()).chosen
        assert first is not None
        search.refused(first, "page size")
        found = await search.search()
    assert found.chosen is None
    assert [(r.candidate.address.target, r.reason) for r in found.refused_everywhere] == [
        (p.address, "page size") for p in planes
    ]


async def test_refused_here_and_unreachable_there_is_not_refused_everywhere() -> None:
    refusing = Census(workers=0, hello_judged=True, refusal="page size")
    async with control_planes(refusing) as planes:
        found = await dialer(f"{planes[0].address},127.0.0.1:{free_port()}").search()
    assert found.chosen is None and found.refused_everywhere == ()
