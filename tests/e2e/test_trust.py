"""Trust boundaries against real processes: no client or worker can take the control plane down.

Each test reproduces something that once crashed, wedged or hung a control plane: clients that
cancel at once, workers that answer nonsense, hang, or lie in their hello, oversized input.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from clients.client import StepwiseClient, generate_request, sampling_params
from data_plane.models.loader import model_fingerprint
from protos.stepwise.v1 import worker_pb2 as wk_pb
from stepwise.models import resolve_model
from tests.e2e.conftest import ControlProcess
from tests.e2e.rogue import RogueWorker, hello, honest_result, tokens_bytes, tokens_of

pytestmark = pytest.mark.timeout(180)


async def _serves(address: str, max_new: int = 8) -> None:
    """A good request still gets every token it asked for."""
    async with StepwiseClient(address) as client:
        gen = await asyncio.wait_for(
            client.generate([5, 6, 7, 8], max_new_tokens=max_new, temperature=0.0, ignore_eos=True), 30
        )
    assert (gen.finish_reason, gen.completion_tokens) == ("length", max_new), gen.finish_message


async def test_clients_that_cancel_before_acceptance_do_not_crash_the_engine(start_control) -> None:
    plane = await start_control()
    plane.add_worker("w0")
    plane.add_worker("w1")
    await plane.wait_workers(2)
    async with StepwiseClient(plane.address) as client:
        request = generate_request([5, 6, 7], sampling_params(max_new_tokens=4))

        async def impatient() -> None:
            try:
                async for _ in client.stub.Generate(request, timeout=0.003):
                    pass
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        for _ in range(3):
            await asyncio.gather(*(impatient() for _ in range(40)))
        info = await client.server_info()
    assert sorted(w.worker_id for w in info.workers) == ["w0", "w1"]
    for _ in range(4):
        await _serves(plane.address)
    await _books_empty(plane.address)


async def _books_empty(address: str, timeout: float = 10.0) -> None:
    """Every request that was cancelled has left the books: nothing queued, running or held."""
    deadline = time.monotonic() + timeout
    async with StepwiseClient(address) as client:
        while True:
            info = await client.server_info()
            busy = [(w.worker_id, w.queued, w.running, w.book_live_seqs) for w in info.workers]
            if all(q == r == live == 0 for _, q, r, live in busy):
                return
            assert time.monotonic() < deadline, f"requests left behind: {busy}"
            await asyncio.sleep(0.05)


def _tokens(change):  # type: ignore[no-untyped-def]
    """A corruption of the result's tokens: `change` maps the honest token list to another."""
    return lambda r: setattr(r, "token_ids", tokens_bytes(change(tokens_of(r))))


BAD_RESULTS = {
    "one token too many": _tokens(lambda t: [*t, 9]),
    "one token too few": _tokens(lambda t: t[:-1]),
    "a token cut short": lambda r: setattr(r, "token_ids", r.token_ids[:-1]),
    "negative token": _tokens(lambda t: [-1, *t[1:]]),
    "token outside the vocabulary": _tokens(lambda t: [1024, *t[1:]]),
    "another step's id": lambda r: setattr(r, "step_id", r.step_id + 7),
    "a wait that is no duration": lambda r: setattr(r, "wait_s", float("nan")),
    "logprobs for tokens it did not send": lambda r: r.logprobs.extend(
        [wk_pb.TokenLogprobs(logprob=-1.0)] * (len(tokens_of(r)) + 1)
    ),
}


@pytest.mark.parametrize("corrupt", BAD_RESULTS.values(), ids=list(BAD_RESULTS))
async def test_a_bad_result_fails_the_worker_and_its_requests_continue_elsewhere(
    start_control, corrupt
) -> None:
    plane = await start_control()
    async with RogueWorker(plane.worker_address, hello()) as rogue, StepwiseClient(plane.address) as client:
        assert rogue.welcome is not None and rogue.welcome.accepted
        task = asyncio.create_task(
            client.generate([5, 6, 7, 8], max_new_tokens=6, temperature=0.0, ignore_eos=True)
        )
        plan = await rogue.plan()
        plane.add_worker("honest")
        await plane.wait_workers(2)
        result = honest_result(plan, set())
        corrupt(result)
        await rogue.send(result)
        assert await rogue.ended() not in (None, grpc.StatusCode.OK)
        gen = await asyncio.wait_for(task, 30)
    # The request went on on the honest worker: all its tokens, none of the rogue's.
    assert (gen.finish_reason, gen.completion_tokens) == ("length", 6), gen.finish_message
    assert all(0 <= t < 1024 for t in gen.token_ids)
    await plane.wait_workers(1)
    await _serves(plane.address)


