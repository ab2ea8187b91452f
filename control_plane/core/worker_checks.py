"""What the control plane checks of a worker before it believes it: its hello, then every result.

A worker is a peer, not a part of us: a hello with absurd figures would have the control plane
allocate for them, and a result with a token more or fewer than the plan sampled, or tokens
outside the vocabulary, would corrupt the books or reach clients. Both are refused here with a message that
names the field; a bad result is the worker's fault (`WorkerFault`), and costs that worker only.
"""

from __future__ import annotations

import re

import numpy as np

from control_plane.config import Limits
from protos.worker import ROLES, StepPlan, StepResult, WorkerLimits, sampled_count

MAX_PAGE_SIZE = 4096
MAX_CONTEXT = 1 << 26
MAX_VOCAB = 1 << 24
MAX_EOS_IDS = 64
MAX_LABEL_CHARS = 128
_WORKER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}")


class WorkerFault(Exception):
    """A worker broke the protocol: it is disconnected and its requests continue elsewhere."""


def hello_refusal(limits: WorkerLimits, bounds: Limits, tokenizer_vocab: int) -> str:
    """Why a hello cannot be believed ("" when it can); the message names the field and the bound."""
    checks = (
        (_WORKER_ID.fullmatch(limits.worker_id) is not None, "worker_id", "1-128 of [A-Za-z0-9._:@/-]"),
        (1 <= limits.page_size <= MAX_PAGE_SIZE, "page_size", f"in [1, {MAX_PAGE_SIZE}]"),
        (
            limits.page_size <= limits.kv_capacity_tokens <= bounds.max_worker_kv_tokens,
            "kv_capacity_tokens",
            f"in [page_size, {bounds.max_worker_kv_tokens}] (--max-worker-kv-tokens)",
        ),
        (
            limits.kv_capacity_tokens % max(limits.page_size, 1) == 0,
            "kv_capacity_tokens",
            "a multiple of page_size",
        ),
        (1 <= limits.max_context <= MAX_CONTEXT, "max_context", f"in [1, {MAX_CONTEXT}]"),
        (
            tokenizer_vocab <= limits.vocab_size <= MAX_VOCAB,
            "vocab_size",
            f"in [{tokenizer_vocab} (the tokenizer's), {MAX_VOCAB}]",
        ),
        (
            len(limits.eos_token_ids) <= MAX_EOS_IDS
            and all(0 <= t < limits.vocab_size for t in limits.eos_token_ids),
            "eos_token_ids",
            f"at most {MAX_EOS_IDS} ids, each in [0, vocab_size)",
        ),
        (
            0 <= limits.host_pool_capacity_tokens <= bounds.max_worker_kv_tokens,
            "host_pool_capacity_tokens",
            f"in [0, {bounds.max_worker_kv_tokens}] (--max-worker-kv-tokens)",
        ),
    )
    for ok, name, rule in checks:
        if not ok:
            return f"{name} {_shown(getattr(limits, name))} is not plausible: must be {rule}"
    if limits.role not in ROLES:
        return f"role {_shown(limits.role)} is not one of {', '.join(ROLES)}"
    if limits.role != "mixed" and not limits.transfer_address:
        return f"a {limits.role} worker must serve a KV transfer link (its requests move with their KV)"
    for name in ("dtype", "device", "model_fingerprint", "transfer_address"):
        if len(getattr(limits, name)) > MAX_LABEL_CHARS:
            return f"{name} is longer than {MAX_LABEL_CHARS} characters"
    return ""


def _shown(value: object) -> str:
    text = repr(sorted(value) if isinstance(value, frozenset) else value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_result(plan: StepPlan, result: StepResult, vocab_size: int) -> None:
    """Raise WorkerFault unless `result` answers `plan`: same step, one token per sampled sequence.

    The sampled sequences are the extends with `sample` set, then every decode, in plan order; the
    result carries exactly one token for each, in that order, each in [0, vocab_size).
    """
    if result.step_id != plan.step_id:
        raise WorkerFault(f"result for step {result.step_id} while step {plan.step_id} was in flight")
    expected = sampled_count(plan)
    tokens = result.token_ids
    if len(tokens) != expected:
        raise WorkerFault(
            f"step {plan.step_id}: result carries {len(tokens)} tokens, not one for each of the "
            f"{expected} sequences the plan sampled"
        )
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        bad = int(tokens.min()) if int(tokens.min()) < 0 else int(tokens.max())
        raise WorkerFault(f"step {plan.step_id}: token id {bad} is outside the vocabulary [0, {vocab_size})")
    _check_prompt_scores(plan, result)


def _check_prompt_scores(plan: StepPlan, result: StepResult) -> None:
    """One PromptScores per extend entry that scores, in entry order, with one row per scored
    position; the other entries none."""
    lens = plan.extends.score_lens
    asked = np.flatnonzero(lens).tolist() if len(lens) else []
    got = [s.entry for s in result.prompt_scores]
    if got != asked:
        raise WorkerFault(f"step {plan.step_id}: prompt scores for entries {got}, the plan scored {asked}")
    for scores in result.prompt_scores:
        if len(scores.rows) != int(lens[scores.entry]):
            raise WorkerFault(
                f"step {plan.step_id}: entry {scores.entry} has {len(scores.rows)} prompt scores, "
                f"the plan scored {int(lens[scores.entry])} positions"
            )
