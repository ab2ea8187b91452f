"""SGLang's native server endpoints besides `/generate`, which its own client calls: `sgl.RuntimeEndpoint`
asks `GET /get_model_info` when it connects (its `model_path` picks the client's chat template) and
`GET /get_server_info` on request; `sgl.Runtime` waits on `GET /health_generate`.

Each answer holds only what the control plane's ServerInfo says; SGLang's many server arguments that
mean nothing here are left out rather than made up. `/flush_cache` has no counterpart (the gateway
cannot empty a control plane's prefix cache), so it is refused by name (docs/protocols.md).
"""

from __future__ import annotations

from typing import Any

from gateway.errors import GatewayError
from protos.stepwise.v1 import generation_pb2 as gen_pb

# Seconds /health_generate waits for its one token (SGLang's own health check waits 20).
HEALTH_GENERATE_TIMEOUT_S = 20.0
# Its prompt: one token, as SGLang's health check sends one (token 0 exists in every vocabulary).
HEALTH_GENERATE_PROMPT = [0]


def model_info(served_name: str) -> dict[str, Any]:
    """`/get_model_info`: the served name stands for the model path (what the client matches its
    chat templates against)."""
    return {
        "model_path": served_name,
        "tokenizer_path": served_name,
        "is_generation": True,
        "preferred_sampling_params": None,
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }


def server_info(served_name: str, info: gen_pb.ServerInfo) -> dict[str, Any]:
    """`/get_server_info`: SGLang's names for what ServerInfo holds."""
    return {
        "model_path": served_name,
        "tokenizer_path": served_name,
        "served_model_name": served_name,
        "context_length": info.max_context,
        "max_total_num_tokens": info.kv_capacity_tokens,
        "version": info.version,
    }


def flush_cache_refusal() -> GatewayError:
    message = (
        "flush_cache: not supported by this gateway (it cannot empty the control plane's prefix "
        "cache; restart the control plane to start cold)"
    )
    return GatewayError(501, message, param="flush_cache")