async def test_a_bad_result_with_no_other_worker_ends_the_stream_with_a_reason(start_control) -> None:
    plane = await start_control()
    async with RogueWorker(plane.worker_address, hello()) as rogue, StepwiseClient(plane.address) as client:
        task = asyncio.create_task(client.generate([5, 6, 7], max_new_tokens=6))
        result = honest_result(await rogue.plan(), set())
        result.token_ids = tokens_bytes([-3, *tokens_of(result)[1:]])
        await rogue.send(result)
        gen = await asyncio.wait_for(task, 30)
    assert gen.finish_reason == "abort" and "token" in gen.finish_message, gen.finish_message
    assert -3 not in gen.token_ids
    plane.add_worker("honest")
    await plane.wait_workers(1)
    await _serves(plane.address)


async def test_largest_seed_with_parallel_samples(start_control) -> None:
    plane = await start_control()
    plane.add_worker("w0")
    await plane.wait_workers(1)
    async with StepwiseClient(plane.address) as client:
        gens = await asyncio.wait_for(
            client.generate_samples([5, 6, 7], 2, seed=2**64 - 1, max_new_tokens=4, ignore_eos=True), 30
        )
    assert [(g.finish_reason, g.completion_tokens) for g in gens] == [("length", 4)] * 2
    await _serves(plane.address)


async def test_a_hung_worker_is_detected_and_its_requests_continue(start_control) -> None:
    plane = await start_control("--worker-step-timeout", "1", "--worker-step-timeout-per-token", "0")
    plane.add_worker("w0", "--sim-cost", "0.02,0,0")
    await plane.wait_workers(1)
    # Both requests start on w0 (the only worker); then w1 joins and w0 freezes mid-stream.
    async with StepwiseClient(plane.address) as client:
        tasks = [
            asyncio.create_task(
                client.generate([5, 6, i], max_new_tokens=300, temperature=0.0, ignore_eos=True)
            )
            for i in range(2)
        ]
        while (await client.server_info()).running < 2:
            await asyncio.sleep(0.01)
        plane.add_worker("w1")
        await plane.wait_workers(2)
        assert (await client.server_info()).running == 2, "finished before w0 could freeze"
        os.kill(plane.procs[1].pid, signal.SIGSTOP)
        started = time.monotonic()
        gens = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        info = await client.server_info()
    assert [(g.finish_reason, g.completion_tokens) for g in gens] == [("length", 300)] * 2
    assert time.monotonic() - started < 20
    assert [w.worker_id for w in info.workers] == ["w1"]


async def test_a_hung_last_worker_ends_its_streams_with_a_reason(start_control) -> None:
    plane = await start_control("--worker-step-timeout", "1", "--worker-step-timeout-per-token", "0")
    async with RogueWorker(plane.worker_address, hello()) as rogue, StepwiseClient(plane.address) as client:
        task = asyncio.create_task(client.generate([5, 6, 7], max_new_tokens=6))
        await rogue.plan()  # ... and never answer
        gen = await asyncio.wait_for(task, 20)
    assert gen.finish_reason == "abort" and "no result" in gen.finish_message, gen.finish_message
    await _serves_after_new_worker(plane)


async def _serves_after_new_worker(plane) -> None:  # type: ignore[no-untyped-def]
    plane.add_worker("honest")
    await plane.wait_workers(1)
    await _serves(plane.address)


BAD_HELLOS = {
    "kv_capacity_tokens": {"kv_capacity_tokens": 10**13},
    "max_context": {"max_context": 0},
    "page_size": {"page_size": -4},
    # The default --chunked-prefill-size 2048 is not a whole number of 3-token pages
    # (docs/scheduler.md#chunked-prefill).
    "page_size 3 does not divide --chunked-prefill-size": {"page_size": 3, "kv_capacity_tokens": 4095},
    "vocab_size": {"vocab_size": 2**31 - 1},
    "eos_token_ids": {"eos_token_ids": [5000]},
    "worker_id": {"worker_id": "x" * 1000},
    "host_pool_capacity_tokens": {"host_pool_capacity_tokens": -1},
}


