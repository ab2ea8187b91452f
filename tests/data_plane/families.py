"""Tiny random checkpoints of every supported family, built offline with transformers' own classes.

Each spec names a transformers config class and the settings that make its family different
(biases, q/k norms, head_dim != hidden / heads, sliding window, llama3 rope, tied or untied
embeddings, sharded weights). `build_checkpoint` seeds the init, perturbs the tensors that
transformers initialises to constants (norms to one, biases to zero) so that they matter, and
saves with `save_pretrained` into a directory our loader then reads.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field
from typing import Any

import torch

VOCAB = 256
# Shared by every family: small enough that a forward is a millisecond, big enough for GQA.
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


@dataclass(frozen=True)
class FamilySpec:
    """One tiny checkpoint: the transformers config class name and what sets it apart."""

    name: str
    config_class: str
    settings: dict[str, Any] = field(default_factory=dict)
    # Passed to save_pretrained as max_shard_size, to get an index plus several shard files.
    max_shard_size: str | None = None


FAMILIES = (
    FamilySpec(
        "llama",
        "LlamaConfig",
        {
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    FamilySpec(
        "llama_bias", "LlamaConfig", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}
    ),
    FamilySpec("mistral", "MistralConfig", {"tie_word_embeddings": False, "sliding_window": 7}),
    FamilySpec("qwen2", "Qwen2Config", {"tie_word_embeddings": True}),
    # Sliding window on layer 1 only (layers >= max_window_layers slide), full attention on layer 0.
    FamilySpec(
        "qwen2_window",
        "Qwen2Config",
        {
            "tie_word_embeddings": False,
            "use_sliding_window": True,
            "sliding_window": 5,
            "max_window_layers": 1,
        },
    ),
    FamilySpec(
        "qwen3",
        "Qwen3Config",
        {"tie_word_embeddings": False, "head_dim": 24},
        max_shard_size="100KB",
    ),
)
FAMILY_NAMES = tuple(spec.name for spec in FAMILIES)
BY_NAME = {spec.name: spec for spec in FAMILIES}


def build_checkpoint(spec: FamilySpec, out: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Create, perturb and save a float32 checkpoint for `spec` into `out`; returns `out`."""
    import transformers
    from transformers import AutoModelForCausalLM

    config = getattr(transformers, spec.config_class)(**COMMON, **spec.settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_constants(model, seed)
    kwargs = {"max_shard_size": spec.max_shard_size} if spec.max_shard_size else {}
    model.save_pretrained(str(out), **kwargs)
    return out


def _perturb_constants(model: torch.nn.Module, seed: int) -> None:
    """Norm weights around one and biases around zero, so a runner that skips them fails the tests."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.2 * noise)


def load_reference(model_dir: pathlib.Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    """transformers' model for a checkpoint directory, in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
