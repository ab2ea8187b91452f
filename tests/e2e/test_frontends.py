"""The control plane as processes: a core that decides, frontends that stream, overlap scheduling.

Greedy output must not depend on how the control plane is cut into processes or on how many plans
are in flight: every configuration below equals transformers' own generate(). A frontend that dies
takes only its own clients with it; the core frees their KV and the other frontends keep serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from clients.client import StepwiseClient, generate_request, sampling_params
from control_plane.tokenizer import Tokenizer
from protos.stepwise.v1 import generation_pb2_grpc as gen_grpc
from tests.e2e.conftest import ControlProcess, reference_greedy
from tests.e2e.test_generate import MAX_NEW as ALL_MAX_NEW
from tests.e2e.test_generate import PROMPTS as ALL_PROMPTS
from tests.sockets import connections_by_pid

pytestmark = pytest.mark.timeout(300)

# Six of the end-to-end prompts: short and long, so batches mix prefill lengths.
PROMPTS, MAX_NEW = ALL_PROMPTS[:6], ALL_MAX_NEW[:6]


async def _greedy(address: str, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    async with StepwiseClient(address) as client:
        gens = await asyncio.gather(
            *(
                client.generate(ids, max_new_tokens=n, temperature=0.0)
                for ids, n in zip(prompts, max_new, strict=True)
            )
        )
    assert all(g.finish_reason in ("stop", "length") for g in gens), gens
    return [g.token_ids for g in gens]


async def _settled(address: str, timeout: float = 15.0) -> None:
    """The books and every worker's report agree at zero: nothing leaked."""
    async with StepwiseClient(address) as client:
        deadline = time.monotonic() + timeout
        while True:
            info = await client.server_info()
            states = [
                (w.book_live_seqs, w.reported_live_seqs, w.book_seq_slots, w.running) for w in info.workers
            ]
            if all(s == (0, 0, 0, 0) for s in states):
                assert all(w.kv_mismatches == 0 for w in info.workers)
                return
            assert time.monotonic() < deadline, f"books did not settle: {states}"
            await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    ("control", "retract"),
    [
        ([], False),
        (["--disable-overlap-schedule"], False),
        (["--frontends", "3", "--chunked-prefill-size", "16"], False),
        (["--frontends", "3", "--chunked-prefill-size", "16"], True),
        (["--frontends", "3", "--chunked-prefill-size", "16", "--disable-overlap-schedule"], True),
    ],
    ids=["overlap", "no-overlap", "3-frontends-chunk16", "3-frontends-retract", "no-overlap-retract"],
)
async def test_greedy_is_the_same_however_the_plane_is_cut(
    start_stack, model_dir: Path, control: list[str], retract: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if retract:
        monkeypatch.setenv("STEPWISE_TEST_RETRACT", "1")
    stack = await start_stack([*control, "--stream-interval", "3"])
    tok = Tokenizer.from_dir(model_dir)
    prompts, eos = [tok.encode(p) for p in PROMPTS], set(tok.eos_token_ids)
    got = await _greedy(stack.address, prompts, MAX_NEW)
    for ids, n, tokens in zip(prompts, MAX_NEW, got, strict=True):
        assert tokens == reference_greedy(model_dir, ids, n, eos), f"prompt of {len(ids)} tokens"
    if retract:
        async with StepwiseClient(stack.address) as client:
            assert (await client.server_info()).workers[0].retractions > 0
    await _settled(stack.address)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
async def test_max_new_tokens_streams_exactly_that_many(start_control, overlap: bool) -> None:
    plane = await start_control(
        *([] if overlap else ["--disable-overlap-schedule"]), "--stream-interval", "4"
    )
    plane.add_worker("sim-0")
    await plane.wait_workers(1)
    async with StepwiseClient(plane.address) as client:
        for n in (1, 2, 3, 7, 64):
            gen = await client.generate([11, 12, 13], max_new_tokens=n, ignore_eos=True, temperature=0.0)
            assert (len(gen.token_ids), gen.completion_tokens, gen.finish_reason) == (n, n, "length")
    await _settled(plane.address)


async def test_a_killed_frontend_takes_only_its_clients(start_control) -> None:
    plane = await start_control("--frontends", "3")
    plane.add_worker("sim-0", "--sim-cost", "0.01,0,0")
    await plane.wait_workers(1)
    pids = plane.ready["frontend_pids"]
    assert len(pids) == 3
    sampling = sampling_params(max_new_tokens=100_000, ignore_eos=True, temperature=0.0)
    # Separate connections (gRPC shares one between identical channels unless told not to).
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(plane.address, options=options) for _ in range(12)]
    try:
        calls = [
            gen_grpc.GenerationStub(ch).Generate(generate_request([5, 6, 7], sampling)) for ch in channels
        ]
        for call in calls:  # every stream is running
            await call.read()
        victim = _serving_some(plane)
        os.kill(victim, signal.SIGKILL)
        outcomes = await asyncio.gather(*(_outcome(call) for call in calls))
        unavailable = [o for o in outcomes if o == grpc.StatusCode.UNAVAILABLE]
        alive = [o for o in outcomes if o == "streaming"]
        assert unavailable and alive and len(unavailable) + len(alive) == 12, outcomes
        for call, outcome in zip(calls, outcomes, strict=True):
            if outcome == "streaming":
                call.cancel()
    finally:
        for ch in channels:
            await ch.close()
    # The core aborted the dead frontend's requests (and the others were cancelled): nothing leaks.
    await _settled(plane.address)
    async with StepwiseClient(plane.address) as client:  # new calls are served
        gen = await client.generate([5, 6, 7], max_new_tokens=5, ignore_eos=True)
        assert len(gen.token_ids) == 5


