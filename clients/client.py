"""Async client library for the Generation service."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.wakeups import read_in_bulk
from flagtypes import seconds
from flagtypes.table import Flag, Flags
from protos.stepwise.v1 import generation_pb2 as gen_pb
from protos.stepwise.v1 import generation_pb2_grpc as gen_grpc
from protos.targets import parse_targets

FINISH_NAMES = {
    gen_pb.FINISH_REASON_STOP: "stop",
    gen_pb.FINISH_REASON_LENGTH: "length",
    gen_pb.FINISH_REASON_ABORT: "abort",
    gen_pb.FINISH_REASON_GRAMMAR_UNSATISFIABLE: "grammar_unsatisfiable",
}


@dataclass(slots=True)
class Generation:
    """A finished generation, collected from the stream."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    finish_message: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    queue_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0
    # One per token when the request asked for log probabilities.
    logprobs: list[gen_pb.TokenLogprob] = field(default_factory=list)
    # The prompt's, when logprob_start_len was set (sample 0 of a call hears them).
    prompt_logprobs: gen_pb.PromptLogprobs | None = None


def sampling_params(
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    seed: int | None = None,
    repetition_penalty: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    n: int | None = None,
    min_new_tokens: int | None = None,
    logit_bias: Mapping[int, float] | None = None,
    logprobs: bool = False,
    top_logprobs: int | None = None,
    token_ids_logprob: Sequence[int] = (),
    logprob_start_len: int | None = None,
    json_schema: str | Mapping[str, object] | None = None,
    regex: str | None = None,
    ebnf: str | None = None,
    lark: str | None = None,
    structural_tag: str | Mapping[str, object] | None = None,
    choice: Sequence[str] | None = None,
) -> gen_pb.SamplingParams:
    """Build SamplingParams, leaving unset what the caller did not give (server defaults apply).

    At most one constraint (json_schema, regex, ebnf, lark, structural_tag, choice); a schema or
    structural tag may be given as a dict, sent as JSON text. ValueError when more than one is."""
    msg = gen_pb.SamplingParams(
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        logit_bias=logit_bias,
        logprobs=logprobs,
        token_ids_logprob=list(token_ids_logprob),
    )
    optional = {
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "seed": seed,
        "repetition_penalty": repetition_penalty,
        "frequency_penalty": frequency_penalty,
        "presence_penalty": presence_penalty,
        "n": n,
        "min_new_tokens": min_new_tokens,
        "top_logprobs": top_logprobs,
        "logprob_start_len": logprob_start_len,
    }
    for name, value in optional.items():
        if value is not None:
            setattr(msg, name, value)
    constraints: dict[str, object] = {
        "json_schema": json_schema,
        "regex": regex,
        "ebnf": ebnf,
        "lark": lark,
        "structural_tag": structural_tag,
        "choice": choice,
    }
    given = [key for key, held in constraints.items() if held is not None]
    if len(given) > 1:
        raise ValueError(f"at most one constraint may be given, got {', '.join(given)}")
    if given:
        key, held = given[0], constraints[given[0]]
        if key == "choice":
            msg.choice.choices.extend(held)  # type: ignore[arg-type]
        else:
            setattr(msg, key, held if isinstance(held, str) else json.dumps(held))
    return msg


def generate_request(
    prompt: str | Sequence[int],
    sampling: gen_pb.SamplingParams | None = None,
    request_id: str = "",
    routing_key: str = "",
    priority: int | None = None,
    *,
    tenant: str = "",
    ttft_slo_ms: float = 0.0,
    tpot_slo_ms: float = 0.0,
) -> gen_pb.GenerateRequest:
    req = gen_pb.GenerateRequest(
        request_id=request_id,
        routing_key=routing_key,
        sampling=sampling,
        tenant=tenant,
        ttft_slo_ms=ttft_slo_ms,
        tpot_slo_ms=tpot_slo_ms,
    )
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.input_ids.ids.extend(prompt)
    if priority is not None:
        req.priority = priority
    return req


# Answers that waiting or retrying cannot change: wait_ready raises them at once.
REFUSED_AUTH = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
PEM_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"


class NotServingError(TimeoutError):
    """Nothing at `address` answered SERVING within the wait; `last` says what the last check saw."""

    def __init__(self, address: str, waited_s: float, last: str) -> None:
        super().__init__(f"no control plane serving at {address} (waited {waited_s:g} s; {last})")
        self.address, self.waited_s, self.last = address, waited_s, last


