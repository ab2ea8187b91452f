"""The contenders `stepwise compare` measures side by side on one workload.

Each contender runs a list of `BenchRequest`s greedily, ignoring EOS, with at most `cap` requests
at a time, and answers one `Measurement`: the useful output tokens (each request's own
`max_new_tokens`, never the padding a batch runs past it), the wall time, the CPU time that did
the work, and the forward steps where the contender can count them.

- `stepwise`: the real system, a `Stack` (control plane + one worker), requests streamed with
  `StepwiseClient` at `cap` in flight. A variant is the same under extra control-plane flags, on
  a Stack of its own.
- `static`: the same Stack, requests in fixed batches of `cap`; a batch goes only once the previous
  one has completely finished.
- `transformers-static`: transformers' padded `generate` (left padding) per batch of `cap`.
- `transformers-cb`: transformers' own continuous batching manager, at most `cap` per batch.
- `raw-forward`: the plain batched loop per batch of `cap`: one padded prefill, then greedy decode
  steps on a `DynamicCache` until the batch's longest request ends.

The Stack contenders' CPU is their own Stack's processes' (control plane, its frontends, the
worker), read from /proc; the in-process ones' is this process's (all its threads). Only one contender runs at
a time, so the Stack idles while the transformers contenders run and the reverse.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from clients.client import StepwiseClient
from clients.datasets import BenchRequest

if TYPE_CHECKING:
    from stepwise.up import Stack

# The Stack runs without its radix cache: every round sends the same prompts again, and a cache
# hit on them would spare stepwise prefill work that none of the baselines is spared.
STACK_CONTROL_ARGS = [
    "--host",
    "127.0.0.1",
    "--port",
    "0",
    "--worker-port",
    "0",
    "--log-level",
    "warning",
    "--disable-radix-cache",
]
STACK_WORKER_ARGS = ["--log-level", "warning"]
# Ids left of a prompt in a left-padded batch; masked out, so any id does.
PAD_ID = 0


@dataclass(frozen=True, slots=True)
class Measurement:
    """One run of one contender over the whole workload."""

    useful_tokens: int  # output tokens the requests asked for and got
    wall_s: float  # from the first request sent to the last one finished
    cpu_s: float  # user + system CPU of the processes (or this process) doing the work
    steps: int | None = None  # forward steps the worker ran (None: not counted)
    # Tokens the forwards produced, padding rows of a static batch included (None: not counted):
    # the raw loop's forward speed is these per second, its useful speed only `useful_tokens`.
    forward_tokens: int | None = None


class Contender(Protocol):
    """A way to serve the workload. `start` and `stop` bracket all rounds; `run` is one round."""

    name: str

    async def start(self) -> None: ...

    async def run(self, requests: Sequence[BenchRequest], cap: int) -> Measurement: ...

    async def stop(self) -> None: ...


def batches(requests: Sequence[BenchRequest], size: int) -> Iterator[Sequence[BenchRequest]]:
    """Consecutive batches of `size` (the last one may be smaller), in workload order."""
    for start in range(0, len(requests), size):
        yield requests[start : start + size]


# --- the Stack contenders --------------------------------------------------------------------------


class StackServer:
    """One Stack (control plane + one worker on `model_dir`) shared by the Stack contenders, started
    on first use, its control plane under `control_flags` on top of STACK_CONTROL_ARGS. Its children
    run with one thread each (OMP_NUM_THREADS=1)."""

    def __init__(self, model_dir: Path, control_flags: Sequence[str] = ()) -> None:
        self.model = ["--model", str(model_dir)]
        self.control_flags = list(control_flags)
        self.stack: Stack | None = None
        self.address = ""

    async def start(self) -> None:
        if self.stack is not None:
            return
        from stepwise.up import Stack

        control = [*STACK_CONTROL_ARGS, *self.model, *self.control_flags]
        self.stack = Stack(control, [*STACK_WORKER_ARGS, *self.model], workers=1)
        try:
            with _environment(OMP_NUM_THREADS="1"):
                self.address = await self.stack.start()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.stop()
            self.stack = None

    async def worker_steps(self, client: StepwiseClient) -> int:
        return sum(worker.steps for worker in (await client.server_info()).workers)

    def cpu_s(self) -> float:
        """CPU seconds so far of this Stack's live processes and theirs (not another Stack's)."""
        assert self.stack is not None, "cpu_s before start"
        pids = [proc.pid for proc in self.stack.procs]
        return sum(_process_cpu_s(pid) for pid in [*pids, *_descendants(*pids)])


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Set environment variables for the block (children spawned in it inherit them)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _descendants(*roots: int) -> list[int]:
    """Pids of the live processes descended from `roots` (a scan of /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):  # it exited meanwhile
                children.setdefault(int(_stat(int(entry.name))[STAT_PPID]), []).append(int(entry.name))
    found, todo = [], list(roots)
    while todo:
        kids = children.get(todo.pop(), [])
        found.extend(kids)
        todo.extend(kids)
    return found


