"""Worker configuration: one frozen object built from flags at the entry point."""

from __future__ import annotations

import argparse
import os
import pathlib
import socket
from dataclasses import dataclass

from flagtypes import MAX_TOKENS, PORT, Float, Int, seconds
from protos.targets import parse_targets
from protos.worker import ROLES

DEFAULT_CONTROL = "127.0.0.1:50052"
# On CPU the pool is allocated (and zero-filled) up front, so keep the default modest.
DEFAULT_CPU_KV_BYTES = 256 * 1024 * 1024
# On CUDA, the share of free memory (after weights) the KV pool takes when no budget is given.
CUDA_KV_MEMORY_FRACTION = 0.85
# Received KV transfers the worker holds at most, until steps write them into slots.
DEFAULT_TRANSFER_BUFFER_BYTES = 1 << 30
# A KV send's deadline: this floor plus the sender's bytes in flight at this rate (the defaults of
# data_plane/kv_transfer.py's TransferDeadline, repeated here so that flag parsing needs no torch).
DEFAULT_TRANSFER_DEADLINE_FLOOR_S = 15.0
DEFAULT_TRANSFER_DEADLINE_BYTES_PER_S = 50_000_000
# A received transfer no step claimed within this many seconds is released (kv_transfer.DEFAULT_HOLD_S).
DEFAULT_TRANSFER_HOLD_TIMEOUT_S = 300.0
DTYPES = ("auto", "float32", "bfloat16", "float16")
# Attention backends (data_plane/backends); named here so that flag parsing needs no torch.
BACKENDS = ("auto", "sdpa", "flashinfer")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """What one worker process runs with; nothing writes to it after start-up."""

    # HOST:PORT, A:P,B:P or dns:///NAME:PORT (protos/targets.py); checked by config_from_args.
    control: str = DEFAULT_CONTROL
    # A checkpoint directory, already resolved by the caller ("embedded" is the CLI's business).
    model: pathlib.Path = pathlib.Path(".")
    # "auto" picks cuda when available, else cpu.
    device: str = "auto"
    dtype: str = "auto"
    # Pool size in tokens; wins over kv_bytes when both are set.
    kv_tokens: int | None = None
    kv_bytes: int | None = None
    page_size: int = 1
    worker_id: str = ""
    # Tokens the host (offload) pool may hold; 0 disables offload/restore.
    host_pool_tokens: int = 0
    # Decode steps read a contiguous per-layer copy of the decode set's K/V (data_plane/decode_cache.py)
    # instead of gathering it from the pool; off: the general paged path (and no copy's memory).
    decode_cache: bool = True
    # data_plane/backends: auto (flashinfer on CUDA in 16-bit when installed, else sdpa), sdpa or flashinfer.
    attention_backend: str = "auto"
    # Bounds the first search only: once attached, the worker searches again forever when it loses
    # its control plane, waiting up to reconnect_max_backoff_s between searches.
    connect_timeout_s: float = 60.0
    reconnect_max_backoff_s: float = 5.0
    # After SIGTERM: how long the control plane may take to send Shutdown (the worker waits this
    # plus a grace period, then exits anyway).
    drain_timeout_s: float = 30.0
    # The gRPC health service (data_plane/health.py); port 0: none.
    health_port: int = 0
    health_host: str = "0.0.0.0"
    # "model" runs the checkpoint; "sim" is the cost-model simulator (data_plane/sim.py).
    backend: str = "model"
    # Sim backend step time a + b·new_tokens + c·context, in seconds.
    sim_cost: str = "0.005,0.00005,0.0000005"
    # TLS to the control plane: the CA that signed its certificate; this worker's own certificate
    # and key for mutual TLS; a name to verify instead of the dialled host.
    tls_ca: pathlib.Path | None = None
    tls_cert: pathlib.Path | None = None
    tls_key: pathlib.Path | None = None
    tls_server_name: str = ""
    # The KV transfer service (data_plane/kv_transfer.py): its port (0: a free one; -1: none), the
    # address it listens on, and the bytes of received transfers it holds at most.
    transfer_port: int = 0
    transfer_host: str = "127.0.0.1"
    transfer_buffer_bytes: int = DEFAULT_TRANSFER_BUFFER_BYTES
    # Each KV send fails past floor + bytes in flight / rate (docs/migration.md#deadlines-and-hung-peers).
    transfer_deadline_floor_s: float = DEFAULT_TRANSFER_DEADLINE_FLOOR_S
    transfer_deadline_bytes_per_s: float = DEFAULT_TRANSFER_DEADLINE_BYTES_PER_S
    # A received transfer unclaimed this long after it landed is released.
    transfer_hold_timeout_s: float = DEFAULT_TRANSFER_HOLD_TIMEOUT_S
    # What the control plane uses this worker for (protos/worker.py ROLES).
    role: str = "mixed"


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the worker's flags to `parser` (the `stepwise worker` subcommand calls this)."""
    parser.add_argument(
        "--control",
        default=DEFAULT_CONTROL,
        help="control plane worker port(s): HOST:PORT, a list A:P,B:P, or dns:///NAME:PORT; every name "
        "stands for all its addresses, and the worker attaches to the control plane with the fewest workers",
    )
    parser.add_argument("--model", required=True, type=pathlib.Path, help="checkpoint directory")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    parser.add_argument(
        "--dtype", default="auto", choices=DTYPES, help="auto: float32 on cpu, bfloat16 on cuda"
    )
    parser.add_argument(
        "--kv-tokens", type=Int(1, MAX_TOKENS), default=None, help="KV pool capacity in tokens"
    )
    parser.add_argument("--kv-bytes", type=Int(1, 2**50), default=None, help="KV pool budget in bytes")
    parser.add_argument(
        "--page-size",
        type=Int(1, 65536),
        default=1,
        help="tokens per KV page (reported to the control plane)",
    )
    parser.add_argument("--worker-id", default="", help="default: hostname-pid")
    parser.add_argument(
        "--host-pool-tokens", type=Int(0, MAX_TOKENS), default=0, help="host offload pool in tokens (0: none)"
    )
    parser.add_argument(
        "--disable-decode-cache",
        action="store_true",
        help="decode through the general paged attention path, without the contiguous decode K/V copy "
        "(CPU only: on CUDA the copy is always off)",
    )
    parser.add_argument(
        "--attention-backend",
        choices=BACKENDS,
        default="auto",
        help="attention kernels: sdpa (torch SDPA over gathered K/V; portable), flashinfer (FlashInfer's "
        "paged kernels; CUDA, float16/bfloat16, the 'flashinfer' extra); auto: flashinfer where it can run "
        "and is installed, else sdpa",
    )
    parser.add_argument(
        "--connect-timeout",
        type=seconds(0.01),
        default=60.0,
        help="seconds to look for a first control plane before giving up (exit 3); once attached, the "
        "worker looks again forever when it loses one",
    )
    parser.add_argument(
        "--reconnect-max-backoff",
        type=seconds(0.01),
        default=5.0,
        help="longest wait in seconds between searches for a control plane (the wait doubles from 0.1 s)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=seconds(),
        default=30.0,
        help="after SIGTERM, seconds to keep running plans until the control plane sends Shutdown "
        "(plus 10 s of grace; then the worker exits anyway)",
    )
    parser.add_argument(
        "--health-port",
        type=PORT,
        default=0,
        help="gRPC health service port (0: none): '' is SERVING once the model is loaded, "
        "'stepwise.v1.WorkerLink' while attached to a control plane and not draining",
    )
    parser.add_argument("--health-host", default="0.0.0.0", help="address the health service listens on")
    parser.add_argument(
        "--backend", choices=("model", "sim"), default="model", help="sim: a simulator without a model"
    )
    parser.add_argument(
        "--sim-cost",
        default="0.005,0.00005,0.0000005",
        help="sim step time a,b,c[,d]: a + b·new tokens + c·context + d·decode rows (seconds)",
    )
    parser.add_argument(
        "--tls-ca", type=pathlib.Path, default=None, help="PEM CA of the control plane's certificate (TLS)"
    )
    parser.add_argument(
        "--tls-cert", type=pathlib.Path, default=None, help="PEM certificate of this worker (mutual TLS)"
    )
    parser.add_argument("--tls-key", type=pathlib.Path, default=None, help="PEM private key of --tls-cert")
    parser.add_argument(
        "--tls-server-name",
        default="",
        help="name the control plane's certificate carries, if not the host",
    )
    parser.add_argument(
        "--role",
        choices=ROLES,
        default="mixed",
        help="mixed: prefills and decodes; prefill: takes new requests and hands each to a decode "
        "worker with its KV after its first token; decode: decodes what prefill workers hand over "
        "(prefill and decode need the KV transfer link)",
    )
    parser.add_argument(
        "--transfer-port",
        type=Int(-1, 65535),
        default=0,
        help="port of the worker-to-worker KV transfer service (0: a free port, -1: none); mutual TLS "
        "with --tls-ca/--tls-cert/--tls-key when given (without --tls-cert: none)",
    )
    parser.add_argument(
        "--transfer-host",
        default="127.0.0.1",
        help="address the KV transfer service listens on; the worker announces it in its hello "
        "(0.0.0.0 or ::: announced as this machine's host name)",
    )
    parser.add_argument(
        "--transfer-buffer-bytes",
        type=Int(0, 2**50),
        default=DEFAULT_TRANSFER_BUFFER_BYTES,
        help="received KV transfers held at most, in bytes; a transfer that does not fit is refused",
    )
    parser.add_argument(
        "--transfer-deadline-floor",
        type=seconds(0.01),
        default=DEFAULT_TRANSFER_DEADLINE_FLOOR_S,
        help="a KV send fails (and the request stays on, or falls back to, its source) when it has not "
        "completed within this many seconds plus its bytes and those in flight with it at "
        "--transfer-deadline-bytes-per-s; keep it under the control plane's --worker-step-timeout",
    )
    parser.add_argument(
        "--transfer-deadline-bytes-per-s",
        type=Float(1.0, 1e15),
        default=DEFAULT_TRANSFER_DEADLINE_BYTES_PER_S,
        help="the slowest rate, in bytes per second, a KV send's deadline allows for (see "
        "--transfer-deadline-floor)",
    )
    parser.add_argument(
        "--transfer-hold-timeout",
        type=seconds(0.01),
        default=DEFAULT_TRANSFER_HOLD_TIMEOUT_S,
        help="seconds a received KV transfer is held for the step that writes it; one unclaimed by then "
        "is released (a step claims one within a step or two: keep it well above the control plane's "
        "--worker-step-timeout)",
    )


