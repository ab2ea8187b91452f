"""Live migration end to end (docs/migration.md): two real workers on the embedded model, real gRPC
between the planes and between the workers' transfer links."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
import urllib.request
import zlib
from pathlib import Path

import pytest

from clients.client import StepwiseClient, generate_request, sampling_params
from control_plane.record.entries import ApplyResult, NextPlan
from control_plane.record.files import read_entries
from protos.stepwise.v1 import generation_pb2 as gen_pb
from stepwise import replay
from tests.e2e.conftest import reference_greedy
from tests.e2e.test_generate import MAX_NEW, _encode_all, _greedy_all

pytestmark = pytest.mark.timeout(300)


async def _workers(address: str) -> list:  # type: ignore[type-arg]
    async with StepwiseClient(address) as client:
        return list((await client.server_info()).workers)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _metrics(port: int) -> bytes:
    """The control plane's /metrics page."""
    url = f"http://127.0.0.1:{port}/metrics"
    return await asyncio.to_thread(lambda: urllib.request.urlopen(url).read())


async def _books_settle_all(address: str, timeout: float = 10.0) -> None:
    """Every worker's books and report agree at zero."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        workers = await _workers(address)
        states = [
            (w.book_live_seqs, w.reported_live_seqs, w.book_seq_slots, w.reported_seq_slots) for w in workers
        ]
        if all(state == (0, 0, 0, 0) for state in states):
            assert all(w.kv_mismatches == 0 for w in workers)
            return
        assert asyncio.get_running_loop().time() < deadline, f"books did not settle: {states}"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    ("control", "worker", "shared"),
    [
        ([], [], False),
        (["--disable-overlap-schedule"], [], False),
        (["--chunked-prefill-size", "16"], ["--page-size", "4"], False),
        # One long prefix shared by every prompt: the destination's tree holds it already, so a
        # migration's receives skip it.
        ([], ["--page-size", "4"], True),
    ],
    ids=["overlap", "no-overlap", "chunk16-page4", "shared-prefix-page4"],
)
async def test_greedy_with_test_migrate_equals_transformers(
    start_stack,
    model_dir: Path,
    control: list[str],
    worker: list[str],
    shared: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STEPWISE_TEST_MIGRATE", "1")
    monkeypatch.setenv("STEPWISE_TEST_MIGRATE_INTERVAL", "3")
    stack = await start_stack(control, worker, workers=2)
    prompts, eos = _encode_all(model_dir)
    if shared:
        prompts = [prompts[4] + ids for ids in prompts]
    got = await _greedy_all(stack.address, prompts, MAX_NEW)
    for ids, n, tokens in zip(prompts, MAX_NEW, got, strict=True):
        assert tokens == reference_greedy(model_dir, ids, n, eos), f"prompt of {len(ids)} tokens"
    workers = await _workers(stack.address)
    assert sum(w.migrated_out for w in workers) > 0, "the knob was meant to migrate requests"
    assert sum(w.migrated_out for w in workers) == sum(w.migrated_in for w in workers)
    assert sum(w.migration_fallbacks for w in workers) == 0
    await _books_settle_all(stack.address)


async def test_test_migrate_moves_parallel_samples_together(
    start_stack, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """n > 1: the samples of a call move together or not at all, and each equals transformers."""
    monkeypatch.setenv("STEPWISE_TEST_MIGRATE", "1")
    monkeypatch.setenv("STEPWISE_TEST_MIGRATE_INTERVAL", "2")
    port = _free_port()
    stack = await start_stack(["--metrics-port", str(port)], [], workers=2)
    prompts, eos = _encode_all(model_dir)
    async with StepwiseClient(stack.address) as client:
        calls = await asyncio.gather(
            *(
                client.generate_samples(ids, 3, max_new_tokens=30, temperature=0.0, ignore_eos=True)
                for ids in prompts[:3]
            )
        )
    for ids, samples in zip(prompts, calls, strict=False):
        want = reference_greedy(model_dir, ids, 30, eos, ignore_eos=True)
        assert [s.token_ids for s in samples] == [want] * 3
    workers = await _workers(stack.address)
    moved = sum(w.migrated_out for w in workers)
    assert moved > 0 and moved % 3 == 0, "each migration moved a whole call of 3 samples"
    await _books_settle_all(stack.address)
    body = await _metrics(port)
    totals: dict[str, float] = {}
    for line in body.decode().splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name.startswith("stepwise:migra") and ("outcome=" not in line or 'outcome="ok"' in line):
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    assert totals["stepwise:migrations_total"] == moved
    assert totals["stepwise:migration_stall_seconds_count"] == moved
    assert totals["stepwise:migration_copy_seconds_count"] == moved
    assert totals["stepwise:migrated_tokens_total"] >= moved
    # K and V of every moved token, 2,048 bytes each on the embedded model (pre-copies and tails).
    assert totals["stepwise:migration_bytes_total"] >= 2048 * totals["stepwise:migrated_tokens_total"]


async def _stream_greedy(
    client: StepwiseClient, ids: list[int], n: int, progress: list[int], i: int, routing_key: str = ""
) -> list[int]:
    got: list[int] = []
    sampling = sampling_params(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    request = generate_request(ids, sampling, routing_key=routing_key)
    async for response in client.stream(request):
        if response.WhichOneof("event") == "chunk":
            got.extend(response.chunk.token_ids)
            progress[i] = len(got)
        elif response.WhichOneof("event") == "finished":
            assert response.finished.reason == gen_pb.FINISH_REASON_LENGTH, response.finished
    return got


@pytest.mark.slow
async def test_sigterm_on_a_loaded_worker_migrates_its_requests(start_control, model_dir: Path) -> None:
    """The worker leaves long before its requests end (--drain-timeout is far off), every stream
    gets exactly the fault-free tokens, and the survivor prefills no prompt again: it computes one
    prompt token per request that came to it."""
    plane = await start_control("--drain-timeout", "300")
    procs = {name: plane.add_worker(name, sim=False) for name in ("w0", "w1")}
    await plane.wait_workers(2)
    prompts, eos = _encode_all(model_dir)
    new = 160
    progress = [0] * len(prompts)
    async with StepwiseClient(plane.address) as client:
        # One routing key: every request runs on the same worker, the one that gets SIGTERM.
        tasks = [
            asyncio.create_task(_stream_greedy(client, ids, new, progress, i, routing_key="one"))
            for i, ids in enumerate(prompts)
        ]
        deadline = asyncio.get_running_loop().time() + 60
        while min(progress) < 2:
            assert asyncio.get_running_loop().time() < deadline, progress
            await asyncio.sleep(0.01)
        loaded = [w for w in (await client.server_info()).workers if w.running]
        assert len(loaded) == 1 and loaded[0].running == len(prompts)
        victim = procs[loaded[0].worker_id]
        start = time.monotonic()
        victim.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(victim.wait, 60)
        exit_s = time.monotonic() - start
        at_exit = list(progress)
        got = await asyncio.gather(*tasks)
        [survivor] = (await client.server_info()).workers
    assert code == 0
    assert min(at_exit) < new, "the worker left before its requests ended"
    assert exit_s < 30, f"the worker took {exit_s:.1f} s to leave"
    for ids, tokens in zip(prompts, got, strict=True):
        assert tokens == reference_greedy(model_dir, ids, new, eos, ignore_eos=True)
    assert survivor.migrated_in == len(prompts) and survivor.migration_fallbacks == 0
    computed = survivor.prompt_tokens_total - survivor.cached_tokens_total
    assert computed <= len(prompts), f"computed {computed} prompt tokens for {len(prompts)} migrated requests"


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["w0", "w1"])
async def test_sigkill_mid_migration_loses_and_repeats_nothing(
    start_control, model_dir: Path, monkeypatch: pytest.MonkeyPatch, victim: str
) -> None:
    """Requests migrate between two workers every few steps; one is killed while copies are under
    way both ways (it is the source of some and the destination of others). Every stream ends with
    exactly the tokens transformers gives."""
    monkeypatch.setenv("STEPWISE_TEST_MIGRATE", "1")
    monkeypatch.setenv("STEPWISE_TEST_MIGRATE_INTERVAL", "2")
    plane = await start_control()
    procs = {name: plane.add_worker(name, sim=False) for name in ("w0", "w1")}
    await plane.wait_workers(2)
    prompts, eos = _encode_all(model_dir)
    new = 60
    progress = [0] * len(prompts)
    async with StepwiseClient(plane.address) as client:
        tasks = [
            asyncio.create_task(_stream_greedy(client, ids, new, progress, i))
            for i, ids in enumerate(prompts)
        ]
        deadline = asyncio.get_running_loop().time() + 60
        while sum(w.migrated_out for w in (await client.server_info()).workers) < 4:
            assert asyncio.get_running_loop().time() < deadline, "no migrations"
            await asyncio.sleep(0.01)
        procs[victim].kill()
        got = await asyncio.gather(*tasks)
    for ids, tokens in zip(prompts, got, strict=True):
        assert tokens == reference_greedy(model_dir, ids, new, eos, ignore_eos=True)


@pytest.mark.slow
async def test_a_recorded_session_with_migrations_replays_identically(
    start_stack, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """Both workers' recordings: each scheduler replay is identical; the worker replays are identical
    when run together (receives wait for the sends of the other recording), and one alone says
    which transfer it lacks.

    Half the calls go to each worker (routing keys) and each runs 64 tokens, so each worker moves
    calls out: CI once saw one worker get only calls that ended before their copies landed, so its
    recording held the called-off pre-copies' receives on the other side but no Export of its own."""
    monkeypatch.setenv("STEPWISE_TEST_MIGRATE", "1")
    monkeypatch.setenv("STEPWISE_TEST_MIGRATE_INTERVAL", "3")
    rec_dir = tmp_path / "rec"
    stack = await start_stack(["--record", str(rec_dir)], [], workers=2)
    prompts, _ = _encode_all(model_dir)
    names = ["worker-0", "worker-1"]
    keys = [_key_for(name, names) for name in names]
    progress = [0] * len(prompts)
    async with StepwiseClient(stack.address) as client:
        await asyncio.gather(
            *(
                _stream_greedy(client, ids, 64, progress, i, routing_key=keys[i % 2])
                for i, ids in enumerate(prompts)
            )
        )
    moved = {w.worker_id: w.migrated_out for w in await _workers(stack.address)}
    assert all(moved.get(name, 0) > 0 for name in names), f"each worker was meant to move calls out: {moved}"
    paths = sorted(rec_dir.glob("*.0000.rec"))
    assert len(paths) == 2
    deadline = time.monotonic() + 20
    while not all(_settled(path) for path in paths):
        assert time.monotonic() < deadline, "the recordings did not settle"
        await asyncio.sleep(0.1)
    stack.stop()
    kinds = [{type(e).__name__ for e in read_entries(path)} for path in paths]
    assert all({"Export", "ImportKv"} <= k for k in kinds), kinds

    capsys.readouterr()
    for path in paths:
        assert replay.main(["scheduler", str(path)]) == 0
    assert replay.main(["worker", *map(str, paths), "--model", str(model_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and all("identical:" in line for line in out), out
    assert replay.main(["worker", str(paths[0]), "--model", str(model_dir)]) == 1
    assert "no recording given sends it" in capsys.readouterr().out


def _settled(path: Path) -> bool:
    """Every plan of the recording has its result (flushed at each step)."""
    entries = list(read_entries(path))
    plans = sum(isinstance(e, NextPlan) and e.plan is not None for e in entries)
    return plans > 0 and plans == sum(isinstance(e, ApplyResult) for e in entries)


@pytest.mark.slow
async def test_a_destination_that_refuses_every_copy_keeps_nothing_and_loses_nothing(
    start_control, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """w1 takes no transfers (`--transfer-buffer-bytes 0`: FAILED_PRECONDITION at every header):
    every pre-copy toward it fails, so each of those requests stays where it runs; the moves the
    other way succeed. Every stream is exact, and none fell back (a failed pre-copy never left).

    Half the calls go to each worker (routing keys) and each runs 64 tokens: a call must outlive
    a copy for the move to land, which calls of 9 to 40 tokens left to chance on a loaded machine
    (CI once saw w1 get three short calls, each ending before its copy landed)."""
    monkeypatch.setenv("STEPWISE_TEST_MIGRATE", "1")
    monkeypatch.setenv("STEPWISE_TEST_MIGRATE_INTERVAL", "2")
    port = _free_port()
    plane = await start_control("--metrics-port", str(port))
    plane.add_worker("w0", sim=False)
    plane.add_worker("w1", "--transfer-buffer-bytes", "0", sim=False)
    await plane.wait_workers(2)
    prompts, eos = _encode_all(model_dir)
    new = 64
    keys = [_key_for(w, ["w0", "w1"]) for w in ("w0", "w1")]
    progress = [0] * len(prompts)
    async with StepwiseClient(plane.address) as client:
        got = await asyncio.gather(
            *(
                _stream_greedy(client, ids, new, progress, i, routing_key=keys[i % 2])
                for i, ids in enumerate(prompts)
            )
        )
    for ids, tokens in zip(prompts, got, strict=True):
        assert tokens == reference_greedy(model_dir, ids, new, eos, ignore_eos=True)
    body = await _metrics(port)
    called_off = [
        line
        for line in body.decode().splitlines()
        if line.startswith("stepwise:migrations_total") and 'worker="w0"' in line and "called_off" in line
    ]
    assert called_off and float(called_off[0].rsplit(" ", 1)[1]) > 0, "w0 was meant to try and be refused"
    workers = {w.worker_id: w for w in await _workers(plane.address)}
    assert workers["w1"].migrated_in == 0 and workers["w0"].migrated_out == 0
    assert workers["w1"].migrated_out > 0, "moves toward w0 were meant to succeed"
    assert workers["w0"].migration_fallbacks == workers["w1"].migration_fallbacks == 0
    await _books_settle_all(plane.address)


def _key_for(worker: str, workers: list[str]) -> str:
    """A routing key that the router sends to `worker` (a key picks among the workers sorted by id,
    by its CRC-32)."""
    ordered = sorted(workers)
    return next(k for k in map(str, range(100)) if ordered[zlib.crc32(k.encode()) % len(ordered)] == worker)


@pytest.mark.slow
@pytest.mark.parametrize("balance", [True, False], ids=["kv-balance", "disable-kv-balance"])
async def test_a_worker_short_of_kv_migrates_instead_of_retracting(
    start_control, model_dir: Path, monkeypatch: pytest.MonkeyPatch, balance: bool
) -> None:
    """Every request goes to w0 (one routing key), whose 384 slots its admission overfills (a
    new-token ratio of 0.1 expects a tenth of the output they make); w1 has room. With the balancer
    w0 moves requests there before a decode would not fit, and retracts (recomputes) none; without
    it w0 retracts. Every stream equals transformers either way."""
    monkeypatch.setenv("STEPWISE_INIT_NEW_TOKEN_RATIO", "0.1")
    plane = await start_control(*([] if balance else ["--disable-kv-balance"]))
    plane.add_worker("w0", "--kv-tokens", "384", sim=False)
    plane.add_worker("w1", sim=False)
    await plane.wait_workers(2)
    prompts, eos = _encode_all(model_dir)
    new = 90
    key = _key_for("w0", ["w0", "w1"])
    progress = [0] * len(prompts)
    async with StepwiseClient(plane.address) as client:
        got = await asyncio.gather(
            *(_stream_greedy(client, ids, new, progress, i, routing_key=key) for i, ids in enumerate(prompts))
        )
    for ids, tokens in zip(prompts, got, strict=True):
        assert tokens == reference_greedy(model_dir, ids, new, eos, ignore_eos=True)
    assert sum(len(ids) + new for ids in prompts) > 384, "the requests were meant to overfill w0"
    workers = {w.worker_id: w for w in await _workers(plane.address)}
    w0 = workers["w0"]
    if balance:
        assert w0.retractions == 0, "w0 retracted though w1 had room"
        assert w0.migrated_out > 0 and w0.migration_fallbacks == 0
    else:
        assert w0.retractions > 0 and w0.migrated_out == 0
    await _books_settle_all(plane.address)
