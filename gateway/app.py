"""The FastAPI application: OpenAI endpoints translated into Generate calls on one shared channel.

Each caller's `Authorization: Bearer KEY` is forwarded on its own gRPC call, so the control plane
decides who may generate, exactly as for a direct gRPC client. A streaming client that goes away
cancels its gRPC call, which aborts the request and frees its KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import orjson
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from grpc_health.v1 import health_pb2
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from clients.client import StepwiseClient, generate_request
from gateway import sglang_info
from gateway.auth import KeyCheck
from gateway.chat import ChatTemplate
from gateway.errors import GatewayError, from_grpc, invalid
from gateway.formats import ChatFormat, Collected, CompletionFormat, Echo, Event, ResponseFormat
from gateway.limits import HttpLimits, discard_body, read_body
from gateway.metrics import GatewayMetrics
from gateway.schemas import ChatCompletionRequest, CompletionRequest, M, SamplingFields, parse_body
from gateway.sglang import PARAMS as SGLANG_PARAMS
from gateway.sglang import GenerateBody, SglangFormat
from gateway.text import utf8_text
from gateway.tokens import DetokenizeRequest, TokenCodec, TokenizeRequest
from gateway.tools import ParserName, check_renders_tools, default_parser
from protos.stepwise.v1 import generation_pb2 as gen_pb

HEALTH_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """`control`: HOST:PORT or any gRPC target (`dns:///NAME:PORT`), passed to the channel as is."""

    control: str
    model_name: str
    template: ChatTemplate | None = None
    tls_ca: Path | None = None
    limits: HttpLimits = field(default_factory=HttpLimits)
    # The model's tokenizer (the control plane's own class, loaded from the same --model): for
    # /tokenize, /detokenize, echoing token-id prompts and SGLang's default prompt logprob.
    tokenizer: TokenCodec | None = None
    # How tool_choice auto reads calls from the text (--tool-call-parser); None: the format the
    # chat template teaches (gateway/tools.py, default_parser).
    tool_call_parser: ParserName | None = None
    # More names the model answers to (--served-model-name's after the first); `model_name` is the
    # one the gateway reports.
    model_aliases: tuple[str, ...] = ()

    @property
    def served_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.model_aliases)

    def parser(self) -> ParserName:
        if self.tool_call_parser is not None:
            return self.tool_call_parser
        return default_parser(self.template.source) if self.template is not None else "hermes"


def create_app(config: GatewayConfig) -> FastAPI:
    """The gateway's application; its gRPC channel opens with the app's lifespan."""
    gateway = Gateway(config)
    app = FastAPI(title="Stepwise gateway", lifespan=gateway.lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gateway
    app.add_api_route("/v1/completions", gateway.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", gateway.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", gateway.models, methods=["GET"])
    app.add_api_route("/tokenize", gateway.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", gateway.detokenize, methods=["POST"])
    app.add_api_route("/version", gateway.version, methods=["GET"])
    app.add_api_route("/generate", gateway.sglang_generate, methods=["POST"])
    app.add_api_route("/get_model_info", gateway.sglang_model_info, methods=["GET"])
    app.add_api_route("/get_server_info", gateway.sglang_server_info, methods=["GET"])
    app.add_api_route("/health_generate", gateway.health_generate, methods=["GET"])
    app.add_api_route("/flush_cache", gateway.flush_cache, methods=["GET", "POST"])
    # A served name may hold slashes (a Hub id, `acme/tiny`): the id is the rest of the path.
    app.add_api_route("/v1/models/{model_id:path}", gateway.model, methods=["GET"])
    app.add_api_route("/health", gateway.health, methods=["GET"])
    app.add_api_route("/metrics", gateway.metrics_endpoint, methods=["GET"])
    app.add_exception_handler(HTTPException, _http_error)
    return app


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (unknown path, wrong method) in OpenAI's error shape."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    return error_response(GatewayError(status, f"{request.method} {request.url.path}: {exc}"))


def error_response(error: GatewayError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


def bearer_key(request: Request) -> str | None:
    """The caller's API key from `Authorization: Bearer KEY`, forwarded to the control plane.

    A 401 for a key gRPC metadata cannot carry (printable ASCII only): no control plane holds it."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        return None
    if not (key.isascii() and key.isprintable()):
        message = "Authorization: the bearer token must be printable ASCII"
        raise GatewayError(401, message, code="invalid_api_key")
    return key


