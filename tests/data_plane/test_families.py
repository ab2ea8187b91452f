"""Every supported family against transformers on tiny random checkpoints built in the test.

Per family: one mixed step (fresh prompts, a cached prefix, a second chunk and decodes in one plan)
on page sizes 1, 4 and 16 with scrambled slots, within 1e-4 of transformers' float32 logits;
greedy generation equal to `generate(do_sample=False)`; bfloat16 and float16 runs close to
transformers in the same dtype. The checkpoints cover Llama (llama3 rope, untied; biases, tied),
Mistral (sliding window shorter than the prompts), Qwen2 (q/k/v biases, tied; sliding window on
the upper layer only), Qwen3 (q/k norm, head_dim 24 != 64 / 4, sharded weights with an index).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
from collections.abc import Callable

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from data_plane.executor import Executor
from data_plane.kv_pool import KvPool
from data_plane.models.llama import LlamaModel
from data_plane.models.loader import ModelLoadError, load_tensors, read_model_config, weight_files
from protos.worker import StepPlan
from tests.data_plane.factories import Driver, Extend, SlotAllocator, hf_next_logits, make_plan, new_seq
from tests.data_plane.families import BY_NAME, FAMILY_NAMES, VOCAB, build_checkpoint, load_reference

CPU = torch.device("cpu")
FLOAT32_TOLERANCE = 1e-4
# Low precision: both sides round every op's output to 8 (bf16) or 11 (fp16) mantissa bits, but in
# different places (we fuse q/k/v and gate/up, gather KV from a pool, pad queries), so single
# roundings of relative size 2^-8 / 2^-11 on logits of magnitude ~3 can differ by one or two ulps
# and compound over two layers. These bounds are several ulps of the logits' scale.
LOW_PRECISION_TOLERANCE = {torch.bfloat16: 0.1, torch.float16: 0.02}
NEW_TOKENS = 10


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], pathlib.Path]:
    """Builds (once per session) the checkpoint directory of a family by name."""
    built: dict[str, pathlib.Path] = {}

    def get(name: str) -> pathlib.Path:
        if name not in built:
            built[name] = build_checkpoint(BY_NAME[name], tmp_path_factory.mktemp(name))
        return built[name]

    return get


@pytest.fixture(scope="session")
def family_models(family_dir: Callable[[str], pathlib.Path]) -> Callable[..., tuple[LlamaModel, object]]:
    """(ours, transformers') for a family and dtype, cached for the session."""
    cache: dict[tuple[str, torch.dtype], tuple[LlamaModel, object]] = {}

    def get(name: str, dtype: torch.dtype = torch.float32) -> tuple[LlamaModel, object]:
        if (name, dtype) not in cache:
            path = family_dir(name)
            cache[name, dtype] = (LlamaModel.from_dir(path, CPU, dtype), load_reference(path, dtype))
        return cache[name, dtype]

    return get


def _executor(model: LlamaModel, capacity: int = 1024) -> Executor:
    return Executor(model, KvPool(model.config, capacity, model.dtype, CPU))


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, VOCAB, size=n).tolist()


def _mixed_step(
    executor: Executor, slots: SlotAllocator, rng: np.random.Generator
) -> tuple[StepPlan, list[list[int]]]:
    """Run a prefill step; return the mixed plan and the full context each of its rows predicts from.

    Step 1 prefills handles 1-3 and the first chunk of handle 4. Step 2 mixes: handle 5 reuses
    handle 1's first 8 slots as a cached prefix, handle 4's second chunk, a fresh handle 6 and
    decodes of 3, 1, 2 (out of handle order).
    """
    prompts = {1: _tokens(rng, 12), 2: _tokens(rng, 7), 3: _tokens(rng, 5)}
    chunked = _tokens(rng, 20)
    step1 = make_plan(
        1,
        extends=[
            *(Extend(h, 0, p, slots.alloc(h, len(p))) for h, p in prompts.items()),
            Extend(4, 0, chunked[:8], slots.alloc(4, 8), sample=False),
        ],
        new_seqs=[new_seq(h) for h in (1, 2, 3, 4)],
    )
    first = executor.execute(step1)
    assert first.error == ""
    seen = {h: [*p, t] for (h, p), t in zip(prompts.items(), first.token_ids.tolist(), strict=True)}
    tail5, fresh6 = _tokens(rng, 6), _tokens(rng, 9)
    step2 = make_plan(
        2,
        new_seqs=[new_seq(5, prefix_slots=executor.table.slot_table(1)[:8]), new_seq(6)],
        extends=[
            Extend(5, 8, tail5, slots.alloc(5, 6)),
            Extend(4, 8, chunked[8:], slots.alloc(4, 12)),
            Extend(6, 0, fresh6, slots.alloc(6, 9)),
        ],
        decodes=[(h, int(slots.alloc(h, 1)[0])) for h in (3, 1, 2)],
    )
    return step2, [prompts[1][:8] + tail5, chunked, fresh6, seen[3], seen[1], seen[2]]


