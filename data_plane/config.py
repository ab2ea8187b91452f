"""Worker configuration: one frozen object built from flags at the entry point."""

from __future__ import annotations

import argparse
import operator
import os
import pathlib
import socket
from dataclasses import dataclass

from flagtypes import MAX_TOKENS, PORT, Float, Int, seconds
from flagtypes.table import SWITCH, Flag, Flags
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


def _worker_id(given: str) -> str:
    return given or default_worker_id()


# The worker's flags, in --help's order: each sets the WorkerConfig field of its name (or the one named).
FLAGS = Flags(
    WorkerConfig,
    (
        Flag(
            "--control",
            help="control plane worker port(s): HOST:PORT, a list A:P,B:P, or dns:///NAME:PORT; every name "
            "stands for all its addresses, and the worker attaches to the control plane with the fewest "
            "workers",
        ),
        Flag("--model", pathlib.Path, required=True, field=None, help="checkpoint directory"),
        Flag("--device", help="cpu, cuda, cuda:N or auto"),
        Flag("--dtype", choices=DTYPES, help="auto: float32 on cpu, bfloat16 on cuda"),
        Flag("--kv-tokens", Int(1, MAX_TOKENS), help="KV pool capacity in tokens"),
        Flag("--kv-bytes", Int(1, 2**50), help="KV pool budget in bytes"),
        Flag("--page-size", Int(1, 65536), help="tokens per KV page (reported to the control plane)"),
        Flag("--worker-id", to=_worker_id, help="default: hostname-pid"),
        Flag("--host-pool-tokens", Int(0, MAX_TOKENS), help="host offload pool in tokens (0: none)"),
        Flag(
            "--disable-decode-cache",
            SWITCH,
            field="decode_cache",
            to=operator.not_,
            help="decode through the general paged attention path, without the contiguous decode K/V copy "
            "(CPU only: on CUDA the copy is always off)",
        ),
        Flag(
            "--attention-backend",
            choices=BACKENDS,
            help="attention kernels: sdpa (torch SDPA over gathered K/V; portable), flashinfer (FlashInfer's "
            "paged kernels; CUDA, float16/bfloat16, the 'flashinfer' extra); auto: flashinfer where it can "
            "run and is installed, else sdpa",
        ),
        Flag(
            "--connect-timeout",
            seconds(0.01),
            field="connect_timeout_s",
            help="seconds to look for a first control plane before giving up (exit 3); once attached, the "
            "worker looks again forever when it loses one",
        ),
        Flag(
            "--reconnect-max-backoff",
            seconds(0.01),
            field="reconnect_max_backoff_s",
            help="longest wait in seconds between searches for a control plane (the wait doubles from 0.1 s)",
        ),
        Flag(
            "--drain-timeout",
            seconds(),
            field="drain_timeout_s",
            help="after SIGTERM, seconds to keep running plans until the control plane sends Shutdown "
            "(plus 10 s of grace; then the worker exits anyway)",
        ),
        Flag(
            "--health-port",
            PORT,
            help="gRPC health service port (0: none): '' is SERVING once the model is loaded, "
            "'stepwise.v1.WorkerLink' while attached to a control plane and not draining",
        ),
        Flag("--health-host", help="address the health service listens on"),
        Flag("--backend", choices=("model", "sim"), help="sim: a simulator without a model"),
        Flag(
            "--sim-cost",
            help="sim step time a,b,c[,d]: a + b·new tokens + c·context + d·decode rows (seconds)",
        ),
        Flag("--tls-ca", pathlib.Path, help="PEM CA of the control plane's certificate (TLS)"),
        Flag("--tls-cert", pathlib.Path, help="PEM certificate of this worker (mutual TLS)"),
        Flag("--tls-key", pathlib.Path, help="PEM private key of --tls-cert"),
        Flag("--tls-server-name", help="name the control plane's certificate carries, if not the host"),
        Flag(
            "--role",
            choices=ROLES,
            help="mixed: prefills and decodes; prefill: takes new requests and hands each to a decode "
            "worker with its KV after its first token; decode: decodes what prefill workers hand over "
            "(prefill and decode need the KV transfer link)",
        ),
        Flag(
            "--transfer-port",
            Int(-1, 65535),
            help="port of the worker-to-worker KV transfer service (0: a free port, -1: none); mutual TLS "
            "with --tls-ca/--tls-cert/--tls-key when given (without --tls-cert: none)",
        ),
        Flag(
            "--transfer-host",
            help="address the KV transfer service listens on; the worker announces it in its hello "
            "(0.0.0.0 or ::: announced as this machine's host name)",
        ),
        Flag(
            "--transfer-buffer-bytes",
            Int(0, 2**50),
            help="received KV transfers held at most, in bytes; a transfer that does not fit is refused",
        ),
        Flag(
            "--transfer-deadline-floor",
            seconds(0.01),
            field="transfer_deadline_floor_s",
            help="a KV send fails (and the request stays on, or falls back to, its source) when it has not "
            "completed within this many seconds plus its bytes and those in flight with it at "
            "--transfer-deadline-bytes-per-s; keep it under the control plane's --worker-step-timeout",
        ),
        Flag(
            "--transfer-deadline-bytes-per-s",
            Float(1.0, 1e15),
            help="the slowest rate, in bytes per second, a KV send's deadline allows for (see "
            "--transfer-deadline-floor)",
        ),
        Flag(
            "--transfer-hold-timeout",
            seconds(0.01),
            field="transfer_hold_timeout_s",
            help="seconds a received KV transfer is held for the step that writes it; one unclaimed by then "
            "is released (a step claims one within a step or two: keep it well above the control plane's "
            "--worker-step-timeout)",
        ),
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the worker's flags (FLAGS) to `parser` (the `stepwise worker` subcommand calls this)."""
    FLAGS.add_to(parser)


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
    return WorkerConfig(model=pathlib.Path(ns.model), **FLAGS.values(ns))  # type: ignore[arg-type]


def _check_tls(ns: argparse.Namespace) -> None:
    if (ns.tls_cert is None) != (ns.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if ns.tls_cert is not None and ns.tls_ca is None:
        raise ValueError("--tls-cert needs --tls-ca (the CA that signed the control plane's certificate)")
    for flag, path in (("--tls-ca", ns.tls_ca), ("--tls-cert", ns.tls_cert), ("--tls-key", ns.tls_key)):
        if path is not None and not pathlib.Path(path).is_file():
            raise ValueError(f"{flag}: no such file: {path}")
