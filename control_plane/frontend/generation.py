"""The Generation service one frontend serves: Generate, Abort and GetServerInfo for clients, who
is calling (API keys), and client messages cut from a call's events."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import math
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, NoReturn

import grpc

from control_plane.frontend import client_codec
from control_plane.frontend.core_link import CORE_GONE, CoreState, Frontend
from control_plane.frontend.grammars import GrammarBusy, GrammarCompiler
from control_plane.frontend.pacer import Pacer
from control_plane.frontend.samples import Call, Chunk, Done, Lost, Prompt
from control_plane.link import DRAINING, LinkClosed
from control_plane.request import RequestParams
from protos.stepwise.v1 import generation_pb2 as gen_pb
from protos.stepwise.v1 import generation_pb2_grpc as gen_grpc
from protos.worker import Grammar

GENERATION_SERVICE = gen_pb.DESCRIPTOR.services_by_name["Generation"].full_name
# Text prompts up to this size are tokenized on the event loop (tens of microseconds); longer ones
# in a thread, so no client's prompt stalls the others' streams.
INLINE_TOKENIZE_BYTES = 2048
_STATUS = {code.value[0]: code for code in grpc.StatusCode}


# --- who is calling ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling: an API key's id when keys are on, else the client's connection."""

    owner: str
    authenticated: bool


class ApiKeys:
    """Bearer tokens accepted from clients. A key is known by a short hash of it, never by itself."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def identify(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
        """The caller's key id, or None when it sent no known key (compared in constant time)."""
        token = _bearer(metadata)
        if token is None:
            return None
        digest = hashlib.sha256(token.encode()).digest()
        match = None
        for known in self._digests:
            if hmac.compare_digest(digest, known):
                match = known
        return None if match is None else "key:" + match.hex()[:12]


def retry_after_header(seconds: float) -> str:
    """Whole seconds, rounded up (HTTP's Retry-After has no fractions; 0 would invite a busy retry)."""
    return str(max(1, math.ceil(seconds)))