async def _outcome(call: grpc.aio.UnaryStreamCall, window: float = 3.0) -> object:
    """UNAVAILABLE (or another status) if the stream breaks within the window, else "streaming"."""
    deadline = time.monotonic() + window
    try:
        while time.monotonic() < deadline:
            await asyncio.wait_for(call.read(), timeout=window)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    except TimeoutError:
        return "stalled"
    return "streaming"


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_five_thousand_concurrent_streams_queue_or_are_refused_never_cancelled(start_control) -> None:
    bound = 1000
    plane = await start_control("--max-queued-requests", str(bound), "--max-running-requests", "64")
    plane.add_worker("sim-0", "--sim-cost", "0.02,0,0", "--kv-tokens", "1048576")
    await plane.wait_workers(1)
    sampling = sampling_params(max_new_tokens=8, ignore_eos=True, temperature=0.0)
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(plane.address, options=options) for _ in range(10)]
    try:
        stubs = [gen_grpc.GenerationStub(ch) for ch in channels]

        async def one(i: int) -> object:
            try:
                tokens = 0
                async for response in stubs[i % len(stubs)].Generate(generate_request([7, 8, 9], sampling)):
                    if response.WhichOneof("event") == "chunk":
                        tokens += len(response.chunk.token_ids)
                    elif response.finished.reason:
                        return ("finished", tokens)
                return ("no finish", tokens)
            except grpc.aio.AioRpcError as exc:
                return exc.code()

        outcomes = await asyncio.gather(*(one(i) for i in range(5000)))
    finally:
        for ch in channels:
            await ch.close()
    finished = [o for o in outcomes if isinstance(o, tuple) and o[0] == "finished"]
    refused = [o for o in outcomes if o == grpc.StatusCode.RESOURCE_EXHAUSTED]
    others = [o for o in outcomes if o not in finished and o not in refused]
    assert not others, f"{len(others)} streams ended otherwise, e.g. {others[:3]}"
    assert all(tokens == 8 for _, tokens in finished)
    # The queue filled (arrivals outpace a 64-wide batch of 20 ms steps): past the bound, refusals;
    # at least the queue's worth and what ran meanwhile was served.
    assert refused and len(finished) >= bound, (len(finished), len(refused))
    await _settled(plane.address, timeout=60)