@pytest.mark.parametrize("field", list(BAD_HELLOS))
async def test_an_implausible_hello_is_refused_naming_the_field(start_control, field: str) -> None:
    plane = await start_control()
    async with RogueWorker(plane.worker_address, hello(**BAD_HELLOS[field])) as rogue:
        assert rogue.welcome is not None
        assert not rogue.welcome.accepted and field in rogue.welcome.reason, rogue.welcome
    await _serves_after_new_worker(plane)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used: what it computed, however long
    a loaded machine kept it waiting."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _idle_with(
    plane: ControlProcess, client: StepwiseClient, capacity: int
) -> tuple[float, float, float]:
    """(core CPU seconds, core RSS growth in MB, slowest GetServerInfo in seconds) over one window in
    which a worker claiming `capacity` KV tokens attaches and stays idle while 20 calls are answered."""
    pid = plane.control.pid
    cpu, rss = _cpu_s(pid), _rss_mb(pid)
    claim = hello(f"rogue-{capacity}", kv_capacity_tokens=capacity)
    async with RogueWorker(plane.worker_address, claim) as rogue:
        assert rogue.welcome is not None and rogue.welcome.accepted, rogue.welcome
        slowest = 0.0
        for _ in range(20):
            started = time.monotonic()
            await client.server_info()
            slowest = max(slowest, time.monotonic() - started)
            await asyncio.sleep(0.05)
        grown = _rss_mb(pid) - rss
    return _cpu_s(pid) - cpu, grown, slowest


async def test_a_huge_pool_costs_nothing_until_used_and_idle_checks_do_not_block(start_control) -> None:
    """An idle worker claiming 10^8 tokens costs the core no more work than one claiming 4096, side by
    side on one control plane: the idle check of a pool follows what is in it. Work is the core's CPU
    time, which a loaded machine does not inflate the way it inflates a call's latency; a check that
    visited every page of the claim would hold the core's loop for seconds of CPU."""
    plane = await start_control()
    async with StepwiseClient(plane.address) as client:
        await client.server_info()  # the channel is up before any window opens
        small_cpu, _, small_slowest = await _idle_with(plane, client, 4096)
        huge_cpu, grown, huge_slowest = await _idle_with(plane, client, 10**8)
    print(
        f"core CPU {small_cpu:.2f} s (4096 tokens) vs {huge_cpu:.2f} s (10^8 tokens); slowest GetServerInfo "
        f"{small_slowest:.3f} s vs {huge_slowest:.3f} s; RSS +{grown:.0f} MB"
    )
    assert huge_cpu < small_cpu + 0.5, f"the core worked {huge_cpu:.2f} s against {small_cpu:.2f} s"
    assert grown < 200, f"control plane grew by {grown:.0f} MB for an unused pool"
    plane.control.send_signal(signal.SIGTERM)
    assert plane.control.wait(10) == 0


async def test_a_huge_prompt_is_refused_before_tokenizing_and_streams_keep_flowing(start_control) -> None:
    plane = await start_control()
    plane.add_worker("w0", "--sim-cost", "0.01,0,0")
    await plane.wait_workers(1)
    frontends = [int(pid) for pid in plane.ready["frontend_pids"]]  # type: ignore[attr-defined]
    async with StepwiseClient(plane.address) as client:
        gaps: list[float] = []
        streamed = 0

        async def watch() -> None:
            nonlocal streamed
            request = generate_request([5, 6, 7], sampling_params(max_new_tokens=300, ignore_eos=True))
            last = time.monotonic()
            async for response in client.stream(request):
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                if response.WhichOneof("event") == "chunk":
                    streamed += len(response.chunk.token_ids)

        watcher = asyncio.create_task(watch())
        while len(gaps) < 5:
            await asyncio.sleep(0.01)
        huge = "Once upon a time, " * 220_000  # 3.96 MB
        cpu = sum(_cpu_s(pid) for pid in frontends)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.generate(huge, max_new_tokens=4)
        refusal_cpu = sum(_cpu_s(pid) for pid in frontends) - cpu
        await watcher
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Measured in bytes against the model's context, never tokenized: tokenized, the prompt would be
    # refused for its 1.76M tokens instead, after seconds of the frontends' CPU (4.5 s on a dev box)
    # with the streams stalled meanwhile (11 s seen), though in a thread, by the tokenizer's GIL.
    assert refused.value.details() == (
        "text: a prompt of 3960000 bytes is more than the model's context of 2048 tokens"
    )
    assert refusal_cpu < 1.0, f"the frontends worked {refusal_cpu:.2f} s on a refused prompt"
    # The stream ran to its end, and never stalled for long (its tokens come every 10 ms or so; the
    # bound leaves room for a loaded machine).
    assert streamed == 300
    assert max(gaps) < 3.0, f"a stream stalled for {max(gaps):.2f} s"


STOP_LIMITS = {
    "many": ["s" + str(i) for i in range(100_000)],
    "long": ["x" * 1_000_000],
}


