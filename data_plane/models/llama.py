"""A Llama-family decoder written directly over the checkpoint's tensors and the paged KV pool.

Numerics follow transformers' LlamaForCausalLM (RMSNorm in float32, rotate-half rotary with
cos/sin computed in float32, SwiGLU), so float32 logits match it to ~1e-6. Q/K/V and gate/up
projections are fused into one matmul each; that changes only float summation order.

The same layer serves Mistral, Qwen2 and Qwen3: optional biases ride along the fused
projections, Qwen3's q/k norms run per head before rotary, and sliding-window layers pick the
attention group's window mask. Which of these a checkpoint uses comes from `ModelConfig` flags.
"""

from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from data_plane.backends.base import StepAttention
from data_plane.kv_pool import KvPool
from data_plane.models.loader import (
    ModelConfig,
    ModelLoadError,
    RopeConfig,
    load_tensors,
    read_model_config,
)


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """One step's flat tokens and how they attend; built by the executor from plan deltas."""

    # [T] input token ids, their positions, and the pool slot each token's K/V is written to.
    token_ids: torch.Tensor
    positions: torch.Tensor
    write_slots: torch.Tensor
    # The step's attention, planned by the executor's backend (data_plane/backends).
    attention: StepAttention
    # [S] flat indices of the tokens whose logits are needed (rows that sample).
    sample_index: torch.Tensor
    # [P] flat indices of the prompt rows to score (data_plane/scoring.py); None when none. Only their
    # final-normed hidden states come back: the executor runs the LM head over them in slices.
    score_index: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class ForwardOutput:
    """What a forward returns: the sampling rows' logits and the scored rows' hidden states."""

    logits: torch.Tensor  # float32 [S, vocab]
    # [P, hidden] in the model's dtype, final-normed (the LM head's input); None when none scored.
    scored_hidden: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer's tensors; the optional ones are None when the family has no such tensor."""

    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2 * Hkv) * D, hidden]
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [head_dim]
    k_norm: torch.Tensor | None = None
    sliding: bool = False


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Rotary inverse frequencies (float32, [head_dim / 2]), with llama3 long-context scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short kept, a smooth blend between."""
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, cast back before the weight multiply (as transformers does)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    """Runs one ragged forward per step over the KV pool. Not thread-safe: one step at a time."""

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
        self.config = config
        self.device = device
        self.embed = _take(tensors, "model.embed_tokens.weight")
        self.final_norm = _take(tensors, "model.norm.weight")
        self.lm_head = self.embed if config.tie_word_embeddings else _take(tensors, "lm_head.weight")
        self.layers = tuple(_layer_weights(tensors, config, i) for i in range(config.num_layers))
        self.dtype = self.embed.dtype
        self.inv_freq = rope_inv_freq(config.rope, config.head_dim).to(device)
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        # The window the executor builds masks for; None when no layer slides.
        self.sliding_window = config.sliding_window if any(config.sliding_layers) else None

    @classmethod
    def from_dir(cls, model_dir: pathlib.Path, device: torch.device, dtype: torch.dtype) -> LlamaModel:
        """Load config and weights; ModelLoadError names a missing file, tensor or unsupported setting."""
        config = read_model_config(model_dir)
        return cls(config, load_tensors(model_dir, device, dtype), device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KvPool) -> ForwardOutput:
        """Write every token's K/V to its slot; float32 logits [S, vocab] for sample_index, and the
        final-normed hidden states of score_index."""
        hidden = F.embedding(batch.token_ids, self.embed)
        cos, sin = self._rotary(batch.positions)
        for index, layer in enumerate(self.layers):
            hidden = self._layer(index, layer, hidden, cos, sin, batch, pool)
        eps = self.config.rms_norm_eps
        logits = self.head(rms_norm(hidden[batch.sample_index], self.final_norm, eps))
        scored = None
        if batch.score_index is not None:
            scored = rms_norm(hidden[batch.score_index], self.final_norm, eps)
        return ForwardOutput(logits, scored)

    def head(self, normed: torch.Tensor) -> torch.Tensor:
        """The LM head: float32 logits [R, vocab] of final-normed hidden states [R, hidden]."""
        return (normed @ self.lm_head.T).float()

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _layer(
        self,
        index: int,
        w: LayerWeights,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        pool: KvPool,
    ) -> torch.Tensor:
        cfg = self.config
        x = rms_norm(hidden, w.input_norm, cfg.rms_norm_eps)
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = F.linear(x, w.qkv, w.qkv_bias).split((q_size, kv_size, kv_size), dim=-1)
        q = q.reshape(-1, cfg.num_heads, cfg.head_dim)
        k = k.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        if w.q_norm is not None and w.k_norm is not None:
            q, k = rms_norm(q, w.q_norm, cfg.rms_norm_eps), rms_norm(k, w.k_norm, cfg.rms_norm_eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        pool.write(index, batch.write_slots, k, v)
        attn = batch.attention.attend(index, q, k, v, pool, w.sliding)
        hidden = hidden + F.linear(attn, w.o, w.o_bias)
        x = rms_norm(hidden, w.post_norm, cfg.rms_norm_eps)
        gate, up = F.linear(x, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
        return hidden + F.linear(F.silu(gate) * up, w.down, w.down_bias)


def _take(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise ModelLoadError(f"weights have no tensor {name}")
    return tensors[name]


def _fused(
    tensors: dict[str, torch.Tensor], prefix: str, names: tuple[str, ...], suffix: str
) -> torch.Tensor:
    """Concatenate `{prefix}{name}_proj.{suffix}` over names along dim 0 (one matmul instead of several)."""
    return torch.cat([_take(tensors, f"{prefix}{name}_proj.{suffix}") for name in names], dim=0)


def _layer_weights(tensors: dict[str, torch.Tensor], cfg: ModelConfig, i: int) -> LayerWeights:
    """Layer i's tensors; a tensor the config promises but the file lacks is a ModelLoadError."""
    p = f"model.layers.{i}."
    attn, mlp = f"{p}self_attn.", f"{p}mlp."
    return LayerWeights(
        input_norm=_take(tensors, f"{p}input_layernorm.weight"),
        qkv=_fused(tensors, attn, ("q", "k", "v"), "weight"),
        o=_take(tensors, f"{attn}o_proj.weight"),
        post_norm=_take(tensors, f"{p}post_attention_layernorm.weight"),
        gate_up=_fused(tensors, mlp, ("gate", "up"), "weight"),
        down=_take(tensors, f"{mlp}down_proj.weight"),
        qkv_bias=_fused(tensors, attn, ("q", "k", "v"), "bias") if cfg.qkv_bias else None,
        o_bias=_take(tensors, f"{attn}o_proj.bias") if cfg.o_bias else None,
        gate_up_bias=_fused(tensors, mlp, ("gate", "up"), "bias") if cfg.mlp_bias else None,
        down_bias=_take(tensors, f"{mlp}down_proj.bias") if cfg.mlp_bias else None,
        q_norm=_take(tensors, f"{attn}q_norm.weight") if cfg.qk_norm else None,
        k_norm=_take(tensors, f"{attn}k_norm.weight") if cfg.qk_norm else None,
        sliding=cfg.sliding_layers[i] if cfg.sliding_layers else False,
    )