@pytest.mark.slow
async def test_a_session_with_overlap_and_two_frontends_replays_identically(
    start_stack, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from stepwise import replay
    from tests.record.test_e2e_record import _wait_for_idle_flush

    monkeypatch.setenv("STEPWISE_TEST_RETRACT", "1")
    rec_dir = tmp_path / "rec"
    stack = await start_stack(["--record", str(rec_dir), "--frontends", "2", "--chunked-prefill-size", "16"])
    async with StepwiseClient(stack.address) as client:
        free = await client.generate("The king said", max_new_tokens=20, temperature=0.0)
        stop = free.text[3:6]
        gens = await asyncio.gather(
            *(client.generate(p, max_new_tokens=12 + 3 * i, temperature=0.0) for i, p in enumerate(PROMPTS)),
            client.generate("The king said", max_new_tokens=20, temperature=0.0, stop=[stop]),
        )
    assert gens[-1].finish_reason == "stop" and gens[-1].text == free.text[: free.text.index(stop)]
    path = await _wait_for_idle_flush(rec_dir)
    stack.stop()
    capsys.readouterr()
    assert replay.main(["scheduler", str(path)]) == 0
    assert replay.main(["worker", str(path), "--model", str(model_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("identical:") and out[1].startswith("identical:"), out


# A short heartbeat, so a stall is found within seconds here (the defaults allow 10 s).
HEARTBEAT = ["--frontend-heartbeat-interval", "0.5", "--frontend-heartbeat-timeout", "3"]


def _alive(pid: int) -> bool:
    """Running or stopped; a zombie (dead, not yet reaped) is not alive."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def _serving_some(plane: ControlProcess, others: bool = True) -> int:
    """A frontend that holds some of the test's connections (when `others`, while another frontend
    holds others). The kernel hashes each connection to a frontend (SO_REUSEPORT): the
    first one listed got none of 12 over 3 frontends once in 130 runs ((2/3)**12), none of 6 over 2
    once in 64, and then stopping it touched no stream."""
    port = int(plane.address.rsplit(":", 1)[1])
    counts = connections_by_pid(port, plane.ready["frontend_pids"])  # type: ignore[arg-type]
    serving = [pid for pid, n in counts.items() if n]
    assert serving, f"no frontend holds the test's connections: {counts}"
    assert len(serving) > 1 or not others, f"every connection went to one frontend: {counts}"
    return serving[0]


def _frontend_pids(control_pid: int) -> list[int]:
    """The control plane's live frontend processes (multiprocessing spawn children)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[1]) == control_pid and b"spawn_main" in cmdline and fields[0] not in ("Z", "X"):
            pids.append(int(stat.parent.name))
    return pids


async def _streams(address: str, count: int) -> tuple[list[grpc.aio.Channel], list[grpc.aio.UnaryStreamCall]]:
    """`count` long streams, each on its own connection, every one past its first message."""
    sampling = sampling_params(max_new_tokens=100_000, ignore_eos=True, temperature=0.0)
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(address, options=options) for _ in range(count)]
    calls = [gen_grpc.GenerationStub(ch).Generate(generate_request([5, 6, 7], sampling)) for ch in channels]
    for call in calls:
        await call.read()
    return channels, calls


async def _all_served(address: str, connections: int, timeout: float = 30.0) -> None:
    """Every one of `connections` new connections is served (a retry on a refused connect is fine:
    the kernel resets what waited in a dead frontend's accept queue)."""
    options = [("grpc.use_local_subchannel_pool", 1)]

    async def one() -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                async with grpc.aio.insecure_channel(address, options=options) as channel:
                    stub = gen_grpc.GenerationStub(channel)
                    sampling = sampling_params(max_new_tokens=3, ignore_eos=True)
                    call = stub.Generate(generate_request([5, 6, 7], sampling), timeout=10)
                    async for _ in call:
                        pass
                    return
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                assert time.monotonic() < deadline, f"a new connection was not served: {exc}"
                await asyncio.sleep(0.2)

    await asyncio.wait_for(asyncio.gather(*(one() for _ in range(connections))), timeout + 15)


async def test_a_stalled_frontend_is_killed_restarted_and_takes_only_its_clients(start_control) -> None:
    plane = await start_control("--frontends", "3", *HEARTBEAT)
    plane.add_worker("sim-0", "--sim-cost", "0.01,0,0")
    await plane.wait_workers(1)
    channels, calls = await _streams(plane.address, 12)
    victim = _serving_some(plane)
    try:
        os.kill(victim, signal.SIGSTOP)  # its sockets stay open: only a heartbeat finds it
        outcomes = await asyncio.gather(*(_outcome(call, window=8.0) for call in calls))
        broken = [o for o in outcomes if o == grpc.StatusCode.UNAVAILABLE]
        alive = [o for o in outcomes if o == "streaming"]
        assert broken and alive and len(broken) + len(alive) == 12, outcomes
        assert not _alive(victim), "the stalled frontend was not killed"
        for call, outcome in zip(calls, outcomes, strict=True):
            if outcome == "streaming":
                call.cancel()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
        for ch in channels:
            await ch.close()
    # Its requests were aborted and their KV freed; a new frontend took its place.
    await _settled(plane.address)
    deadline = time.monotonic() + 30
    while len(_frontend_pids(plane.control.pid)) != 3:
        assert time.monotonic() < deadline, "the stalled frontend was not restarted"
        await asyncio.sleep(0.1)
    await _all_served(plane.address, 12)


async def test_a_frontend_paused_for_less_than_the_deadline_keeps_its_clients(start_control) -> None:
    plane = await start_control("--frontends", "2", *HEARTBEAT)
    plane.add_worker("sim-0", "--sim-cost", "0.01,0,0")
    await plane.wait_workers(1)
    channels, calls = await _streams(plane.address, 6)
    victim = _serving_some(plane, others=False)
    try:
        os.kill(victim, signal.SIGSTOP)  # a pause (a long GC, a burst) well inside the deadline
        await asyncio.sleep(1.0)
        os.kill(victim, signal.SIGCONT)
        outcomes = await asyncio.gather(*(_outcome(call, window=6.0) for call in calls))
        assert outcomes == ["streaming"] * 6, outcomes
        assert _alive(victim)
        for call in calls:
            call.cancel()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)
        for ch in channels:
            await ch.close()
    await _settled(plane.address)


async def test_frontends_leave_a_core_that_stops_answering(start_control) -> None:
    plane = await start_control("--frontends", "2", *HEARTBEAT)
    plane.add_worker("sim-0", "--sim-cost", "0.01,0,0")
    await plane.wait_workers(1)
    frontends = list(plane.ready["frontend_pids"])
    channels, calls = await _streams(plane.address, 4)
    core = plane.control.pid
    try:
        os.kill(core, signal.SIGSTOP)  # no EOF: the frontends must notice the silence
        outcomes = await asyncio.gather(*(_outcome(call, window=8.0) for call in calls))
        assert outcomes == [grpc.StatusCode.UNAVAILABLE] * 4, outcomes
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in frontends):
            assert time.monotonic() < deadline, "a frontend outlived its silent core"
            await asyncio.sleep(0.1)
    finally:
        os.kill(core, signal.SIGCONT)
        for ch in channels:
            await ch.close()
    # The core, resumed, restarts its frontends and serves again.
    await _all_served(plane.address, 4)


async def test_frontends_auto_runs_one_per_spare_cpu_and_serves(start_control) -> None:
    """The default, --frontends auto: as many frontends as the CPUs the control plane may use give
    (control_plane/cpus.py), every one of them serving."""
    from control_plane.cpus import auto_frontends, available_cpus

    plane = await start_control("--frontends", "auto")
    plane.add_worker("sim-0")
    await plane.wait_workers(1)
    expected = auto_frontends(available_cpus())
    assert len(plane.ready["frontend_pids"]) == expected  # type: ignore[arg-type]
    await _all_served(plane.address, 4 * expected)