# /proc/PID/stat after the command name: state, ppid, ..., utime, stime (clock ticks), ...
STAT_PPID, STAT_UTIME, STAT_STIME = 1, 11, 12


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat that follow the command name (which may hold spaces)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()


def _process_cpu_s(pid: int) -> float:
    try:
        fields = _stat(pid)
    except OSError:  # it exited meanwhile
        return 0.0
    return (int(fields[STAT_UTIME]) + int(fields[STAT_STIME])) / os.sysconf("SC_CLK_TCK")


async def _generate(client: StepwiseClient, request: BenchRequest) -> int:
    """One greedy, EOS-ignoring generation; its completion tokens."""
    gen = await client.generate(
        request.prompt_ids, max_new_tokens=request.max_new_tokens, temperature=0.0, ignore_eos=True
    )
    if gen.finish_reason != "length":
        raise RuntimeError(f"request {gen.request_id} ended with {gen.finish_reason}: {gen.finish_message}")
    return gen.completion_tokens


class _StackContender:
    """Shared by the Stack contenders: measure one round; `_send` is how the requests go."""

    name = ""

    def __init__(self, server: StackServer) -> None:
        self.server = server

    async def start(self) -> None:
        await self.server.start()

    async def stop(self) -> None:
        self.server.stop()

    async def run(self, requests: Sequence[BenchRequest], cap: int) -> Measurement:
        async with StepwiseClient(self.server.address) as client:
            steps, cpu = await self.server.worker_steps(client), self.server.cpu_s()
            start = time.perf_counter()
            useful = await self._send(client, requests, cap)
            wall = time.perf_counter() - start
            # CPU first, steps after: the GetServerInfo call costs the control plane a little CPU.
            cpu = self.server.cpu_s() - cpu
            steps = await self.server.worker_steps(client) - steps
        return Measurement(useful, wall, cpu, steps)

    async def _send(self, client: StepwiseClient, requests: Sequence[BenchRequest], cap: int) -> int:
        raise NotImplementedError


class StepwiseContender(_StackContender):
    """Continuous batching by the real system: `cap` requests in flight, a new one as one ends.
    A variant is one of these under its own name, on its own StackServer."""

    name = "stepwise"

    def __init__(self, server: StackServer, name: str = "stepwise") -> None:
        super().__init__(server)
        self.name = name

    async def _send(self, client: StepwiseClient, requests: Sequence[BenchRequest], cap: int) -> int:
        gate = asyncio.Semaphore(cap)

        async def one(request: BenchRequest) -> int:
            async with gate:
                return await _generate(client, request)

        return sum(await asyncio.gather(*(one(request) for request in requests)))