def _bearer(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
    for key, value in metadata or ():
        if key.lower() == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer ") :].strip()
    return None


class GenerationService(gen_grpc.GenerationServicer):
    """Generate, Abort and GetServerInfo for clients, served by one frontend."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.config = frontend.config
        self.tokenizer = frontend.tokenizer
        self.keys = ApiKeys(self.config.security.api_keys)
        self.grammars = GrammarCompiler(
            self.config.grammar_backend,
            self.tokenizer.to_json,
            self.tokenizer.vocab_size,
            self.tokenizer.eos_token_ids,
            self.config.grammar_compile_timeout_s,
        )
        # Generate calls being served (bounded by --max-concurrent-streams).
        self.streams = 0
        # Each method's request parser, used once the caller is known (see generation_handlers).
        self.parsers: dict[str, Callable[[bytes], Any]] = {
            name: client_codec.lenient_parser(getattr(gen_pb, method.input_type.name))
            for name, method in gen_pb.DESCRIPTOR.services_by_name["Generation"].methods_by_name.items()
        }
        self.pacer = Pacer()

    def _parse(self, method: str, raw: bytes) -> Any:
        """The request of `method` from its bytes, once its caller is known: a message, or an
        Unparsable for the method to refuse."""
        return self.parsers[method](raw)

    def _caller(self, context: grpc.aio.ServicerContext) -> Caller | None:
        """Who calls; None for a caller without a known key (`_refuse_stranger` ends the call)."""
        if not self.keys.enabled:
            return Caller(owner=context.peer(), authenticated=False)
        owner = self.keys.identify(context.invocation_metadata())  # type: ignore[arg-type]
        return None if owner is None else Caller(owner=owner, authenticated=True)

    @staticmethod
    async def _refuse_stranger(context: grpc.aio.ServicerContext) -> NoReturn:
        """End a call without a known key with UNAUTHENTICATED. Each method drops the request's bytes
        first: the abort's exception carries the method's frame in its traceback, and a cycle
        through it would keep a stranger's message (up to the port's size limit) until the garbage
        collector's next full pass, which bytes alone never trigger (16 messages of 8 MiB a burst
        grew a frontend by about 55 MiB a burst, burst after burst)."""
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key (send authorization: Bearer KEY)"
        )

    async def Generate(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gen_pb.GenerateResponse | bytes]:
        caller = self._caller(context)
        if caller is None:
            del raw
            await self._refuse_stranger(context)
        request: gen_pb.GenerateRequest | client_codec.Unparsable = self._parse("Generate", raw)
        del raw
        # The bound counts Generate calls only (not gRPC's maximum_concurrent_rpcs, which counts every
        # call): health probes, GetServerInfo and Abort answer however many streams are open.
        bound = self.config.max_concurrent_streams
        if self.streams >= bound:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this frontend serves {bound} Generate calls already (--max-concurrent-streams); retry",
            )
        self.streams += 1
        try:
            async for response in self._generate(request, context, caller):
                yield response
        finally:
            self.streams -= 1

    async def _generate(
        self,
        request: gen_pb.GenerateRequest | client_codec.Unparsable,
        context: grpc.aio.ServicerContext,
        caller: Caller,
    ) -> AsyncIterator[gen_pb.GenerateResponse | bytes]:
        call = await self._accept(request, context, caller)
        rid_field = client_codec.request_id_field(call.rid)
        remaining = len(call.samples)
        try:
            while remaining:
                await call.wait()
                if call.streaming:
                    await self.pacer.slot()
                events = self.frontend.take(call)
                lost = next((e for e in events if isinstance(e, Lost)), None)
                for response, finished in coalesce(
                    rid_field, call.rid, [e for e in events if not isinstance(e, Lost)]
                ):
                    yield response
                    remaining -= finished
                if lost is not None:
                    remaining = 0
                    await context.abort(grpc.StatusCode.UNAVAILABLE, lost.message)
        finally:
            if remaining:
                self.frontend.cancel(call, "cancelled by the client")

    async def _accept(
        self,
        request: gen_pb.GenerateRequest | client_codec.Unparsable,
        context: grpc.aio.ServicerContext,
        caller: Caller,
    ) -> Call:
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        if isinstance(request, client_codec.Unparsable):
            await context.abort(invalid, request.reason)
        assert not isinstance(request, client_codec.Unparsable)
        try:
            inp = client_codec.generate_input_from_proto(request, self.config.limits)
        except client_codec.InvalidArgument as exc:
            await context.abort(invalid, str(exc))
        # Whether a worker can take it is the core's to say (its verdict): the state this frontend
        # last heard may lag an attach by a message. A drain is final, so it is refused here at once.
        state = self.frontend.state
        if state.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
        constraint = client_codec.constraint_field(request.sampling) or ""
        try:
            ids = await self._prompt_ids(inp, state)
            grammar = inp.params.sampler.grammar
            if grammar is not None:
                grammar = await self.grammars.check(grammar, constraint, caller.owner)
        except client_codec.InvalidArgument as exc:
            await context.abort(invalid, str(exc))
        except GrammarBusy as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        rid = inp.request_id or uuid.uuid4().hex
        inp = dataclasses.replace(inp, params=as_run(inp.params, grammar, self.config.logprobs_mode))
        call = self.frontend.open_call(inp, rid, ids, caller.owner, caller.authenticated, constraint)
        assert call.verdict is not None
        try:
            code, message = await call.verdict
        except asyncio.CancelledError:
            self.frontend.cancel(call, "cancelled by the client")
            raise
        if code != grpc.StatusCode.OK.value[0]:
            trailers: tuple[tuple[str, str], ...] = ()
            if call.retry_after_s > 0:
                trailers = (("retry-after", retry_after_header(call.retry_after_s)),)
            await context.abort(_STATUS.get(code, grpc.StatusCode.INTERNAL), message, trailers)
        return call

    async def _prompt_ids(self, inp: client_codec.GenerateInput, state: CoreState) -> list[int]:
        """The prompt's token ids, checked. Text is measured before it is tokenized, and long text is
        tokenized off the event loop: its cost grows with its length."""
        if inp.text is not None:
            size = self._check_text_fits(inp.text, state)
            if size <= INLINE_TOKENIZE_BYTES:
                ids = self.tokenizer.encode(inp.text)
            else:
                ids = await asyncio.to_thread(self.tokenizer.encode, inp.text)
            field_name = "text"
        else:
            ids, field_name = list(inp.input_ids or ()), "input_ids"
        if not ids:
            raise client_codec.InvalidArgument(f"{field_name}: prompt must not be empty")
        vocab_size = state.vocab_size or self.tokenizer.vocab_size
        client_codec.check_token_ids(ids, vocab_size)
        client_codec.check_logit_bias_ids(inp.params, vocab_size)
        client_codec.check_prompt_scoring(inp.params, len(ids), vocab_size)
        return ids

    def _check_text_fits(self, text: str, state: CoreState) -> int:
        size = len(text.encode("utf-8", "surrogatepass"))
        if self.config.scheduler.allow_auto_truncate or not state.max_context:
            return size
        if size > state.max_context * self.tokenizer.max_token_bytes:
            raise client_codec.InvalidArgument(
                f"text: a prompt of {size} bytes is more than the model's context of "
                f"{state.max_context} tokens"
            )
        return size

    async def Abort(self, raw: bytes, context: grpc.aio.ServicerContext) -> gen_pb.AbortResponse:
        caller = self._caller(context)
        if caller is None:
            del raw
            await self._refuse_stranger(context)
        request: gen_pb.AbortRequest | client_codec.Unparsable = self._parse("Abort", raw)
        if isinstance(request, client_codec.Unparsable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        assert not isinstance(request, client_codec.Unparsable)
        try:
            found = await self.frontend.abort(request.request_id, caller.owner)
        except LinkClosed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, CORE_GONE)
        return gen_pb.AbortResponse(found=found)

    async def GetServerInfo(self, raw: bytes, context: grpc.aio.ServicerContext) -> gen_pb.ServerInfo:
        caller = self._caller(context)
        if caller is None:
            del raw
            await self._refuse_stranger(context)
        try:
            info = await self.frontend.server_info()
        except LinkClosed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, CORE_GONE)
        if not caller.authenticated:
            # No filesystem paths, weight fingerprints or workers' addresses to callers we do not know.
            info.model_path = ""
            info.model_fingerprint = ""
            for worker in info.workers:
                worker.transfer_address = ""
        return info


def as_run(params: RequestParams, grammar: Grammar | None, logprobs_mode: str) -> RequestParams:
    """The checked parameters as the core runs them: the grammar as this frontend compiled it (its
    backend named), and the logprobs this server's --logprobs-mode makes."""
    processed = bool(params.sampler.logprobs) and logprobs_mode == "processed"
    sampler = dataclasses.replace(params.sampler, grammar=grammar, processed_logprobs=processed)
    return dataclasses.replace(params, sampler=sampler)