# Targets that name several control planes: calls are spread over them (gRPC's round_robin), and a
# Generate refused with UNAVAILABLE before any response (a draining control plane, one without a
# worker yet) is tried again on the next one. Such a call did nothing, so trying again is safe.
_SPREAD_SERVICE_CONFIG = json.dumps(
    {
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [
            {
                "name": [{"service": "stepwise.v1.Generation"}],
                "retryPolicy": {
                    "maxAttempts": 3,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "0.5s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ],
    }
)


def channel_target(address: str) -> tuple[str, list[tuple[str, Any]]]:
    """The gRPC target and channel options for `address`.

    `HOST:PORT` is one control plane. `dns:///NAME:PORT` (every address the name resolves to, e.g. a
    headless Kubernetes Service), `ipv4:A:P,B:P` and a comma list of IP addresses `A:P,B:P` spread
    calls over several. ValueError for a comma list naming a host: use `dns:///NAME:PORT` for that.
    """
    options: list[tuple[str, Any]] = [("grpc.service_config", _SPREAD_SERVICE_CONFIG)]
    if address.startswith(("dns:", "ipv4:", "ipv6:")):
        return address, options
    if "," not in address:
        return address, []
    endpoints = parse_targets(address, "--address")  # the rule --control and --peers follow
    families = {_ip_family(e.host) for e in endpoints}
    if families == {4}:
        return "ipv4:" + ",".join(f"{e.host}:{e.port}" for e in endpoints), options
    if families == {6}:
        return "ipv6:" + ",".join(f"[{e.host}]:{e.port}" for e in endpoints), options
    raise ValueError(
        f"{address!r}: a comma list must name IP addresses of one family (HOST:PORT,...); "
        "for a host name that resolves to several control planes use dns:///NAME:PORT"
    )


def _ip_family(host: str) -> int:
    try:
        return ipaddress.ip_address(host).version
    except ValueError:
        return 0


def open_channel(
    address: str, *, api_key: str | None = None, tls_ca: str | Path | None = None
) -> grpc.aio.Channel:
    """A channel to `address` (see `channel_target`): TLS checked against the CA in the PEM file
    `tls_ca`, else plaintext.

    On a TLS channel `api_key` rides along as call credentials (`authorization: Bearer KEY` on every
    call); on a plaintext one gRPC refuses call credentials, and the caller must send
    `bearer_metadata(api_key)` itself. OSError when `tls_ca` cannot be read.
    """
    target, options = channel_target(address)
    if tls_ca is None:
        channel = grpc.aio.insecure_channel(target, options=options)
    else:
        credentials = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
        if api_key:
            credentials = grpc.composite_channel_credentials(
                credentials, grpc.access_token_call_credentials(api_key)
            )
        channel = grpc.aio.secure_channel(target, credentials, options=options)
    # A client with many streams would otherwise get its messages behind gRPC's wake-ups (wakeups.py).
    with contextlib.suppress(RuntimeError):
        read_in_bulk(asyncio.get_running_loop())
    return channel


def bearer_metadata(api_key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),)


class StepwiseClient:
    """`async with StepwiseClient("127.0.0.1:50051") as client: ...`

    `tls_ca`: a PEM file with the CA that signed the control plane's certificate; the channel is
    TLS when given, plaintext otherwise (OSError when it cannot be read). `api_key`: every call
    (Generate, Abort, GetServerInfo and the health check) carries `authorization: Bearer API_KEY`.
    """

    def __init__(self, address: str, *, api_key: str | None = None, tls_ca: str | Path | None = None) -> None:
        self.address = address
        self.channel = open_channel(address, api_key=api_key, tls_ca=tls_ca)
        # With TLS the channel's call credentials carry the key; plaintext needs it per call.
        self.metadata = bearer_metadata(api_key) if api_key and tls_ca is None else None
        self.stub = gen_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def __aenter__(self) -> StepwiseClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close(None)

    async def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait until health says SERVING (a worker is attached).

        NotServingError (a TimeoutError) after `timeout` seconds. A check the server refuses
        (UNAUTHENTICATED, PERMISSION_DENIED) raises its AioRpcError at once: waiting cannot fix it.
        """
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            seen = await self._check(max(0.1, min(2.0, deadline - time.monotonic())))
            if seen is None:
                return
            # A check cut short by the deadline says less than the failure before it (a refused TLS
            # handshake, a refused connection): keep that one for the message.
            if not last or not seen.startswith(grpc.StatusCode.DEADLINE_EXCEEDED.name):
                last = seen
            if time.monotonic() > deadline:
                raise NotServingError(self.address, timeout, last)
            await asyncio.sleep(0.1)

    async def _check(self, timeout: float) -> str | None:
        """None when the server is SERVING; otherwise what it answered, for NotServingError."""
        request = health_pb2.HealthCheckRequest(service="")
        try:
            reply = await self.health.Check(request, timeout=timeout, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in REFUSED_AUTH:
                raise
            return f"{exc.code().name}: {exc.details()}"
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            return None
        return "it answers NOT_SERVING: no worker attached yet"

    def stream(
        self, request: gen_pb.GenerateRequest, *, api_key: str | None = None
    ) -> AsyncIterator[gen_pb.GenerateResponse]:
        """The raw response stream (cancel it to abort the request).

        `api_key`: this call's bearer token instead of the client's own (a gateway forwarding its
        callers' keys over one shared channel).
        """
        metadata = bearer_metadata(api_key) if api_key else self.metadata
        return self.stub.Generate(request, metadata=metadata)  # type: ignore[no-any-return]

    async def generate(
        self,
        prompt: str | Sequence[int],
        request_id: str = "",
        routing_key: str = "",
        priority: int | None = None,
        **sampling: Any,
    ) -> Generation:
        """Run one generation to the end and collect it; `sampling` takes sampling_params()'s arguments."""
        request = generate_request(prompt, sampling_params(**sampling), request_id, routing_key, priority)
        return await collect(self.stream(request))

    async def generate_samples(
        self, prompt: str | Sequence[int], n: int, request_id: str = "", **sampling: Any
    ) -> list[Generation]:
        """n parallel samples of one prompt (one Generate call); returned in index order."""
        request = generate_request(prompt, sampling_params(n=n, **sampling), request_id)
        gens = [Generation() for _ in range(n)]
        async for response in self.stream(request):
            kind = response.WhichOneof("event")
            index = 0 if kind == "prompt_logprobs" else getattr(response, kind).index
            apply_response(gens[index], response)
        return gens

    async def abort(self, request_id: str) -> bool:
        reply = await self.stub.Abort(gen_pb.AbortRequest(request_id=request_id), metadata=self.metadata)
        return bool(reply.found)

    async def server_info(
        self, *, api_key: str | None = None, timeout: float | None = None
    ) -> gen_pb.ServerInfo:
        metadata = bearer_metadata(api_key) if api_key else self.metadata
        return await self.stub.GetServerInfo(
            gen_pb.GetServerInfoRequest(), metadata=metadata, timeout=timeout
        )


def apply_response(gen: Generation, response: gen_pb.GenerateResponse) -> None:
    gen.request_id = response.request_id
    kind = response.WhichOneof("event")
    if kind == "chunk":
        gen.token_ids.extend(response.chunk.token_ids)
        gen.text += response.chunk.text
        gen.logprobs.extend(response.chunk.logprobs)
        return
    if kind == "prompt_logprobs":
        gen.prompt_logprobs = response.prompt_logprobs
        return
    fin = response.finished
    gen.finish_reason = FINISH_NAMES.get(fin.reason, "unspecified")
    gen.finish_message = fin.message
    gen.prompt_tokens = fin.usage.prompt_tokens
    gen.cached_tokens = fin.usage.cached_tokens
    gen.completion_tokens = fin.usage.completion_tokens
    gen.queue_s, gen.ttft_s, gen.total_s = fin.timings.queue_s, fin.timings.ttft_s, fin.timings.total_s


async def collect(stream: AsyncIterator[gen_pb.GenerateResponse]) -> Generation:
    gen = Generation()
    async for response in stream:
        apply_response(gen, response)
    return gen


# --- command line (`stepwise generate`, `stepwise bench`) -------------------------------------------


def client_address(text: str) -> str:
    """argparse type: an address `channel_target` accepts."""
    try:
        channel_target(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def pem_file(text: str) -> Path:
    """argparse type: a readable file holding a PEM certificate; ArgumentTypeError otherwise."""
    path = Path(text).expanduser()
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror or exc}") from None
    if PEM_CERTIFICATE not in data:
        raise argparse.ArgumentTypeError(f"{path} holds no PEM certificate")
    return path


# --tls-ca PATH: the PEM CA that signed the control plane's certificate (checked when parsed).
TLS_CA_FLAGS = Flags(
    None,
    (
        Flag(
            "--tls-ca",
            pem_file,
            metavar="PATH",
            help="CA certificate (PEM) that signed the control plane's certificate; turns on TLS",
        ),
    ),
)
# How a command reaches the control plane.
CONNECTION_FLAGS = Flags(
    None,
    (
        Flag(
            "--address",
            client_address,
            default="127.0.0.1:50051",
            help="control plane client address HOST:PORT; dns:///NAME:PORT or A:P,B:P spread calls over "
            "several control planes",
        ),
        Flag("--api-key", help="bearer token; also STEPWISE_API_KEY"),
        *TLS_CA_FLAGS.flags,
        Flag("--wait", seconds(), default=30.0, help="seconds to wait for a serving control plane"),
    ),
)


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --address, --api-key, --tls-ca and --wait: how a command reaches the control plane."""
    CONNECTION_FLAGS.add_to(parser)


def add_tls_ca_argument(parser: argparse.ArgumentParser) -> None:
    TLS_CA_FLAGS.add_to(parser)


def client_from_args(ns: argparse.Namespace) -> StepwiseClient:
    """The client add_connection_arguments' flags describe (namespaces built by hand may omit the
    --api-key and --tls-ca attributes: plaintext, no key)."""
    return StepwiseClient(
        ns.address, api_key=getattr(ns, "api_key", None), tls_ca=getattr(ns, "tls_ca", None)
    )
