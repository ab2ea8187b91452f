"""Log probabilities end to end (docs/protocols.md#log-probabilities): real processes, real gRPC,
the embedded model; every number is checked against transformers' log-softmax on the same weights
(float32, within 1e-4): generated tokens, their top alternatives, token_ids_logprob, and prompt
positions from logprob_start_len, under chunked prefill, prefix-cache hits before and after the start,
forced retraction, overlap on and off, two frontends and a lost worker's hand-over."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import grpc
import pytest

from clients.client import Generation, StepwiseClient, apply_response, generate_request, sampling_params
from control_plane.tokenizer import Tokenizer
from protos.stepwise.v1 import generation_pb2 as gen_pb
from tests.e2e.conftest import reference_model

pytestmark = pytest.mark.timeout(300)

TOL = 1e-4
TOP = 5
IDS_ASKED = (3, 17, 250)
TEXTS = [
    "Once upon a time there was a little girl who lived in a village near the forest.",
    "The king said to his daughter that she should marry the prince of the next kingdom",
    "In the morning the old man walked slowly down to the river, and there he",
]


def _reference(model_dir: Path, ids: list[int]):  # type: ignore[no-untyped-def]
    """log_softmax of transformers' logits at every position of `ids` ([len, vocab])."""
    import torch

    with torch.no_grad():
        logits = reference_model(model_dir)(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _check_position(ref_row, token: int, score: gen_pb.TokenLogprob, top: int = TOP) -> None:  # type: ignore[no-untyped-def]
    assert score.token_id == token
    assert abs(score.logprob - float(ref_row[token])) < TOL, (score.logprob, float(ref_row[token]))
    values, ids = ref_row.topk(top)
    assert list(score.top_ids) == ids.tolist()
    assert all(abs(a - b) < TOL for a, b in zip(score.top_logprobs, values.tolist(), strict=True))
    assert len(score.top_tokens) == top
    assert all(abs(a - float(ref_row[i])) < TOL for a, i in zip(score.ids_logprobs, IDS_ASKED, strict=True))


def check(model_dir: Path, prompt: list[int], gen: Generation, start: int | None) -> None:
    """Every logprob of `gen` (its tokens', and its prompt's from `start`) equals the reference."""
    assert gen.finish_reason in ("stop", "length"), gen.finish_message
    ref = _reference(model_dir, prompt + gen.token_ids)
    assert len(gen.logprobs) == len(gen.token_ids) > 0
    for k, (token, score) in enumerate(zip(gen.token_ids, gen.logprobs, strict=True)):
        _check_position(ref[len(prompt) + k - 1], token, score)
    if start is None:
        assert gen.prompt_logprobs is None
        return
    scored = gen.prompt_logprobs
    assert scored is not None and scored.start == start
    assert [p.token_id for p in scored.positions] == prompt[start:]
    first = scored.positions[0]
    assert not first.HasField("logprob") and not first.top_ids and not first.ids_logprobs
    for p, score in zip(range(start + 1, len(prompt)), scored.positions[1:], strict=True):
        _check_position(ref[p - 1], prompt[p], score)


def _params(start: int | None = None, **kw: object) -> gen_pb.SamplingParams:
    base: dict[str, object] = {
        "max_new_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": TOP,
        "token_ids_logprob": IDS_ASKED,
    }
    base.update(kw)
    return sampling_params(logprob_start_len=start, **base)  # type: ignore[arg-type]


async def _generate(client: StepwiseClient, ids: list[int], params: gen_pb.SamplingParams) -> Generation:
    gen = Generation()
    async for response in client.stream(generate_request(ids, params)):
        apply_response(gen, response)
    return gen


def _prompts(model_dir: Path) -> list[list[int]]:
    tok = Tokenizer.from_dir(model_dir)
    return [tok.encode(t) for t in TEXTS]


async def _run_cases(address: str, model_dir: Path) -> None:
    """Greedy and seeded, from several starts at once; then the prefix cache before and after."""
    prompts = _prompts(model_dir)
    cases = [
        (prompts[0], None, {}),
        (prompts[0], 0, {}),
        (prompts[1], 5, {"temperature": 0.8, "seed": 7}),
        (prompts[2], len(prompts[2]) - 1, {"temperature": 1.0, "seed": 3, "top_k": 20}),
    ]
    async with StepwiseClient(address) as client:
        gens = await asyncio.gather(*(_generate(client, ids, _params(s, **kw)) for ids, s, kw in cases))
        for (ids, start, _), gen in zip(cases, gens, strict=True):
            check(model_dir, ids, gen, start)
        # prompts[1] is cached now: a start after the cached part's reach, and one inside it.
        for start in (3, len(prompts[1]) - 4):
            gen = await _generate(client, prompts[1], _params(start))
            check(model_dir, prompts[1], gen, start)
            assert gen.cached_tokens <= start


async def test_logprobs_equal_transformers(start_stack, model_dir: Path) -> None:
    stack = await start_stack()
    await _run_cases(stack.address, model_dir)


@pytest.mark.slow
@pytest.mark.parametrize(
    "control",
    [
        ["--chunked-prefill-size", "8", "--disable-overlap-schedule"],
        ["--chunked-prefill-size", "8", "--frontends", "2"],
    ],
    ids=["chunked-no-overlap", "chunked-two-frontends"],
)
async def test_logprobs_with_chunks_overlap_and_frontends(
    start_stack, model_dir: Path, control: list[str]
) -> None:
    stack = await start_stack(control, ["--page-size", "4"])
    await _run_cases(stack.address, model_dir)


@pytest.mark.slow
async def test_logprobs_under_forced_retraction(
    start_stack, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STEPWISE_TEST_RETRACT", "1")
    stack = await start_stack(["--chunked-prefill-size", "16"])
    prompts = _prompts(model_dir)
    async with StepwiseClient(stack.address) as client:
        gens = await asyncio.gather(
            *(_generate(client, ids, _params(i, max_new_tokens=24)) for i, ids in enumerate(prompts * 2))
        )
        info = await client.server_info()
    assert info.workers[0].retractions > 0
    for i, (ids, gen) in enumerate(zip(prompts * 2, gens, strict=True)):
        check(model_dir, ids, gen, i)


@pytest.mark.slow
async def test_logprobs_across_a_lost_workers_hand_over(start_stack, model_dir: Path) -> None:
    """A worker killed mid-generation: the streams continue on the other one, each token with exactly
    one logprob entry, equal to the reference, and the prompt's scores once."""
    stack = await start_stack(workers=2)
    prompts = _prompts(model_dir)
    progress = [0] * len(prompts)
    prompt_events = [0] * len(prompts)

    async def stream(i: int) -> Generation:
        gen = Generation()
        request = generate_request(prompts[i], _params(0, max_new_tokens=80))
        async for response in client.stream(request):
            apply_response(gen, response)
            progress[i] = len(gen.token_ids)
            prompt_events[i] += response.WhichOneof("event") == "prompt_logprobs"
        return gen

    async with StepwiseClient(stack.address) as client:
        tasks = [asyncio.create_task(stream(i)) for i in range(len(prompts))]
        while min(progress) < 5:
            await asyncio.sleep(0.005)
        stack.procs[1].send_signal(signal.SIGKILL)
        gens = await asyncio.gather(*tasks)
    assert prompt_events == [1] * len(prompts)
    for ids, gen in zip(prompts, gens, strict=True):
        assert gen.completion_tokens == 80
        check(model_dir, ids, gen, 0)


async def test_prompt_only_scoring_and_bad_fields(start_stack, model_dir: Path) -> None:
    """logprob_start_len alone: the prompt's scores, and tokens without any (none were asked); then
    the refusals, each naming its field."""
    stack = await start_stack(["--max-top-logprobs", "8"])
    ids = _prompts(model_dir)[0]
    async with StepwiseClient(stack.address) as client:
        gen = await _generate(
            client, ids, sampling_params(max_new_tokens=0, logprob_start_len=0, top_logprobs=0)
        )
        assert gen.token_ids == [] and gen.logprobs == [] and gen.finish_reason == "length"
        assert gen.prompt_logprobs is not None and len(gen.prompt_logprobs.positions) == len(ids)
        assert gen.prompt_logprobs.text == Tokenizer.from_dir(model_dir).decode(
            ids, skip_special_tokens=False
        )
        # n = 3: the call hears its prompt's scores once; each sample's tokens carry their own.
        request = generate_request(ids, _params(2, n=3, temperature=1.0, seed=11, top_logprobs=3))
        events = [r async for r in client.stream(request)]
        prompts = [r.prompt_logprobs for r in events if r.WhichOneof("event") == "prompt_logprobs"]
        assert len(prompts) == 1 and events[0].WhichOneof("event") == "prompt_logprobs"
        for index in range(3):
            chunks = [r.chunk for r in events if r.WhichOneof("event") == "chunk" and r.chunk.index == index]
            tokens = [t for c in chunks for t in c.token_ids]
            assert [s.token_id for c in chunks for s in c.logprobs] == tokens and len(tokens) == 8
        bad = [
            (sampling_params(top_logprobs=9), r"sampling\.top_logprobs: must be in \[0, 8\]"),
            (sampling_params(logprob_start_len=len(ids)), r"sampling\.logprob_start_len: .* not below"),
            (sampling_params(logprob_start_len=-2), r"sampling\.logprob_start_len: must be >= -1"),
            (
                sampling_params(logprobs=True, token_ids_logprob=[5000]),
                r"sampling\.token_ids_logprob: token id 5000",
            ),
        ]
        for params, message in bad:
            with pytest.raises(grpc.aio.AioRpcError, match=message) as caught:
                await _generate(client, ids, params)
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT


async def test_generate_command_prints_each_tokens_logprobs(start_stack, model_dir: Path) -> None:
    """`stepwise generate --top-logprobs 2`: after the text, a line per token with its log probability
    (transformers' number) and two alternatives."""
    import argparse
    import io

    from clients import generate

    stack = await start_stack()
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    ns = parser.parse_args(
        [TEXTS[0], "--address", stack.address, "--max-new-tokens", "5", "--top-logprobs", "2"]
    )
    out = io.StringIO()
    gen = await generate.run(ns, out)
    lines = out.getvalue().splitlines()
    table = lines[-6:-1]
    assert len(gen.token_ids) == 5 and len(table) == 5 and lines[-1].startswith("[finish:")
    prompt = Tokenizer.from_dir(model_dir).encode(TEXTS[0])
    ref = _reference(model_dir, prompt + gen.token_ids)
    for k, line in enumerate(table):
        value = float(line.split("|")[0].split()[-1])
        assert abs(value - float(ref[len(prompt) + k - 1][gen.token_ids[k]])) < 1e-3
        assert len(line.split("|")[1].split("  ")) == 2
