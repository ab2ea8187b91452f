"""SGLang's native `POST /generate`, translated into Generate calls.

The request: `text` (one or a list) or `input_ids` (one list or a list of lists), `sampling_params`
in SGLang's names, `rid`, `stream`, and SGLang's log probability fields. The answer, per prompt and
sample: `{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens", ...}}`, a list
of them for a batch (a list of prompts, or n > 1), ordered prompt by prompt, sample by sample.
Streamed, each event is the choice's state so far (its whole text, all its ids and log
probabilities), with `index` for a batch, then `data: [DONE]`; as SGLang streams by default.

Log probabilities, as SGLang gives them: `[logprob, token_id, text or None]` per position. With
`return_logprob` and `logprob_start_len` -1 (the default) SGLang scores the prompt from its last
token, whose position carries no log probability: `input_token_logprobs` is then
`[[null, last_prompt_token_id, ...]]`, made here without asking the model for anything.
"""

from __future__ import annotations

import ast
import uuid
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from clients.client import generate_request
from flagtypes import INT32_MAX, UINT64_MAX
from gateway import limits
from gateway.errors import GatewayError, invalid
from gateway.formats import Collected, Event, ResponseFormat
from gateway.logprobs import sglang_ids, sglang_token, sglang_top
from gateway.schemas import (
    Count,
    Int32,
    SamplingFields,
    StopStrings,
    StopTokenIds,
    Text,
    check_stop_chars,
    refuse_extra_fields,
)
from gateway.structured import Constraint, one_constraint, refuse_with_ignore_eos, schema_text
from gateway.tokens import TokenCodec
from protos.stepwise.v1 import generation_pb2 as gen_pb

# SGLang's default when sampling_params does not name max_new_tokens.
DEFAULT_MAX_NEW_TOKENS = 128
MAX_PROMPTS = limits.MAX_PROMPTS


class SglangSampling(BaseModel):
    """SGLang's `sampling_params`. Its fields that ask for nothing at their default (keeping special
    tokens out of the text, ...) are accepted there only."""

    model_config = ConfigDict(extra="allow")

    max_new_tokens: Count | None = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: Count | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0, le=1)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    stop: Text | StopStrings | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool | None = False
    n: int | None = Field(default=1, ge=1, le=INT32_MAX)
    logit_bias: dict[Text, float] | None = None
    sampling_seed: int | None = Field(default=None, ge=0, le=UINT64_MAX)
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    no_stop_trim: bool | None = False
    # SGLang's output constraints (at most one): a JSON Schema as text, a regular expression, a
    # GBNF grammar, a structural tag as JSON text.
    json_schema: Text | None = None
    regex: Text | None = None
    ebnf: Text | None = None
    structural_tag: Text | None = None

    def constraint(self) -> Constraint | None:
        p = "sampling_params."
        found = [
            None
            if self.json_schema is None
            else Constraint(
                f"{p}json_schema", "json_schema", schema_text(f"{p}json_schema", self.json_schema)
            ),
            None if self.regex is None else Constraint(f"{p}regex", "regex", self.regex),
            None if self.ebnf is None else Constraint(f"{p}ebnf", "ebnf", self.ebnf),
            None
            if self.structural_tag is None
            else Constraint(f"{p}structural_tag", "structural_tag", self.structural_tag),
        ]
        constraint = one_constraint(found)
        refuse_with_ignore_eos(constraint, bool(self.ignore_eos), f"{p}ignore_eos")
        return constraint

    def renames(self) -> dict[str, str]:
        constraint = self.constraint()
        return constraint.renames() if constraint is not None else {}

    def refuse_unsupported(self) -> None:
        check_stop_chars(self.stop, "sampling_params.stop")
        refuse_extra_fields(self, "sampling_params.")
        self.constraint()
        if self.skip_special_tokens is False:
            raise invalid("sampling_params.skip_special_tokens", "not supported (special tokens are skipped)")
        if self.spaces_between_special_tokens is False:
            raise invalid("sampling_params.spaces_between_special_tokens", "not supported")
        if self.no_stop_trim:
            raise invalid("sampling_params.no_stop_trim", "not supported (a stop string is never sent)")

    def sampling(self) -> gen_pb.SamplingParams:
        fields = SamplingFields.model_construct(
            max_tokens=self.max_new_tokens,
            min_tokens=self.min_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=bool(self.ignore_eos),
            seed=self.sampling_seed,
            n=self.n or 1,
            logit_bias=self.logit_bias,
        )
        try:
            sampling = fields.sampling()
        except GatewayError as exc:
            if exc.param == "logit_bias":
                raise invalid("sampling_params.logit_bias", exc.message.partition(": ")[2]) from None
            raise
        constraint = self.constraint()
        if constraint is not None:
            constraint.apply(sampling)
        return sampling