TENANT_HEADER = "x-stepwise-tenant"


def tenant_header(request: Request) -> str | None:
    """The tenant the caller names in `X-Stepwise-Tenant` (it takes precedence over the body's
    `tenant` and `user`); the control plane decides whether the caller's key may name it."""
    value = request.headers.get(TENANT_HEADER)
    return value.strip() if value is not None and value.strip() else None


SSE_DONE = b"data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> bytes:
    """One server-sent event, compact JSON in UTF-8. orjson takes about a tenth of json's time per
    event; what it refuses (a key that is not a string, an integer past 64 bits) json writes."""
    try:
        body = orjson.dumps(data)
    except orjson.JSONEncodeError:
        body = json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()
    return b"data: " + body + b"\n\n"


class Gateway:
    """The endpoints and what they share: the channel, the chat template, the metrics."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.metrics = GatewayMetrics()
        self.created = int(time.time())
        self._client: StepwiseClient | None = None
        self.keys = KeyCheck(lambda key, timeout: self.client.server_info(api_key=key, timeout=timeout))

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        # A grpc.aio channel belongs to the event loop it was made in: make it in the server's.
        self._client = StepwiseClient(self.config.control, tls_ca=self.config.tls_ca)
        try:
            yield
        finally:
            await self._client.close()

    @property
    def client(self) -> StepwiseClient:
        assert self._client is not None, "the gateway's lifespan has not started"
        return self._client

    # --- endpoints ------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        started = time.monotonic()
        try:
            body = await self._body(request, CompletionRequest)
            self._check_model(body.model)
            body.refuse_unsupported()
            prompts = body.prompts()
            echo = None
            if body.echo:
                if body.logprobs is None and any(isinstance(p, list) for p in prompts):
                    self._codec("echo")  # a token-id prompt's text is decoded here
                texts = [p if isinstance(p, str) else None for p in prompts]
                echo = Echo(texts, prompts, self._decode_prompt)
            fmt = CompletionFormat(self._model(body), body.include_usage(), body.wants_logprobs(), echo)
            fmt.prompt_counts = await self._prompt_counts(body, prompts)
            requests = self._requests(body, prompts, fmt.id)
            # The protocol's names for what completions call `logprobs` and `echo`.
            renames = {"top_logprobs": "logprobs", "logprob_start_len": "echo", **body.renames()}
            return await self._generate(
                request, requests, body.n, body.stream, fmt, "completions", started, renames
            )
        except GatewayError as exc:
            return self._refused("completions", exc, started)

    async def chat_completions(self, request: Request) -> Response:
        started = time.monotonic()
        try:
            body = await self._body(request, ChatCompletionRequest)
            self._check_model(body.model)
            body.refuse_unsupported(self.config.parser())
            prompt = self.render_chat(body)
            fmt = ChatFormat(self._model(body), body.include_usage(), body.wants_logprobs(), body.tool_plan)
            fmt.prompt_counts = await self._prompt_counts(body, [prompt])
            requests = self._requests(body, [prompt], fmt.id)
            return await self._generate(
                request, requests, body.n, body.stream, fmt, "chat_completions", started, body.renames()
            )
        except GatewayError as exc:
            return self._refused("chat_completions", exc, started)

    async def sglang_generate(self, request: Request) -> Response:
        """SGLang's native `/generate`: text or token ids (one or a batch), SGLang's sampling names,
        its `meta_info` and log probability shapes."""
        started = time.monotonic()
        try:
            body = await self._body(request, GenerateBody)
            body.refuse_unsupported()
            prompts = body.prompts()
            tokenizer = self.config.tokenizer
            if body.needs_tokenizer(prompts):
                tokenizer = self._codec("return_logprob")
            prompt_ids = None
            if tokenizer is not None and (body.stream or body.needs_tokenizer(prompts)):
                prompt_ids = await asyncio.to_thread(_encode_all, tokenizer, prompts)
            fmt = SglangFormat(body, prompts, tokenizer, prompt_ids)
            requests = body.grpc_requests(prompts, fmt.rids)
            renames = {
                **SGLANG_PARAMS,
                "prompt": "text" if body.text is not None else "input_ids",
                **body.sampling_params.renames(),
            }
            return await self._generate(
                request, requests, body.n(), body.stream, fmt, "generate", started, renames
            )
        except GatewayError as exc:
            return self._refused("generate", exc, started)

    async def sglang_model_info(self) -> Response:
        """SGLang's `/get_model_info`, which `sgl.RuntimeEndpoint` asks first."""
        self.metrics.observe("get_model_info", 200, 0.0)
        return JSONResponse(sglang_info.model_info(self.config.model_name))

    async def sglang_server_info(self, request: Request) -> Response:
        """SGLang's `/get_server_info`: the control plane's ServerInfo in SGLang's names."""
        started = time.monotonic()
        try:
            info = await self._server_info(request)
        except GatewayError as exc:
            return self._refused("get_server_info", exc, started)
        self.metrics.observe("get_server_info", 200, time.monotonic() - started)
        return JSONResponse(sglang_info.server_info(self.config.model_name, info))

    async def health_generate(self, request: Request) -> Response:
        """SGLang's `/health_generate`: 200 once one token has been generated end to end, else 503."""
        started = time.monotonic()
        sampling = gen_pb.SamplingParams(max_new_tokens=1, temperature=0.0)
        one = generate_request(sglang_info.HEALTH_GENERATE_PROMPT, sampling, f"health-{uuid.uuid4().hex}")
        call = self.client.stream(one, api_key=bearer_key(request))
        try:
            await asyncio.wait_for(_drain(call), sglang_info.HEALTH_GENERATE_TIMEOUT_S)
        except (grpc.aio.AioRpcError, GatewayError, TimeoutError) as exc:
            _cancel(call)  # past the deadline: the control plane aborts the request
            detail = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__
            error = GatewayError(503, f"health_generate: no token generated ({detail})")
            return self._refused("health_generate", error, started)
        self.metrics.observe("health_generate", 200, time.monotonic() - started)
        return Response(status_code=200)

    async def flush_cache(self) -> Response:
        return self._refused("flush_cache", sglang_info.flush_cache_refusal(), time.monotonic())

    async def tokenize(self, request: Request) -> Response:
        """vLLM's `/tokenize`: a prompt's token ids, or those of messages rendered by the chat
        template, as the control plane makes them."""
        started = time.monotonic()
        try:
            body = await self._body(request, TokenizeRequest)
            body.refuse_unsupported()
            codec = self._codec("prompt" if body.prompt is not None else "messages")
            if body.prompt is not None:
                text = body.prompt
            else:
                chat = ChatCompletionRequest(
                    messages=body.messages or [], add_generation_prompt=body.add_generation_prompt
                )
                text = self.render_chat(chat)
            tokens = await asyncio.to_thread(codec.encode, text)  # megabytes of text take a while
            info = await self._server_info(request)
        except GatewayError as exc:
            return self._refused("tokenize", exc, started)
        self.metrics.observe("tokenize", 200, time.monotonic() - started)
        return JSONResponse({"count": len(tokens), "max_model_len": info.max_context, "tokens": tokens})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's `/detokenize`: the text of token ids, special tokens kept."""
        started = time.monotonic()
        try:
            body = await self._body(request, DetokenizeRequest)
            body.refuse_unsupported()
            codec = self._codec("tokens")
            body.check_vocabulary(codec.vocab_size)
            text = codec.decode(body.tokens, skip_special_tokens=False)
        except GatewayError as exc:
            return self._refused("detokenize", exc, started)
        self.metrics.observe("detokenize", 200, time.monotonic() - started)
        return JSONResponse({"prompt": text})

    async def version(self, request: Request) -> Response:
        """vLLM's `/version`: the serving control plane's version."""
        started = time.monotonic()
        try:
            info = await self._server_info(request)
        except GatewayError as exc:
            return self._refused("version", exc, started)
        self.metrics.observe("version", 200, time.monotonic() - started)
        return JSONResponse({"version": info.version})

    async def _body(self, request: Request, model: type[M]) -> M:
        """The request's body as `model`, once the control plane takes the caller's key: a caller
        it refuses gets its 401 with the body read and dropped, never parsed."""
        refused = await self.keys.check(bearer_key(request))
        if refused is not None:
            await discard_body(request, self.config.limits)
            raise refused
        return parse_body(await read_body(request, self.config.limits), model)

    def _codec(self, param: str) -> TokenCodec:
        if self.config.tokenizer is None:
            message = f"{param}: needs the model's tokenizer, and this gateway's --model has none"
            raise GatewayError(501, message, param=param)
        return self.config.tokenizer

    async def _prompt_counts(self, body: SamplingFields, prompts: list[str | list[int]]) -> list[int] | None:
        """Each prompt's token count when every chunk carries usage (continuous_usage_stats): the
        control plane reports it only at the end, so a text prompt is counted here with its own
        tokenizer class."""
        if not body.continuous_usage():
            return None
        if all(isinstance(p, list) for p in prompts):
            return [len(p) for p in prompts]
        codec = self._codec("stream_options.continuous_usage_stats")
        return [len(ids or ()) for ids in await asyncio.to_thread(_encode_all, codec, prompts)]

    def _decode_prompt(self, ids: list[int]) -> str:
        return self._codec("echo").decode(ids)

    def render_chat(self, body: ChatCompletionRequest) -> str:
        """The prompt text the model's chat template makes of the messages."""
        if self.config.template is None:
            problem = "messages: the model has no chat template; use /v1/completions"
            raise GatewayError(400, problem, "messages")
        messages = [m.template_dict(i) for i, m in enumerate(body.messages)]
        if "developer" not in self.config.template.source:
            # OpenAI's newer name for the system role, for templates that know only the older one.
            messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        check_renders_tools(self.config.template.source, body)
        plan = body.tool_plan
        tools = plan.tools if plan is not None else None
        prompt = self.config.template.render(
            messages, body.add_generation_prompt, tools, body.template_kwargs()
        )
        try:  # the typed fields are checked already; this catches a surrogate in an extra field
            return utf8_text(prompt)
        except ValueError as exc:
            raise invalid("messages", f"the rendered prompt is {exc}") from None

    async def models(self, request: Request) -> Response:
        """OpenAI's models list: the model served, once under each of its names (as vLLM lists
        them)."""
        started = time.monotonic()
        try:
            info = await self._server_info(request)
            cards = [self._model_card(name, info) for name in self.config.served_names]
        except GatewayError as exc:
            return self._refused("models", exc, started)
        self.metrics.observe("models", 200, time.monotonic() - started)
        return JSONResponse({"object": "list", "data": cards})

    def _check_model(self, model_id: str | None) -> None:
        """404 `model_not_found` for a model this gateway does not serve (none named: the served
        one, as vLLM takes it)."""
        if model_id and model_id not in self.config.served_names:
            served = ", ".join(repr(name) for name in self.config.served_names)
            message = f"model {model_id!r} is not served here (this gateway serves {served})"
            raise GatewayError(404, message, param="model", code="model_not_found")

    async def model(self, request: Request, model_id: str) -> Response:
        """OpenAI's models retrieve: the served model by its id, else 404 `model_not_found`."""
        started = time.monotonic()
        try:
            self._check_model(model_id)
            card = self._model_card(model_id, await self._server_info(request))
        except GatewayError as exc:
            return self._refused("models", exc, started)
        self.metrics.observe("models", 200, time.monotonic() - started)
        return JSONResponse(card)

    async def _server_info(self, request: Request) -> gen_pb.ServerInfo:
        try:
            return await self.client.server_info(api_key=bearer_key(request))
        except grpc.aio.AioRpcError as exc:
            raise from_grpc(exc) from None

    def _model_card(self, name: str, info: gen_pb.ServerInfo) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "stepwise",
            "max_model_len": info.max_context,
        }

    async def health(self) -> Response:
        """200 only while the control plane behind the gateway answers SERVING (a worker attached)."""
        request = health_pb2.HealthCheckRequest(service="")
        try:
            reply = await self.client.health.Check(request, timeout=HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            return error_response(GatewayError(503, f"control plane unreachable: {exc.code().name}"))
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return error_response(GatewayError(503, "control plane NOT_SERVING: no worker attached"))
        return JSONResponse({"status": "ok"})

    async def metrics_endpoint(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # --- generation -----------------------------------------------------------------------------

    def _model(self, body: SamplingFields) -> str:
        return body.model or self.config.model_name

    def _refused(self, endpoint: str, error: GatewayError, started: float) -> Response:
        self.metrics.observe(endpoint, error.status, time.monotonic() - started)
        return error_response(error)

    def _requests(
        self, body: SamplingFields, prompts: list[str | list[int]], base_id: str
    ) -> list[gen_pb.GenerateRequest]:
        """One GenerateRequest per prompt, ids `BASE` (one prompt) or `BASE-i`."""
        ids = [base_id] if len(prompts) == 1 else [f"{base_id}-{i}" for i in range(len(prompts))]
        return [body.grpc_request(prompt, rid) for prompt, rid in zip(prompts, ids, strict=True)]

    async def _generate(
        self,
        request: Request,
        requests: list[gen_pb.GenerateRequest],
        n: int,
        stream: bool,
        fmt: ResponseFormat,
        endpoint: str,
        started: float,
        renames: dict[str, str] | None = None,
    ) -> Response:
        """Start one Generate call per prompt and answer with the first response of each in hand,
        so a refused call is an HTTP error status rather than an error event inside a 200 stream
        (the other calls are then cancelled). `renames`: the endpoint's names for protocol fields
        a refusal names."""
        key = bearer_key(request)
        tenant = tenant_header(request)
        if tenant is not None:
            for one in requests:
                one.tenant = tenant
        calls = [self.client.stream(one, api_key=key) for one in requests]
        firsts = await asyncio.gather(*(_first(call) for call in calls), return_exceptions=True)
        running = [first for first in firsts if isinstance(first, Call)]
        if len(running) < len(calls):
            for call in calls:
                _cancel(call)
            error = next(first for first in firsts if isinstance(first, BaseException))
            if isinstance(error, GatewayError):
                raise _renamed(error, renames or {})
            raise error
        self.metrics.ttft.labels(endpoint).observe(time.monotonic() - started)
        run = Run(running, Collected.of(n, len(requests)))
        if stream:
            events = self._stream(run, fmt, endpoint, started)
            return StreamingResponse(events, media_type="text/event-stream")
        return await self._whole(request, run, fmt, endpoint, started)

    async def _whole(
        self, request: Request, run: Run, fmt: ResponseFormat, endpoint: str, started: float
    ) -> Response:
        """Collect every choice, or cancel the call when the client leaves first."""
        collecting = asyncio.ensure_future(run.drain())
        leaving = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait([collecting, leaving], return_when=asyncio.FIRST_COMPLETED)
            if not collecting.done():
                self.metrics.disconnects.labels(endpoint).inc()
                run.cancel()
                collecting.cancel()
                return Response(status_code=499)
            collecting.result()
        except GatewayError as exc:
            return self._refused(endpoint, exc, started)
        except grpc.aio.AioRpcError as exc:
            return self._refused(endpoint, from_grpc(exc), started)
        finally:
            leaving.cancel()
        self.metrics.completion_tokens.labels(endpoint).inc(run.collected.usage()["completion_tokens"])
        self.metrics.observe(endpoint, 200, time.monotonic() - started)
        return JSONResponse(fmt.whole(run.collected))

    async def _stream(
        self, run: Run, fmt: ResponseFormat, endpoint: str, started: float
    ) -> AsyncIterator[bytes]:
        """Server-sent events; an error after the first event is an error event, then the end."""
        status, finished = 200, False
        try:
            for opening in fmt.opening(len(run.collected.choices)):
                yield sse(fmt.annotated(opening, run.collected))
            async for event in run.events():
                for data in fmt.events(event, run.collected):
                    yield sse(fmt.annotated(data, run.collected))
            for closing in fmt.closing(run.collected):
                yield sse(closing)
            yield SSE_DONE
            finished = True
        except (GatewayError, grpc.aio.AioRpcError) as exc:
            error = exc if isinstance(exc, GatewayError) else from_grpc(exc)
            status, finished = error.status, True
            yield sse(error.body())
        finally:
            if not finished:  # the client went away (Starlette cancelled us): abort the request
                status = 499
                run.cancel()
                self.metrics.disconnects.labels(endpoint).inc()
            self.metrics.completion_tokens.labels(endpoint).inc(run.collected.usage()["completion_tokens"])
            self.metrics.observe(endpoint, status, time.monotonic() - started)


@dataclass(slots=True)
class Call:
    """One Generate call in flight: its first response already read, the rest to come."""

    call: AsyncIterator[gen_pb.GenerateResponse]
    first: gen_pb.GenerateResponse
    rest: AsyncIterator[gen_pb.GenerateResponse]

    async def responses(self) -> AsyncIterator[gen_pb.GenerateResponse]:
        yield self.first
        async for response in self.rest:
            yield response


async def _first(call: AsyncIterator[gen_pb.GenerateResponse]) -> Call:
    """The call with its first response read; a refusal as the GatewayError it answers with."""
    responses = aiter(call)
    try:
        first = await anext(responses)
    except grpc.aio.AioRpcError as exc:
        raise from_grpc(exc) from None
    except StopAsyncIteration:
        raise GatewayError(502, "the control plane ended the call without a result") from None
    return Call(call, first, responses)


def _cancel(call: object) -> None:
    """Cancel a gRPC call: the control plane aborts the request and frees its KV."""
    cancel = getattr(call, "cancel", None)
    if cancel is not None:
        cancel()


class Run:
    """The Generate calls of one request (one per prompt), merged into one stream of events."""

    def __init__(self, calls: list[Call], collected: Collected) -> None:
        self.calls, self.collected = calls, collected

    async def events(self) -> AsyncIterator[Event]:
        """What each response changed, recorded in `collected`, in the order the calls' responses
        arrive."""
        if len(self.calls) == 1:  # read the call itself: one generator less per event
            call = self.calls[0]
            yield self.collected.apply(call.first)
            async for response in call.rest:
                yield self.collected.apply(response)
            return
        queue: asyncio.Queue[tuple[int, gen_pb.GenerateResponse | BaseException | None]] = asyncio.Queue()
        pumps = [asyncio.ensure_future(_pump(i, call, queue)) for i, call in enumerate(self.calls)]
        try:
            running = len(pumps)
            while running:
                prompt, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield self.collected.apply(item, prompt)
        finally:
            for pump in pumps:
                pump.cancel()

    async def drain(self) -> None:
        async for _ in self.events():
            pass

    def cancel(self) -> None:
        """Cancel every call: the control plane aborts the requests and frees their KV."""
        for call in self.calls:
            _cancel(call.call)


async def _pump(
    prompt: int,
    call: Call,
    queue: asyncio.Queue[tuple[int, gen_pb.GenerateResponse | BaseException | None]],
) -> None:
    """Feed one call's responses into the merged queue, then None (or the error that ended it)."""
    try:
        async for response in call.responses():
            await queue.put((prompt, response))
    except Exception as exc:
        await queue.put((prompt, exc))
        return
    await queue.put((prompt, None))


def _encode_all(tokenizer: TokenCodec, prompts: list[str | list[int]]) -> list[list[int] | None]:
    return [tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]


def _renamed(error: GatewayError, renames: dict[str, str]) -> GatewayError:
    """The refusal naming the endpoint's field for the protocol's (`top_logprobs` -> `logprobs`)."""
    name = renames.get(error.param or "")
    if name is None:
        return error
    message = error.message.replace(f"{error.param}:", f"{name}:", 1)
    return GatewayError(error.status, message, param=name, code=error.code)


async def _drain(call: AsyncIterator[gen_pb.GenerateResponse]) -> None:
    """Read a call to its end; an aborted generation is a GatewayError."""
    async for response in call:
        if (
            response.WhichOneof("event") == "finished"
            and response.finished.reason == gen_pb.FINISH_REASON_ABORT
        ):
            raise GatewayError(503, "aborted")


async def _disconnected(request: Request) -> None:
    """Return once the HTTP client has gone away (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