def config_from_args(ns: argparse.Namespace) -> WorkerConfig:
    """Build the frozen config from parsed flags (each value already in its flag's range); ValueError
    for flags that cannot work together, or a --control that is not a target."""
    _check_tls(ns)
    parse_targets(ns.control, "--control")  # ValueError naming --control
    if ns.backend == "sim":
        from data_plane.sim import CostModel

        CostModel.parse(ns.sim_cost)  # ValueError naming --sim-cost, now rather than at the first step
    if ns.role != "mixed" and ns.transfer_port < 0:
        raise ValueError(
            f"--role {ns.role} moves requests with their KV: it needs the KV transfer link, which "
            "--transfer-port -1 turns off"
        )
    return WorkerConfig(
        control=ns.control,
        model=pathlib.Path(ns.model),
        device=ns.device,
        dtype=ns.dtype,
        kv_tokens=ns.kv_tokens,
        kv_bytes=ns.kv_bytes,
        page_size=ns.page_size,
        worker_id=ns.worker_id or default_worker_id(),
        host_pool_tokens=ns.host_pool_tokens,
        decode_cache=not ns.disable_decode_cache,
        attention_backend=ns.attention_backend,
        connect_timeout_s=ns.connect_timeout,
        reconnect_max_backoff_s=ns.reconnect_max_backoff,
        drain_timeout_s=ns.drain_timeout,
        health_port=ns.health_port,
        health_host=ns.health_host,
        backend=ns.backend,
        sim_cost=ns.sim_cost,
        tls_ca=ns.tls_ca,
        tls_cert=ns.tls_cert,
        tls_key=ns.tls_key,
        tls_server_name=ns.tls_server_name,
        transfer_port=ns.transfer_port,
        role=ns.role,
        transfer_host=ns.transfer_host,
        transfer_buffer_bytes=ns.transfer_buffer_bytes,
        transfer_deadline_floor_s=ns.transfer_deadline_floor,
        transfer_deadline_bytes_per_s=ns.transfer_deadline_bytes_per_s,
        transfer_hold_timeout_s=ns.transfer_hold_timeout,
    )


def _check_tls(ns: argparse.Namespace) -> None:
    if (ns.tls_cert is None) != (ns.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if ns.tls_cert is not None and ns.tls_ca is None:
        raise ValueError("--tls-cert needs --tls-ca (the CA that signed the control plane's certificate)")
    for flag, path in (("--tls-ca", ns.tls_ca), ("--tls-cert", ns.tls_cert), ("--tls-key", ns.tls_key)):
        if path is not None and not pathlib.Path(path).is_file():
            raise ValueError(f"{flag}: no such file: {path}")