# The protocol's fields (as the gateway's errors name them) and /generate's names for them.
PARAMS = {
    "max_tokens": "sampling_params.max_new_tokens",
    "min_tokens": "sampling_params.min_new_tokens",
    "seed": "sampling_params.sampling_seed",
    "top_logprobs": "top_logprobs_num",
    **{
        name: f"sampling_params.{name}"
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
            "stop",
            "stop_token_ids",
            "n",
            "logit_bias",
        )
    },
}


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    text: Text | Annotated[list[Text], Field(max_length=MAX_PROMPTS)] | None = None
    input_ids: list[Int32] | Annotated[list[list[Int32]], Field(max_length=MAX_PROMPTS)] | None = None
    sampling_params: SglangSampling = Field(default_factory=SglangSampling)
    rid: Text | list[Text] | None = None
    stream: bool = False
    return_logprob: bool | None = False
    logprob_start_len: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    top_logprobs_num: Count | None = None
    token_ids_logprob: list[Int32] | None = None
    return_text_in_logprobs: bool = False

    def refuse_unsupported(self) -> None:
        refuse_extra_fields(self)
        self.sampling_params.refuse_unsupported()
        if (self.text is None) == (self.input_ids is None):
            raise invalid("text", "give either text or input_ids")
        if self.input_ids is not None and not self.input_ids:
            raise invalid("input_ids", "must not be empty")
        if not self.return_logprob:
            for name in ("top_logprobs_num", "token_ids_logprob"):
                if getattr(self, name):
                    raise invalid(name, "needs return_logprob: true")
            if self.logprob_start_len not in (None, -1):
                raise invalid("logprob_start_len", "needs return_logprob: true")

    @property
    def batch(self) -> bool:
        """A list of prompts, or n > 1: SGLang answers with a list."""
        many = isinstance(self.text, list) or bool(self.input_ids and isinstance(self.input_ids[0], list))
        return many or self.n() > 1

    def n(self) -> int:
        return self.sampling_params.n or 1

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.text, list):
            prompts: list[str | list[int]] = list(self.text)
        elif self.text is not None:
            prompts = [self.text]
        elif self.input_ids and isinstance(self.input_ids[0], list):
            prompts = list(self.input_ids)  # type: ignore[arg-type]
        else:
            prompts = [self.input_ids]  # type: ignore[list-item]
        if not prompts:
            raise invalid("text" if self.text is not None else "input_ids", "no prompt")
        if len(prompts) > MAX_PROMPTS:
            raise invalid("text" if self.text is not None else "input_ids", f"at most {MAX_PROMPTS} prompts")
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, list) and not prompt:
                raise invalid(f"input_ids.{i}", "must not be empty")
        return prompts

    def scores_last_prompt_token(self) -> bool:
        """SGLang's default: return_logprob with logprob_start_len -1 scores the last prompt token."""
        return bool(self.return_logprob) and self.logprob_start_len in (None, -1)

    def needs_tokenizer(self, prompts: list[str | list[int]]) -> bool:
        """A text prompt's last token id is the tokenizer's to say."""
        return self.scores_last_prompt_token() and any(isinstance(p, str) for p in prompts)

    def rids(self, prompts: int) -> list[str]:
        """Per prompt its Generate call's request id: `rid`, `RID_i` for a batch as SGLang numbers
        them, the list given, or a random hex id."""
        if isinstance(self.rid, list):
            if len(self.rid) != prompts:
                raise invalid("rid", f"{len(self.rid)} request ids for {prompts} prompts")
            return list(self.rid)
        if self.rid is None:
            return [uuid.uuid4().hex for _ in range(prompts)]
        if prompts == 1 and not isinstance(self.text, list) and not self._id_batch():
            return [self.rid]
        return [f"{self.rid}_{i}" for i in range(prompts)]

    def _id_batch(self) -> bool:
        return bool(self.input_ids and isinstance(self.input_ids[0], list))

    def grpc_requests(self, prompts: list[str | list[int]], rids: list[str]) -> list[gen_pb.GenerateRequest]:
        sampling = self.sampling_params.sampling()
        if self.return_logprob:
            sampling.logprobs = True
            if self.top_logprobs_num:
                sampling.top_logprobs = self.top_logprobs_num
            sampling.token_ids_logprob.extend(self.token_ids_logprob or ())
            if not self.scores_last_prompt_token():
                sampling.logprob_start_len = self.logprob_start_len or 0
        return [generate_request(p, sampling, rid) for p, rid in zip(prompts, rids, strict=True)]