class StaticContender(_StackContender):
    """Static batching on the same worker: a batch of `cap` runs until its longest request ends."""

    name = "static"

    async def _send(self, client: StepwiseClient, requests: Sequence[BenchRequest], cap: int) -> int:
        useful = 0
        for batch in batches(requests, cap):
            useful += sum(await asyncio.gather(*(_generate(client, request) for request in batch)))
        return useful


# --- the in-process transformers contenders -------------------------------------------------------


class TransformersModel:
    """The model in transformers, float32 on the CPU, loaded once on first use and shared
    by the in-process contenders."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._model: Any = None

    def get(self) -> Any:
        if self._model is None:
            import torch
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            self._model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        return self._model


class _ModelContender:
    """Shared by the in-process contenders: the model, loaded at start."""

    name = ""

    def __init__(self, model: TransformersModel) -> None:
        self.model = model

    async def start(self) -> None:
        self.model.get()

    async def stop(self) -> None:
        return None


class _InProcessContender(_ModelContender):
    """Time `_serve` on this process's clock and CPU."""

    async def run(self, requests: Sequence[BenchRequest], cap: int) -> Measurement:
        model = self.model.get()
        cpu, start = time.process_time(), time.perf_counter()
        useful = self._serve(model, requests, cap)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        return Measurement(useful, wall, cpu, forward_tokens=self._forward_tokens(requests, cap))

    def _serve(self, model: Any, requests: Sequence[BenchRequest], cap: int) -> int:
        raise NotImplementedError

    def _forward_tokens(self, requests: Sequence[BenchRequest], cap: int) -> int:
        """Tokens the forwards produce, every row of a batch running to its longest request."""
        return sum(len(b) * max(r.max_new_tokens for r in b) for b in batches(requests, cap))


def _left_padded(batch: Sequence[BenchRequest]) -> tuple[Any, Any]:
    """(input_ids, attention_mask) of the batch's prompts, left-padded to the longest."""
    import torch

    width = max(len(request.prompt_ids) for request in batch)
    ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, request in enumerate(batch):
        n = len(request.prompt_ids)
        ids[row, width - n :] = torch.tensor(request.prompt_ids)
        mask[row, width - n :] = 1
    return ids, mask


class TransformersStaticContender(_InProcessContender):
    """transformers' padded `generate` per batch: every row runs to the batch's longest output.

    EOS is ignored as `min_new_tokens` (transformers fills an unset eos_token_id from the model's
    generation config, so it cannot simply be switched off); only each request's own output
    length counts as useful."""

    name = "transformers-static"

    def _serve(self, model: Any, requests: Sequence[BenchRequest], cap: int) -> int:
        import torch

        useful = 0
        for batch in batches(requests, cap):
            longest = max(request.max_new_tokens for request in batch)
            ids, mask = _left_padded(batch)
            with torch.inference_mode():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=False,
                    max_new_tokens=longest,
                    min_new_tokens=longest,
                    pad_token_id=PAD_ID,
                )
            produced = out.shape[1] - ids.shape[1]
            useful += sum(min(request.max_new_tokens, produced) for request in batch)
        return useful


class RawForwardContender(_InProcessContender):
    """The plain batched decode loop: the raw forward speed, with no serving around it."""

    name = "raw-forward"

    def _serve(self, model: Any, requests: Sequence[BenchRequest], cap: int) -> int:
        import torch

        useful = 0
        with torch.inference_mode():
            for batch in batches(requests, cap):
                produced = _decode_batch(model, batch)
                useful += sum(min(request.max_new_tokens, produced) for request in batch)
        return useful