def generation_handlers(service: GenerationService) -> dict[str, grpc.RpcMethodHandler]:
    """The Generation service's methods by name. Each receives its request as the bytes gRPC read
    (no request_deserializer) and parses it only after the caller's key checks out: a stranger's
    message, up to the port's size limit, is never turned into objects (16 unauthenticated 8 MiB
    messages left a frontend holding 1.6 GiB when gRPC parsed them first). Parsing is lenient (see
    client_codec.lenient_parser). The server registers them (`add_registered_method_handlers`):
    grpc.aio then accepts each method's calls on its own, so a burst of Generate calls does not
    delay a GetServerInfo's or an Abort's accept."""
    methods = gen_pb.DESCRIPTOR.services_by_name["Generation"].methods_by_name
    handlers = {}
    for name, method in methods.items():
        response_cls = getattr(gen_pb, method.output_type.name)
        factory = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[name] = factory(
            getattr(service, name),
            request_deserializer=None,
            response_serializer=_serialize if method.server_streaming else response_cls.SerializeToString,
        )
    return handlers


def coalesce(
    rid_field: bytes, rid: str, events: Sequence[Chunk | Done | Prompt]
) -> list[tuple[gen_pb.GenerateResponse | bytes, bool]]:
    """Merge consecutive chunks of a sample into one message (a slow reader gets fewer, larger ones).
    Each message comes with whether it is a sample's Finished; chunks without log probabilities come
    encoded (`rid_field` is the call's encoded request id)."""
    out: list[tuple[gen_pb.GenerateResponse | bytes, bool]] = []
    pending: Chunk | None = None
    for event in events:
        if isinstance(event, Chunk):
            if pending is not None and pending.index == event.index:
                pending = Chunk(
                    event.index,
                    pending.token_ids + event.token_ids,
                    pending.text + event.text,
                    pending.logprobs + event.logprobs,
                )
                continue
            _flush_chunk(rid_field, rid, pending, out)
            pending = event
            continue
        _flush_chunk(rid_field, rid, pending, out)
        pending = None
        if isinstance(event, Prompt):
            out.append((gen_pb.GenerateResponse(request_id=rid, prompt_logprobs=event.logprobs), False))
            continue
        finished = client_codec.finished_response(
            rid,
            event.index,
            event.reason,
            (event.prompt_tokens, event.cached_tokens, event.completion_tokens),
            (event.queue_s, event.ttft_s, event.total_s),
        )
        out.append((finished, True))
    _flush_chunk(rid_field, rid, pending, out)
    return out


def _flush_chunk(
    rid_field: bytes, rid: str, chunk: Chunk | None, out: list[tuple[gen_pb.GenerateResponse | bytes, bool]]
) -> None:
    if chunk is None or not (chunk.token_ids or chunk.text):
        return
    if chunk.logprobs:
        response = client_codec.chunk_response(
            rid, chunk.index, list(chunk.token_ids), chunk.text, chunk.logprobs
        )
        out.append((response, False))
    else:
        out.append((client_codec.chunk_bytes(rid_field, chunk.index, chunk.token_ids, chunk.text), False))


def _serialize(message: gen_pb.GenerateResponse | bytes) -> bytes:
    """A response as gRPC sends it: encoded already, or a message to encode."""
    return message if type(message) is bytes else message.SerializeToString()  # type: ignore[union-attr]