class SglangFormat(ResponseFormat):
    """`/generate`'s answer, streamed (each event the choice so far) or whole."""

    def __init__(
        self,
        body: GenerateBody,
        prompts: list[str | list[int]],
        tokenizer: TokenCodec | None,
        prompt_ids: list[list[int] | None] | None = None,
    ) -> None:
        """`prompt_ids`: per prompt its token ids where known (a text prompt's, tokenized off the
        event loop), for its `prompt_tokens` before it finishes and SGLang's default start."""
        self.body = body
        self.prompts = prompts
        self.tokenizer = tokenizer
        self.rids = body.rids(len(prompts))
        self.n = body.n()
        known = prompt_ids or [p if isinstance(p, list) else None for p in prompts]
        self._prompt_ids = {i: ids for i, ids in enumerate(known) if ids is not None}

    # --- the pieces of one choice -------------------------------------------------------------

    def _ids_of(self, prompt: int) -> list[int]:
        """The prompt's token ids; empty for a text prompt not tokenized here."""
        return self._prompt_ids.get(prompt, [])

    def _decode_one(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else None

    def _input_logprobs(self, prompt: int, collected: Collected) -> dict[str, Any]:
        if self.body.scores_last_prompt_token():
            # SGLang's default start: the last prompt token alone, which carries no number.
            last = self._ids_of(prompt)[-1]
            positions = [gen_pb.TokenLogprob(token_id=last, token=self._decode_one(last) or "")]
        else:
            scored = collected.prompt_logprobs.get(prompt)
            positions = list(scored.positions) if scored is not None else []
        return self._logprobs("input", positions)

    def _logprobs(self, side: str, positions: list[gen_pb.TokenLogprob]) -> dict[str, Any]:
        """SGLang's `{side}_token_logprobs`, and `{side}_top_logprobs` / `{side}_token_ids_logprobs`
        when asked for."""
        body, text = self.body, self.body.return_text_in_logprobs
        asked = list(body.token_ids_logprob or ())
        entries: dict[str, Any] = {f"{side}_token_logprobs": [sglang_token(p, text) for p in positions]}
        if body.top_logprobs_num:
            entries[f"{side}_top_logprobs"] = [sglang_top(p, text) for p in positions]
        if asked:
            entries[f"{side}_token_ids_logprobs"] = [
                sglang_ids(p, asked, text, self._decode_one) for p in positions
            ]
        return entries

    def _finish_reason(
        self, reason: str | None, message: str, completion_tokens: int
    ) -> dict[str, Any] | None:
        """SGLang's finish reasons: `{"type": "stop", "matched": id or string}` (EOS, a stop token
        id, a stop string), `{"type": "length", "length": n}`; and ours,
        `{"type": "grammar_unsatisfiable", "message": why}` (the output's grammar could not be
        satisfied)."""
        if reason is None:
            return None
        if reason == "length":
            return {"type": "length", "length": completion_tokens}
        if reason == "grammar_unsatisfiable":
            return {"type": reason, "message": message}
        matched: int | str | None = None
        if message.startswith("stop token "):
            matched = int(message.removeprefix("stop token "))
        elif message.startswith("stop string "):
            matched = ast.literal_eval(message.removeprefix("stop string "))
        elif message == "eos":
            eos = sorted(getattr(self.tokenizer, "eos_token_ids", ()))
            matched = eos[0] if len(eos) == 1 else None
        return {"type": "stop", "matched": matched}

    def _choice(self, index: int, collected: Collected) -> dict[str, Any]:
        prompt, sample = divmod(index, self.n)
        choice = collected.choices[index]
        finished = choice.finish_reason is not None
        rid = self.rids[prompt] if self.n == 1 else f"{self.rids[prompt]}_{sample}"
        usage = collected.prompt_usage.get(prompt)
        if usage is not None:
            prompt_tokens, cached = usage
        else:  # streaming, before the prompt's first sample finished
            scored = collected.prompt_logprobs.get(prompt)
            prompt_tokens = scored.start + len(scored.positions) if scored else len(self._ids_of(prompt))
            cached = 0
        completion = choice.completion_tokens if finished else len(choice.token_ids)
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": self._finish_reason(choice.finish_reason, choice.finish_message, completion),
            "prompt_tokens": prompt_tokens,
        }
        if self.body.return_logprob:
            meta.update(self._input_logprobs(prompt, collected))
            meta.update(self._logprobs("output", list(choice.logprobs)))
        meta["completion_tokens"] = completion
        meta["cached_tokens"] = cached
        if finished:
            meta["e2e_latency"] = choice.total_s
        return {"text": choice.text, "output_ids": list(choice.token_ids), "meta_info": meta}

    # --- ResponseFormat -------------------------------------------------------------------------

    def events(self, event: Event, collected: Collected) -> list[dict[str, Any]]:
        if event.index < 0 or not (event.token_ids or event.text or event.finish_reason):
            return []
        data = self._choice(event.index, collected)
        if self.body.batch:
            data["index"] = event.index
        return [data]

    def whole(self, collected: Collected) -> Any:
        choices = [self._choice(i, collected) for i in range(len(collected.choices))]
        return choices if self.body.batch else choices[0]