@pytest.mark.parametrize("stops", STOP_LIMITS.values(), ids=list(STOP_LIMITS))
async def test_stop_strings_past_the_limits_are_refused(start_control, stops: list[str]) -> None:
    plane = await start_control()
    plane.add_worker("w0")
    await plane.wait_workers(1)
    async with StepwiseClient(plane.address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.generate([5, 6, 7], max_new_tokens=4, stop=stops)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.stop" in (refused.value.details() or "")
    await _serves(plane.address)


async def test_an_empty_message_from_a_worker_fails_that_worker(start_control) -> None:
    plane = await start_control()
    async with RogueWorker(plane.worker_address, hello()) as rogue, StepwiseClient(plane.address) as client:
        task = asyncio.create_task(client.generate([5, 6, 7], max_new_tokens=6))
        await rogue.plan()
        await rogue.send_raw(wk_pb.WorkerMessage())
        assert await rogue.ended() not in (None, grpc.StatusCode.OK)
        gen = await asyncio.wait_for(task, 30)
    assert gen.finish_reason == "abort", gen
    await _serves_after_new_worker(plane)


DROPPING_RESULTS = [
    "one token too many",
    "token outside the vocabulary",
    "another step's id",
    "a token cut short",
]
CALLS = 12


async def _ends(task: asyncio.Task[object]) -> tuple[str, int, str]:
    """How one call ended: (finish reason, tokens, message); 'never' when it did not within 30 s."""
    try:
        gen = await asyncio.wait_for(asyncio.shield(task), 30)
    except TimeoutError:
        task.cancel()
        return "never", 0, ""
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, 0, exc.details() or ""
    return gen.finish_reason, gen.completion_tokens, gen.finish_message  # type: ignore[attr-defined]


@pytest.mark.parametrize("lie", DROPPING_RESULTS)
async def test_no_call_is_lost_when_a_worker_is_dropped_amid_arrivals(start_control, lie: str) -> None:
    """A burst of calls under least-loaded routing while the worker that got the first plan lies on
    it: every call ends, with all its tokens (continued on the honest worker) or a stated reason,
    and none is left behind in the books."""
    plane = await start_control("--routing-policy", "least-loaded")
    plane.add_worker("real")
    await plane.wait_workers(1)
    # Sorts first: a tie in load sends the call to the rogue. The real worker's fingerprint, or the
    # control plane refuses it for serving another model.
    greeting = hello("a-rogue", model_fingerprint=model_fingerprint(resolve_model("embedded")))
    async with (
        RogueWorker(plane.worker_address, greeting) as rogue,
        StepwiseClient(plane.address) as client,
    ):
        await plane.wait_workers(2)
        tasks = [
            asyncio.create_task(
                client.generate([5, 6, 7, i], max_new_tokens=16, temperature=0.0, ignore_eos=True)
            )
            for i in range(CALLS)
        ]
        result = honest_result(await rogue.plan(), set())
        BAD_RESULTS[lie](result)
        await rogue.send(result)
        ends = [await _ends(task) for task in tasks]
    lost = [
        (i, end)
        for i, end in enumerate(ends)
        if end[:2] != ("length", 16) and not (end[0] == "abort" and end[2])
    ]
    assert lost == []
    await _books_empty(plane.address)
    await _serves(plane.address)


@pytest.mark.parametrize(
    ("flags", "size"),
    [([], 5_000_000), (["--max-prompt-bytes", str(8 << 20)], 12_000_000)],
    ids=["default-limit-5MB", "8MiB-limit-12MB"],
)
async def test_a_prompt_over_max_prompt_bytes_is_invalid_argument_naming_it(
    start_control, flags: list[str], size: int
) -> None:
    """Past gRPC's own 4 MiB limit too: too large reads as too large, never as a retryable 429."""
    plane = await start_control(*flags)
    plane.add_worker("w0")
    await plane.wait_workers(1)
    async with StepwiseClient(plane.address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.generate("x" * size, max_new_tokens=4)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    assert (refused.value.details() or "").startswith("text:")
    assert "--max-prompt-bytes" in (refused.value.details() or "")
    await _serves(plane.address)


async def test_a_prompt_under_a_raised_max_prompt_bytes_reaches_the_prompt_checks(start_control) -> None:
    """Between gRPC's 4 MiB and the flag the prompt is checked like any other (here: against the
    model's context, before it is tokenized), not refused by the transport."""
    plane = await start_control("--max-prompt-bytes", str(8 << 20))
    plane.add_worker("w0")
    await plane.wait_workers(1)
    async with StepwiseClient(plane.address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.generate("x" * 6_000_000, max_new_tokens=4)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    assert "context" in (refused.value.details() or "")