def _mixed_step_diff(model: LlamaModel, reference: object, page_size: int, seed: int) -> float:
    """Max abs difference between our mixed step's logits and transformers' on the same contexts."""
    rng = np.random.default_rng(seed)
    executor = _executor(model)
    plan, contexts = _mixed_step(executor, SlotAllocator(1024, page_size, seed=seed), rng)
    ours = executor.forward_logits(plan).float()
    expected = torch.stack([hf_next_logits(reference, ctx) for ctx in contexts])
    return (ours - expected).abs().max().item()


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_mixed_step_matches_transformers(family_models, family: str, page_size: int) -> None:
    model, reference = family_models(family)
    diff = _mixed_step_diff(model, reference, page_size, seed=page_size)
    assert diff < FLOAT32_TOLERANCE, f"{family}: max abs logits diff {diff}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_low_precision_matches_transformers_in_same_dtype(family_models, family: str, dtype) -> None:
    model, reference = family_models(family, dtype)
    assert model.dtype == dtype
    diff = _mixed_step_diff(model, reference, page_size=4, seed=11)
    assert diff < LOW_PRECISION_TOLERANCE[dtype], f"{family} {dtype}: max abs logits diff {diff}"


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_greedy_matches_transformers_generate(family_models, family: str) -> None:
    model, reference = family_models(family)
    rng = np.random.default_rng(5)
    prompts = {1: _tokens(rng, 5), 2: _tokens(rng, 11), 3: _tokens(rng, 17)}
    driver = Driver(_executor(model), SlotAllocator(1024, page_size=4, seed=2))
    driver.prefill(prompts)
    for _ in range(NEW_TOKENS - 1):
        driver.decode(list(prompts))
    for handle, prompt in prompts.items():
        with torch.no_grad():
            out = reference.generate(  # type: ignore[attr-defined]
                torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS
            )
        assert driver.tokens[handle][len(prompt) :] == out[0, len(prompt) :].tolist(), f"handle {handle}"


def test_family_settings_are_read(family_dir) -> None:
    """Each spec's distinguishing settings arrive in ModelConfig."""
    llama = read_model_config(family_dir("llama"))
    assert (llama.family, llama.rope.rope_type, llama.tie_word_embeddings) == ("llama", "llama3", False)
    biased = read_model_config(family_dir("llama_bias"))
    assert (biased.qkv_bias, biased.o_bias, biased.mlp_bias, biased.tie_word_embeddings) == (True,) * 4
    mistral = read_model_config(family_dir("mistral"))
    assert (mistral.sliding_window, mistral.sliding_layers) == (7, (True, True))
    qwen2 = read_model_config(family_dir("qwen2"))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.sliding_window) == (True, False, None)
    windowed = read_model_config(family_dir("qwen2_window"))
    assert (windowed.sliding_window, windowed.sliding_layers) == (5, (False, True))
    qwen3 = read_model_config(family_dir("qwen3"))
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.hidden_size // qwen3.num_heads) == (True, 24, 16)
    assert len(weight_files(family_dir("qwen3"))) > 1


@pytest.mark.parametrize("family", ["mistral", "qwen2_window"])
def test_sliding_window_is_exercised(family_dir, family_models, family: str) -> None:
    """The windowed checkpoints' contexts outrun the window: full attention would not match."""
    _, reference = family_models(family)
    config = read_model_config(family_dir(family))
    unwindowed = dataclasses.replace(config, sliding_window=None, sliding_layers=(False,) * config.num_layers)
    full = LlamaModel(unwindowed, load_tensors(family_dir(family), CPU, torch.float32), CPU)
    assert _mixed_step_diff(full, reference, page_size=4, seed=4) > 0.01


def _copy(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(model_dir: pathlib.Path, **changes: object) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def test_missing_shard_is_refused_by_name(family_dir, tmp_path: pathlib.Path) -> None:
    out = _copy(family_dir("qwen3"), tmp_path / "m")
    victim = weight_files(out)[1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=victim.name):
        LlamaModel.from_dir(out, CPU, torch.float32)


def test_missing_config_is_refused_by_name(family_dir, tmp_path: pathlib.Path) -> None:
    out = _copy(family_dir("qwen2"), tmp_path / "m")
    (out / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        LlamaModel.from_dir(out, CPU, torch.float32)


def test_tensor_the_family_needs_is_refused_by_name(family_dir, tmp_path: pathlib.Path) -> None:
    """Qwen2 always has q/k/v biases; a file without one is refused naming the tensor."""
    out = _copy(family_dir("qwen2"), tmp_path / "m")
    tensors = load_file(str(out / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        LlamaModel.from_dir(out, CPU, torch.float32)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}, "MixtralForCausalLM"),
        ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}, "Qwen3MoeForCausalLM"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "yarn"),
        ({"layer_types": ["full_attention", "chunked_attention"]}, "chunked_attention"),
    ],
)
def test_unsupported_settings_are_refused_by_name(family_dir, tmp_path: pathlib.Path, changes, named) -> None:
    out = _copy(family_dir("mistral"), tmp_path / "m")
    _edit_config(out, **changes)
    with pytest.raises(ModelLoadError, match=named):
        read_model_config(out)
