"""Tenant fairness and SLO admission on real processes (issue 42): with `--fairness vtc` a tenant
arriving behind another's flood is served beside it, in tokens, where FCFS serves the whole flood
first; with `--slo-cost` a TTFT objective that cannot be met is refused at once, naming the field,
and one the tenant file gives after a reload (SIGHUP) is the scheduler's next calls' default."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import signal
import time
from pathlib import Path

import grpc
import pytest

from clients.client import StepwiseClient, bearer_metadata, collect, generate_request, sampling_params
from tests.e2e.conftest import ControlProcess

pytestmark = pytest.mark.timeout(90)

FLOOD, CALM = "flood-key-for-fairness", "calm-key-for-fairness"
FLOODED, CALLS, TOKENS = 12, 3, 20


def key_id(key: str) -> str:
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:12]


def stack_files(tmp: Path, calm_weight: int = 1) -> list[str]:
    keys = tmp / "keys"
    keys.write_text(f"{FLOOD}\n{CALM}\n")
    tenants = tmp / "tenants.toml"
    tenants.write_text(tenant_text(calm_weight))
    return ["--api-key-file", str(keys), "--tenants", str(tenants)]


def tenant_text(calm_weight: int, calm_may_name: str = "") -> str:
    return (
        f'[tenants.flood]\nkeys = ["{key_id(FLOOD)}"]\nweight = 1\n\n'
        f'[tenants.calm]\nkeys = ["{key_id(CALM)}"]\nweight = {calm_weight}\n'
        + (f'may_name = ["{calm_may_name}"]\n' if calm_may_name else "")
    )


async def _reload(plane: ControlProcess, client: StepwiseClient, tenants: Path, calm_weight: int) -> None:
    """Give calm its weight by SIGHUP. The same reload lets calm's key name tenant "probe": once a
    call naming it runs instead of being refused, the scheduler holds the new weights too (one
    reload replaces both, SchedulerConfig.retenant)."""
    tenants.write_text(tenant_text(calm_weight, calm_may_name="probe"))
    plane.control.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    for i in itertools.count():
        probe = generate_request([5, 6, 7], sampling_params(max_new_tokens=1), f"probe{i}", tenant="probe")
        try:
            await asyncio.wait_for(collect(client.stream(probe, api_key=CALM)), 10)
            return
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.PERMISSION_DENIED, exc
        assert time.monotonic() < deadline, "the reloaded tenant file did not take effect"
        await asyncio.sleep(0.05)


async def _held(client: StepwiseClient, n: int) -> None:
    deadline = time.monotonic() + 30
    while (info := await client.server_info()).running + info.queued < n:
        assert time.monotonic() < deadline, f"{n} requests were not held"
        await asyncio.sleep(0.02)


# (fairness, the calm tenant's weight, whether the file gives it only by a reload after the start,
# the most flood calls that finish after the calm calls were sent and before the last of them
# finished). Counted from the order calls finish, not the clock; the calm calls may land a step
# after the flood call running when they were sent ends, so each bound has one call of slack.
@pytest.mark.parametrize(
    ("fairness", "calm_weight", "reloaded", "flood_between"),
    [
        # Equal weights, served alternately: the running flood call, then one flood call per calm one.
        ("vtc", 1, False, CALLS + 1),
        # Weight 4: a calm call costs its counter a quarter as much, so all three go next.
        ("vtc", 4, False, 2),
        # The same weight given by SIGHUP after a start at weight 1: the scheduler applies it.
        ("vtc", 4, True, 2),
        # FCFS: every flood call still waiting goes first (checked exactly below).
        ("none", 1, False, None),
    ],
)
async def test_a_tenant_behind_a_flood_keeps_its_weighted_share_under_vtc_only(
    start_control,
    tmp_path: Path,
    fairness: str,
    calm_weight: int,
    reloaded: bool,
    flood_between: int | None,
) -> None:
    # One request at a time: everything after the first waits, and the waiting queue's order alone
    # decides who is served next.
    files = stack_files(tmp_path, 1 if reloaded else calm_weight)
    plane: ControlProcess = await start_control(*files, "--fairness", fairness, "--max-running-requests", "1")
    plane.add_worker("w0", "--sim-cost", "0.005,0,0")
    await plane.wait_workers(1, api_key=CALM)
    # Each finished call as (tenant, output tokens), in the order they finished.
    finished: list[tuple[str, int]] = []
    async with StepwiseClient(plane.address, api_key=CALM) as client:
        if reloaded:
            await _reload(plane, client, Path(files[files.index("--tenants") + 1]), calm_weight)

        async def call(key: str, tenant: str, rid: str) -> None:
            request = generate_request(
                [5, 6, 7], sampling_params(max_new_tokens=TOKENS, ignore_eos=True), rid
            )
            gen = await collect(client.stream(request, api_key=key))
            finished.append((tenant, len(gen.token_ids)))

        flood = [asyncio.create_task(call(FLOOD, "flood", f"f{i}")) for i in range(FLOODED)]
        await _held(client, FLOODED)
        sent = len(finished)  # flood calls done before the calm ones were sent
        calm = [asyncio.create_task(call(CALM, "calm", f"c{i}")) for i in range(CALLS)]
        await asyncio.wait_for(asyncio.gather(*flood, *calm), 60)
        rows = {t.name: t for t in (await client.server_info()).tenants}

    assert all(tokens == TOKENS for _, tokens in finished)
    assert (rows["flood"].output_tokens, rows["calm"].output_tokens) == (FLOODED * TOKENS, CALLS * TOKENS)
    last_calm = max(i for i, (tenant, _) in enumerate(finished) if tenant == "calm")
    between = sum(1 for tenant, _ in finished[sent:last_calm] if tenant == "flood")
    waiting = FLOODED - sent
    # The flood must still have been waiting for the order to tell anything.
    assert waiting > CALLS + 1, finished
    if flood_between is None:
        assert between == waiting, finished
    else:
        assert between <= flood_between, finished


async def test_an_unmeetable_ttft_objective_is_refused_at_once(start_control, tmp_path: Path) -> None:
    # 10 ms a step plus 1 ms a prefilled token: a 200-token prompt cannot see its first token in 1 ms.
    plane: ControlProcess = await start_control(*stack_files(tmp_path), "--slo-cost", "0.01,0.001,0,0")
    plane.add_worker("w0")
    await plane.wait_workers(1, api_key=CALM)
    prompt = list(range(5, 205))
    async with StepwiseClient(plane.address, api_key=CALM) as client:
        sampling = sampling_params(max_new_tokens=4, ignore_eos=True)
        call = client.stub.Generate(
            generate_request(prompt, sampling, "tight", ttft_slo_ms=1), metadata=bearer_metadata(CALM)
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await asyncio.wait_for(call.read(), 10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (refused.value.details() or "").startswith("ttft_slo_ms: "), refused.value.details()
        # Nothing ran: no token came back, none was generated, nothing is held.
        info = await client.server_info()
        assert {t.name: t.output_tokens for t in info.tenants}["calm"] == 0
        assert info.running + info.queued == 0

        loose = generate_request(prompt, sampling, "loose", ttft_slo_ms=60_000)
        gen = await asyncio.wait_for(collect(client.stream(loose)), 30)
        assert len(gen.token_ids) == 4


async def test_a_reloaded_tenant_file_changes_the_objectives_the_scheduler_applies(
    start_control, tmp_path: Path
) -> None:
    """SIGHUP reaches the scheduler, not only the quotas: a TTFT default the file gives the calm
    tenant after the start refuses its next calls that name no objective (counted in its
    `rejected`), and taking it out again lets them run."""
    flags = stack_files(tmp_path)
    tenants = Path(flags[flags.index("--tenants") + 1])  # calm is its last table: a line added is calm's
    listed = tenants.read_text()
    plane: ControlProcess = await start_control(*flags, "--slo-cost", "0.01,0.001,0,0")
    plane.add_worker("w0")
    await plane.wait_workers(1, api_key=CALM)
    sampling = sampling_params(max_new_tokens=2, ignore_eos=True)
    async with StepwiseClient(plane.address, api_key=CALM) as client:
        calls = itertools.count()

        async def refused() -> grpc.aio.AioRpcError | None:
            """One call naming no objective: the error that refused it, or None when it ran. Each
            call's first token is its own, so no prompt finds another's in the prefix cache."""
            i = next(calls)
            request = generate_request([300 + i % 1000, *range(5, 204)], sampling, f"r{i}")
            try:
                gen = await asyncio.wait_for(collect(client.stream(request)), 30)
            except grpc.aio.AioRpcError as exc:
                return exc
            assert len(gen.token_ids) == 2
            return None

        async def reload(text: str, refusing: bool) -> grpc.aio.AioRpcError | None:
            tenants.write_text(text)
            plane.control.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            while ((exc := await refused()) is not None) != refusing:
                assert time.monotonic() < deadline, "the reloaded tenant file did not reach the scheduler"
                await asyncio.sleep(0.05)
            return exc

        assert await refused() is None
        # An objective no step can meet (a step takes 10 ms): the file is refused, the table stays.
        tenants.write_text(listed + "ttft_slo_ms = 1\n")
        plane.control.send_signal(signal.SIGHUP)
        await asyncio.sleep(0.5)
        assert await refused() is None
        # One the cost model can tell this prompt misses (200 prefill tokens at 1 ms each).
        exc = await reload(listed + "ttft_slo_ms = 50\n", refusing=True)
        assert exc is not None and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = exc.details() or ""
        assert details.startswith("ttft_slo_ms: ") and "objective (50 ms)" in details, details
        # The reload loop stops at the first refusal: counted once.
        assert [(t.name, t.rejected) for t in (await client.server_info()).tenants] == [("calm", 1)]
        await reload(listed, refusing=False)
        assert plane.control.poll() is None
