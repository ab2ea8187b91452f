"""The client protocol (generation.proto) at the control plane's edge: a Generate call validated
into typed values, with messages that name the offending field, and the response messages.

A frontend's alone: it checks what a client sent once, and sends the checked value to the core
(control_plane/link_params.py), which reads nothing of the client's protocol.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FileDescriptor
from google.protobuf.message import DecodeError, Message

from control_plane.config import Limits
from control_plane.record.files import varint
from control_plane.request import FinishKind, FinishReason, RequestParams
from grammars import spec as grammar_spec
from protos.stepwise.v1 import generation_pb2 as gen_pb
from protos.worker import Grammar, SamplerParams

MAX_SAMPLES = 64


class InvalidArgument(ValueError):
    """Client input that is refused; the message names the field."""


@dataclass(frozen=True, slots=True)
class GenerateInput:
    """A validated Generate call: exactly one of text / input_ids is set."""

    request_id: str
    text: str | None
    input_ids: tuple[int, ...] | None
    params: RequestParams
    n: int = 1


def _opt(msg: object, name: str, default: object) -> object:
    return getattr(msg, name) if msg.HasField(name) else default  # type: ignore[attr-defined]


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidArgument(f"{field_name}: {message}")


def _check_finite(msg: gen_pb.SamplingParams) -> None:
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
    ):
        value = getattr(msg, name)
        _check(math.isfinite(value), f"sampling.{name}", f"must be a finite number, got {value}")


def _check_stops(msg: gen_pb.SamplingParams, limits: Limits) -> None:
    count, chars = len(msg.stop), sum(len(s) for s in msg.stop)
    _check(
        count <= limits.max_stop_strings,
        "sampling.stop",
        f"{count} stop strings; at most {limits.max_stop_strings} are allowed (--max-stop-strings)",
    )
    _check(
        chars <= limits.max_stop_chars,
        "sampling.stop",
        f"{chars} characters of stop strings; at most {limits.max_stop_chars} (--max-stop-chars)",
    )
    _check(all(s for s in msg.stop), "sampling.stop", "stop strings must not be empty")
    ids = len(msg.stop_token_ids)
    _check(
        ids <= limits.max_stop_token_ids,
        "sampling.stop_token_ids",
        f"{ids} ids; at most {limits.max_stop_token_ids} are allowed (--max-stop-token-ids)",
    )


# OpenAI's logit_bias: at most this many entries, each bias within ±MAX_LOGIT_BIAS.
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0


def _logit_bias(msg: gen_pb.SamplingParams) -> tuple[tuple[int, float], ...]:
    """The checked bias map as sorted (id, bias) pairs; ids below the vocabulary are checked where
    its size is known (check_logit_bias_ids)."""
    entries = len(msg.logit_bias)
    _check(
        entries <= MAX_LOGIT_BIAS_ENTRIES,
        "sampling.logit_bias",
        f"{entries} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed",
    )
    for token, bias in msg.logit_bias.items():
        _check(token >= 0, "sampling.logit_bias", f"token id {token} must be >= 0")
        _check(
            math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS,
            "sampling.logit_bias",
            f"the bias of token {token} must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}",
        )
    return tuple(sorted(msg.logit_bias.items()))


def check_logit_bias_ids(params: RequestParams, vocab_size: int) -> None:
    """Every biased token id is inside the vocabulary; InvalidArgument naming the field otherwise."""
    for token, _ in params.sampler.logit_bias:
        _check(
            token < vocab_size,
            "sampling.logit_bias",
            f"token id {token} is outside the vocabulary [0, {vocab_size})",
        )


def _logprob_fields(msg: gen_pb.SamplingParams, limits: Limits) -> tuple[bool, int, tuple[int, ...], int]:
    """(output logprobs, top alternatives, token_ids_logprob, logprob_start_len), checked; prompt
    lengths and vocabulary are checked where they are known (check_prompt_scoring)."""
    most = limits.max_top_logprobs
    top = msg.top_logprobs if msg.HasField("top_logprobs") else 0
    _check(
        0 <= top <= most, "sampling.top_logprobs", f"must be in [0, {most}] (--max-top-logprobs), got {top}"
    )
    ids = tuple(msg.token_ids_logprob)
    _check(
        len(ids) <= most,
        "sampling.token_ids_logprob",
        f"{len(ids)} ids; at most {most} are allowed (--max-top-logprobs)",
    )
    _check(all(i >= 0 for i in ids), "sampling.token_ids_logprob", "token ids must be >= 0")
    start = msg.logprob_start_len if msg.HasField("logprob_start_len") else -1
    _check(start >= -1, "sampling.logprob_start_len", f"must be >= -1 (-1: none), got {start}")
    return msg.logprobs or top > 0 or bool(ids), top, ids, start


def check_prompt_scoring(params: RequestParams, prompt_len: int, vocab_size: int) -> None:
    """What needs the prompt and the vocabulary: logprob_start_len inside the prompt, the ids of
    token_ids_logprob inside the vocabulary; InvalidArgument naming the field otherwise."""
    start = params.logprob_start_len
    _check(
        start < prompt_len,
        "sampling.logprob_start_len",
        f"{start} is not below the prompt's length of {prompt_len} tokens",
    )
    for token in params.sampler.token_ids_logprob:
        _check(
            token < vocab_size,
            "sampling.token_ids_logprob",
            f"token id {token} is outside the vocabulary [0, {vocab_size})",
        )


def constraint_field(msg: gen_pb.SamplingParams) -> str | None:
    """The name of the request's constraint field (`sampling.json_schema`, ...), None without one."""
    which = msg.WhichOneof("constraint")
    return None if which is None else f"sampling.{which}"


