"""Read a Hugging Face style checkpoint directory without importing transformers' model classes.

Supported families (all pre-norm decoders with SwiGLU MLPs and rotary attention): Llama (with
optional attention/MLP biases and Llama-3 rope scaling), Mistral (sliding window on every layer),
Qwen2 (q/k/v biases, optional sliding window on upper layers) and Qwen3 (per-head q/k RMSNorm,
head_dim independent of hidden_size / heads). What differs between them is captured as plain flags
on `ModelConfig`, so the runner has one code path.

What is read: config.json (parsed here, so start-up does not pay for transformers' imports),
generation_config.json (eos ids only), and safetensors weights, either `model.safetensors` or the
shards listed in `model.safetensors.index.json`. Anything we cannot run is refused with a
`ModelLoadError` that names the file or the setting.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from dataclasses import dataclass
from typing import Any

import torch

# Architecture name in config.json -> the model_type transformers gives it.
FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
SUPPORTED_ROPE_TYPES = ("default", "llama3")
SINGLE_WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


class ModelLoadError(Exception):
    """The checkpoint is missing a file or uses something this worker cannot run."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary settings; the llama3 fields matter only when rope_type == "llama3"."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The parts of config.json the Llama runner needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    # Union of config.json's and generation_config.json's eos ids, sorted.
    eos_token_ids: tuple[int, ...]
    # The checkpoint's own dtype ("float32", "bfloat16", ...), used for dtype "auto" reporting only.
    torch_dtype: str
    # Family differences. Biases: q/k/v projections, the output projection, the three MLP projections.
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # Qwen3: RMSNorm over head_dim applied to every query and key head before rotary.
    qk_norm: bool = False
    # Keys a query may see on sliding layers: itself and the window - 1 before it.
    sliding_window: int | None = None
    # One flag per layer; True where the layer uses sliding_window (never True when it is None).
    sliding_layers: tuple[bool, ...] = ()

    @property
    def family(self) -> str:
        return FAMILIES[self.architecture]


def read_model_config(model_dir: pathlib.Path) -> ModelConfig:
    """Parse and check config.json; ModelLoadError if the model is not one we can run."""
    raw = _read_json(model_dir / "config.json")
    architecture = _architecture(raw)
    _refuse_unsupported_options(raw)
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    num_layers = int(raw["num_hidden_layers"])
    window = _sliding_window(FAMILIES[architecture], raw)
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rope=_rope_config(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_token_ids=_eos_ids(raw, model_dir),
        torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        **_family_flags(FAMILIES[architecture], raw),
        sliding_window=window,
        sliding_layers=_sliding_layers(FAMILIES[architecture], raw, num_layers, window),
    )


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"missing {path.name} in {path.parent}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def _architecture(raw: dict[str, Any]) -> str:
    names = raw.get("architectures") or []
    for name in names:
        if name in FAMILIES:
            return str(name)
    by_type = {model_type: name for name, model_type in FAMILIES.items()}
    if not names and raw.get("model_type") in by_type:
        return by_type[raw["model_type"]]
    found = ", ".join(names) or f"model_type={raw.get('model_type')!r}"
    raise ModelLoadError(f"unsupported architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _family_flags(family: str, raw: dict[str, Any]) -> dict[str, bool]:
    """Which optional tensors a family's layers carry, as transformers' modeling files define them."""
    attention_bias = bool(raw.get("attention_bias", False))
    if family == "llama":
        return {"qkv_bias": attention_bias, "o_bias": attention_bias, "mlp_bias": bool(raw.get("mlp_bias"))}
    if family == "qwen2":
        return {"qkv_bias": True}
    if family == "qwen3":
        return {"qkv_bias": attention_bias, "o_bias": attention_bias, "qk_norm": True}
    return {}


def _sliding_window(family: str, raw: dict[str, Any]) -> int | None:
    """The window in tokens, or None. Qwen files often name a window but switch it off."""
    window = raw.get("sliding_window")
    if family in ("llama",) or window is None:
        return None
    if family in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        return None
    if int(window) < 1:
        raise ModelLoadError(f"unsupported sliding_window {window!r}")
    return int(window)


def _sliding_layers(
    family: str, raw: dict[str, Any], num_layers: int, window: int | None
) -> tuple[bool, ...]:
    """Per-layer sliding flags: from `layer_types` when the file has it, else the family's rule."""
    if window is None:
        return (False,) * num_layers
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown or len(layer_types) != num_layers:
            raise ModelLoadError(
                f"unsupported layer_types {sorted(set(layer_types))} for {num_layers} layers"
            )
        return tuple(t == "sliding_attention" for t in layer_types)
    if family == "mistral":
        return (True,) * num_layers
    first_sliding = int(raw.get("max_window_layers", num_layers))
    return tuple(i >= first_sliding for i in range(num_layers))


def _refuse_unsupported_options(raw: dict[str, Any]) -> None:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"unsupported hidden_act {act!r} (only silu)")


def _rope_config(raw: dict[str, Any]) -> RopeConfig:
    """transformers 5 keeps rope settings in `rope_parameters`; older files use rope_theta/rope_scaling."""
    params = dict(raw.get("rope_parameters") or {})
    if not params:
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = str(params.get("rope_type") or params.get("type") or "default")
    if float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ModelLoadError("unsupported partial_rotary_factor (only full rotary)")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeConfig(
        rope_type=rope_type,
        theta=float(params.get("rope_theta", 10000.0)),
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )


def _eos_ids(raw: dict[str, Any], model_dir: pathlib.Path) -> tuple[int, ...]:
    ids = set(_as_id_list(raw.get("eos_token_id")))
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        ids.update(_as_id_list(_read_json(gen_path).get("eos_token_id")))
    return tuple(sorted(ids))


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]


def weight_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    """The safetensors files of the checkpoint, sorted; ModelLoadError naming a missing one."""
    index_path = model_dir / WEIGHTS_INDEX
    if index_path.is_file():
        names = sorted(set(_read_json(index_path).get("weight_map", {}).values()))
        files = [model_dir / name for name in names]
    else:
        files = [model_dir / SINGLE_WEIGHTS]
    for path in files:
        if not path.is_file():
            raise ModelLoadError(f"missing weight file {path.name} in {model_dir}")
    return files


def model_fingerprint(model_dir: pathlib.Path) -> str:
    """sha256 over config.json's bytes and each weight file's name and size (cheap, no weight reads)."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in weight_files(model_dir):
        digest.update(f"\0{path.name}\0{path.stat().st_size}".encode())
    return digest.hexdigest()


def load_tensors(
    model_dir: pathlib.Path, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """All weights by name, converted to `dtype` on `device`."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        for name, tensor in load_file(str(path), device="cpu").items():
            tensors[name] = tensor.to(device=device, dtype=dtype)
    return tensors