def _decode_batch(model: Any, batch: Sequence[BenchRequest]) -> int:
    """One padded prefill, then greedy decode steps until the batch's longest request ends; the
    tokens each row produced (every row runs as long as the longest)."""
    import torch
    from transformers import DynamicCache

    longest = max(request.max_new_tokens for request in batch)
    ids, mask = _left_padded(batch)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(longest - 1):
        mask = torch.cat([mask, mask.new_ones((len(batch), 1))], dim=-1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=token, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    return longest


class TransformersCBContender(_ModelContender):
    """transformers' continuous batching (the manager behind `generate_batch`), at most `cap`
    requests per batch.

    The manager is driven directly rather than through `generate_batch`, which gives every request
    the same `max_new_tokens`: here each request asks for its own. EOS is off (eos_token_id -1).
    Building the manager (its KV cache) is not timed, as the Stack's start is not."""

    name = "transformers-cb"
    # The manager's KV pages (tokens each); sized for `cap` requests of the workload at once.
    PAGE_SIZE = 256

    async def run(self, requests: Sequence[BenchRequest], cap: int) -> Measurement:
        model = self.model.get()
        with self._manager(model, requests, cap) as manager:
            cpu, start = time.process_time(), time.perf_counter()
            # eos_token_id -1: no EOS, every request runs to its own max_new_tokens.
            ids = [
                manager.add_request(r.prompt_ids, max_new_tokens=r.max_new_tokens, eos_token_id=-1)
                for r in requests
            ]
            outputs = _collect(manager, ids)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        produced = [len(outputs[request_id].generated_tokens) for request_id in ids]
        useful = sum(min(n, r.max_new_tokens) for n, r in zip(produced, requests, strict=True))
        return Measurement(useful, wall, cpu)

    def _manager(self, model: Any, requests: Sequence[BenchRequest], cap: int) -> Any:
        import logging

        from transformers import ContinuousBatchingConfig, GenerationConfig

        # It logs an ERROR on every CPU start because psutil is missing: noise for this purpose.
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
        longest = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
        pages_each = -(-longest // self.PAGE_SIZE)
        config = ContinuousBatchingConfig(
            page_size=self.PAGE_SIZE,
            num_blocks=pages_each * cap + 1,
            max_batch_tokens=max(len(r.prompt_ids) for r in requests) * cap,
            max_requests_per_batch=cap,
        )
        generation = GenerationConfig(
            do_sample=False,
            max_new_tokens=max(r.max_new_tokens for r in requests),
            eos_token_id=-1,
            pad_token_id=PAD_ID,
        )
        return model.continuous_batching_context_manager(
            generation_config=generation, continuous_batching_config=config, block=True, timeout=5
        )


def _collect(manager: Any, request_ids: Sequence[str]) -> dict[str, Any]:
    """Wait for every request's final output; RuntimeError if one fails or the manager dies."""
    outputs: dict[str, Any] = {}
    while len(outputs) < len(request_ids):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped early")
            continue
        if result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"transformers-cb request {result.request_id} failed: {result.error}")
            outputs[result.request_id] = result
    return outputs


CONTENDER_NAMES = ("stepwise", "static", "transformers-static", "transformers-cb", "raw-forward")


def make_contenders(
    names: Sequence[str], model_dir: Path, variants: Sequence[tuple[str, Sequence[str]]] = ()
) -> list[Contender]:
    """The named contenders, in order, then one stepwise contender per variant (name, control-plane
    flags), each on a Stack of its own; the named Stack ones share one Stack, the others one model."""
    server, model = StackServer(model_dir), TransformersModel(model_dir)
    kinds: dict[str, Contender] = {
        "stepwise": StepwiseContender(server),
        "static": StaticContender(server),
        "transformers-static": TransformersStaticContender(model),
        "transformers-cb": TransformersCBContender(model),
        "raw-forward": RawForwardContender(model),
    }
    unknown = [name for name in names if name not in kinds]
    if unknown:
        raise ValueError(f"unknown contender(s) {', '.join(unknown)}; known: {', '.join(CONTENDER_NAMES)}")
    taken = [name for name, _ in variants if name in kinds]
    if taken:
        raise ValueError(f"variant name(s) {', '.join(taken)} taken by a contender")
    named: list[Contender] = [kinds[name] for name in names]
    return named + [StepwiseContender(StackServer(model_dir, flags), name) for name, flags in variants]