def _grammar(msg: gen_pb.SamplingParams, limits: Limits) -> Grammar | None:
    """The request's constraint, checked for what needs no backend and no parse: its size, a
    well-formed choice list, and the sampling fields it cannot be combined with. Its text is read
    by its compile (control_plane/frontend/grammars.py: JSON that is no JSON object is refused
    there, with the same message), which names the backend; a text sent again is not read again."""
    which = msg.WhichOneof("constraint")
    if which is None:
        return None
    name = f"sampling.{which}"
    try:
        if which == grammar_spec.CHOICE:
            spec = grammar_spec.from_choices(list(msg.choice.choices))
        else:
            spec = grammar_spec.GrammarSpec(which, getattr(msg, which))
    except grammar_spec.GrammarError as exc:
        raise InvalidArgument(f"{name}: {exc}") from None
    _check(
        spec.size <= limits.max_grammar_bytes,
        name,
        f"{spec.size} bytes; at most {limits.max_grammar_bytes} are allowed (--max-grammar-bytes)",
    )
    # A finished grammar allows only EOS: ignoring EOS, or not letting it end the output yet, would
    # leave the output nothing to continue with.
    _check(not msg.ignore_eos, "sampling.ignore_eos", f"cannot be combined with {name}")
    min_new = msg.min_new_tokens if msg.HasField("min_new_tokens") else 0
    _check(min_new == 0, "sampling.min_new_tokens", f"cannot be combined with {name}")
    return Grammar("", spec.kind, spec.text)


def sampling_from_proto(msg: gen_pb.SamplingParams, limits: Limits | None = None) -> RequestParams:
    """Validate and convert sampling parameters; raises InvalidArgument naming the field."""
    limits = limits or Limits()
    _check_finite(msg)
    _check_stops(msg, limits)
    logprobs, top, ids, start = _logprob_fields(msg, limits)
    max_new = msg.max_new_tokens if msg.HasField("max_new_tokens") else None
    # A client that sends no temperature samples at 1.0 (the client protocol's default, as in SGLang), not
    # at SamplerParams' greedy "off".
    temperature = float(_opt(msg, "temperature", 1.0))  # type: ignore[arg-type]
    top_p = float(_opt(msg, "top_p", 1.0))  # type: ignore[arg-type]
    top_k = int(_opt(msg, "top_k", 0))  # type: ignore[call-overload]
    min_p = float(_opt(msg, "min_p", 0.0))  # type: ignore[arg-type]
    rep = float(_opt(msg, "repetition_penalty", 1.0))  # type: ignore[arg-type]
    _check(max_new is None or max_new >= 0, "sampling.max_new_tokens", f"must be >= 0, got {max_new}")
    min_new = msg.min_new_tokens if msg.HasField("min_new_tokens") else 0
    _check(min_new >= 0, "sampling.min_new_tokens", f"must be >= 0, got {min_new}")
    _check(temperature >= 0.0, "sampling.temperature", f"must be >= 0, got {temperature}")
    _check(0.0 < top_p <= 1.0, "sampling.top_p", f"must be in (0, 1], got {top_p}")
    _check(top_k >= 0, "sampling.top_k", f"must be >= 0, got {top_k}")
    _check(0.0 <= min_p <= 1.0, "sampling.min_p", f"must be in [0, 1], got {min_p}")
    _check(rep > 0.0, "sampling.repetition_penalty", f"must be > 0, got {rep}")
    n = msg.n if msg.HasField("n") else 1
    _check(1 <= n <= MAX_SAMPLES, "sampling.n", f"must be in [1, {MAX_SAMPLES}], got {n}")
    _check(all(t >= 0 for t in msg.stop_token_ids), "sampling.stop_token_ids", "token ids must be >= 0")
    sampler = SamplerParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=rep,
        frequency_penalty=msg.frequency_penalty if msg.HasField("frequency_penalty") else 0.0,
        presence_penalty=msg.presence_penalty if msg.HasField("presence_penalty") else 0.0,
        seed=msg.seed if msg.HasField("seed") else None,
        logit_bias=_logit_bias(msg),
        # The worker scores with the sampled token plus `top` alternatives when anything is asked.
        logprobs=1 + top if logprobs or start >= 0 else 0,
        token_ids_logprob=ids,
        grammar=_grammar(msg, limits),
    )
    return RequestParams(
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        stop=tuple(msg.stop),
        stop_token_ids=frozenset(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        sampler=sampler,
        logprobs=logprobs,
        logprob_start_len=start,
    )


def request_params_from_proto(
    sampling: gen_pb.SamplingParams, priority: int | None, routing_key: str, limits: Limits | None = None
) -> RequestParams:
    """A request's parameters: its checked sampling parameters, priority and routing key."""
    params = sampling_from_proto(sampling, limits)
    return dataclasses.replace(params, priority=priority, routing_key=routing_key)


def with_tenancy(params: RequestParams, tenant: str, ttft_slo_ms: float, tpot_slo_ms: float) -> RequestParams:
    """The request's tenant and latency objectives, checked; InvalidArgument naming the field."""
    for name, value in (("ttft_slo_ms", ttft_slo_ms), ("tpot_slo_ms", tpot_slo_ms)):
        _check(math.isfinite(value) and value >= 0, name, f"{value} is not a duration (0: none)")
    return dataclasses.replace(params, tenant=tenant, ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms)


def generate_input_from_proto(msg: gen_pb.GenerateRequest, limits: Limits | None = None) -> GenerateInput:
    """Validate a Generate call (all but what needs the tokenizer or a worker); InvalidArgument."""
    limits = limits or Limits()
    which = msg.WhichOneof("prompt")
    _check(which is not None, "prompt", "one of text or input_ids is required")
    text = msg.text if which == "text" else None
    ids = tuple(msg.input_ids.ids) if which == "input_ids" else None
    _check(bool(text) or bool(ids), "text" if which == "text" else "input_ids", "prompt must not be empty")
    if text is not None:
        size = len(text.encode("utf-8", "surrogatepass"))
        _check(
            size <= limits.max_prompt_bytes,
            "text",
            f"prompt of {size} bytes; at most {limits.max_prompt_bytes} are allowed (--max-prompt-bytes)",
        )
    for name in ("request_id", "routing_key", "tenant"):
        value = getattr(msg, name)
        _check(
            len(value) <= limits.max_id_chars,
            name,
            f"{len(value)} characters; at most {limits.max_id_chars} are allowed",
        )
    priority = msg.priority if msg.HasField("priority") else None
    params = request_params_from_proto(msg.sampling, priority, msg.routing_key, limits)
    params = with_tenancy(params, msg.tenant, msg.ttft_slo_ms, msg.tpot_slo_ms)
    n = msg.sampling.n if msg.sampling.HasField("n") else 1
    return GenerateInput(request_id=msg.request_id, text=text, input_ids=ids, params=params, n=n)


def check_token_ids(ids: tuple[int, ...] | list[int], vocab_size: int) -> None:
    if not ids:
        return
    array = np.asarray(ids, dtype=np.int64)
    bad = np.flatnonzero((array < 0) | (array >= vocab_size))
    if len(bad):
        i = int(bad[0])
        raise InvalidArgument(
            f"input_ids: token id {ids[i]} at index {i} is outside the vocabulary [0, {vocab_size})"
        )


# --- requests that do not parse --------------------------------------------------------------------


def _bytes_twin(file: FileDescriptor) -> descriptor_pool.DescriptorPool:
    """A copy of a .proto file's messages (and of the files it imports) with every string field as
    bytes, in a pool of its own.

    A field declared `string` must hold UTF-8, and protobuf refuses the whole message otherwise
    without saying which field; the twin parses the same bytes and lets us find it.
    """
    pool = descriptor_pool.DescriptorPool()
    for each in (*file.dependencies, file):
        proto = descriptor_pb2.FileDescriptorProto()
        each.CopyToProto(proto)
        proto.name = "bytes_twin/" + proto.name
        proto.dependency[:] = ["bytes_twin/" + name for name in proto.dependency]
        for message in proto.message_type:
            for fld in message.field:
                if fld.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
                    fld.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
        pool.Add(proto)
    return pool


_TWIN_POOL = _bytes_twin(gen_pb.DESCRIPTOR)


@dataclass(frozen=True, slots=True)
class Unparsable:
    """A request that did not parse (e.g. a string field that is not UTF-8), and why."""

    reason: str


def lenient_parser(message: type[Message]) -> Callable[[bytes], Message | Unparsable]:
    """A request deserializer that turns a parse failure into an Unparsable, for the handler to
    refuse with INVALID_ARGUMENT naming the field (gRPC itself would answer UNKNOWN)."""

    def parse(data: bytes) -> Message | Unparsable:
        try:
            return message.FromString(data)
        except DecodeError:
            return Unparsable(describe_unparsable(data, message.DESCRIPTOR.full_name))

    return parse


def describe_unparsable(data: bytes, message_name: str = "stepwise.v1.GenerateRequest") -> str:
    """Why `data` is not a valid message: the first string field that is not UTF-8, by its path."""
    twin = message_factory.GetMessageClass(_TWIN_POOL.FindMessageTypeByName(message_name))()
    try:
        twin.ParseFromString(data)
    except DecodeError:
        return "the request is not a valid protobuf message"
    path = _first_bad_utf8(twin, "")
    if path is None:
        return "the request is not a valid protobuf message"
    return f"{path}: not valid UTF-8"


def _first_bad_utf8(msg: Message, prefix: str) -> str | None:
    original = descriptor_pool.Default().FindMessageTypeByName(msg.DESCRIPTOR.full_name)
    strings = {f.name for f in original.fields if f.type == f.TYPE_STRING}
    for fld, value in msg.ListFields():
        items = list(enumerate(value)) if fld.is_repeated else [(None, value)]
        for i, item in items:
            where = prefix + fld.name + ("" if i is None else f"[{i}]")
            if isinstance(item, Message):
                found = _first_bad_utf8(item, where + ".")
                if found:
                    return found
            elif fld.name in strings and not _is_utf8(item):
                return where
    return None


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


_FINISH_TO_PROTO = {
    FinishKind.STOP: gen_pb.FINISH_REASON_STOP,
    FinishKind.LENGTH: gen_pb.FINISH_REASON_LENGTH,
    FinishKind.ABORT: gen_pb.FINISH_REASON_ABORT,
    FinishKind.GRAMMAR_UNSATISFIABLE: gen_pb.FINISH_REASON_GRAMMAR_UNSATISFIABLE,
}


def request_id_field(request_id: str) -> bytes:
    """`GenerateResponse.request_id` as its encoded field: a call's messages all begin with it."""
    rid = request_id.encode()
    return b"\x0a" + _varint(len(rid)) + rid if rid else b""


def chunk_bytes(request_id_field: bytes, index: int, token_ids: Sequence[int], text: str) -> bytes:
    """A `GenerateResponse` with a `TokenChunk` (no log probabilities), encoded by hand: the bytes
    `chunk_response(...).SerializeToString()` gives, without building two messages per client
    message on the streaming path."""
    ids = b"".join(map(_varint, token_ids))
    body = b"\x0a" + _varint(len(ids)) + ids if ids else b""
    if text:
        encoded = text.encode("utf-8", "surrogatepass")
        body += b"\x12" + _varint(len(encoded)) + encoded
    if index:
        body += b"\x18" + _varint(index)
    return request_id_field + b"\x12" + _varint(len(body)) + body


def _varint(value: int) -> bytes:
    """A non-negative integer as a protobuf varint: the 1-3 bytes of a token id inline, longer ones
    by the recordings' encoder."""
    if value < 0x80:
        return _ONE_BYTE[value]
    if value < 0x4000:
        return bytes((value & 0x7F | 0x80, value >> 7))
    if value < 0x200000:
        return bytes((value & 0x7F | 0x80, (value >> 7) & 0x7F | 0x80, value >> 14))
    return varint(value)


_ONE_BYTE = [bytes((v,)) for v in range(0x80)]


def chunk_response(
    request_id: str,
    index: int,
    token_ids: list[int],
    text: str,
    logprobs: tuple[gen_pb.TokenLogprob, ...] = (),
) -> gen_pb.GenerateResponse:
    chunk = gen_pb.TokenChunk(index=index, token_ids=token_ids, text=text, logprobs=logprobs)
    return gen_pb.GenerateResponse(request_id=request_id, chunk=chunk)


def finished_response(
    request_id: str,
    index: int,
    reason: FinishReason,
    usage: tuple[int, int, int],
    timings: tuple[float, float, float],
) -> gen_pb.GenerateResponse:
    prompt, cached, completion = usage
    queue_s, ttft_s, total_s = timings
    return gen_pb.GenerateResponse(
        request_id=request_id,
        finished=gen_pb.Finished(
            index=index,
            reason=_FINISH_TO_PROTO[reason.kind],
            message=reason.message,
            usage=gen_pb.Usage(prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion),
            timings=gen_pb.Timings(queue_s=queue_s, ttft_s=ttft_s, total_s=total_s),
        ),
    )
