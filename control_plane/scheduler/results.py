"""Applying a worker's result (SGLang's process_batch_result): append tokens, run the finish checks
in SGLang's order, cache the KV of what finished."""

from __future__ import annotations

from control_plane.request import FinishReason, Request
from control_plane.scheduler.plan import StepResult
from control_plane.scheduler.planning import Planning
from control_plane.scheduler.state import RequestUpdate


class Results(Planning):
    """The worker's sampled tokens applied to the requests (SGLang's process_batch_result)."""

    def apply_result(self, result: StepResult) -> None:
        """Append sampled tokens, run finish checks, cache or free KV of finished requests."""
        batch = self.last_batch
        if batch is None:
            return
        sampled = dict(zip(result.handles.tolist(), result.token_ids.tolist(), strict=True))
        for req in batch.extend_reqs:
            self._apply_extend(req, sampled)
        for req in batch.decode_reqs:
            if req.finished:
                continue
            req.kv_committed_len += 1
            self._append_token(req, sampled[req.handle])

    def _apply_extend(self, req: Request, sampled: dict[int, int]) -> None:
        if req.finished:
            return
        if req.inflight_middle_chunks > 0:
            req.inflight_middle_chunks -= 1
            if req is self.chunked_req:
                return  # a middle chunk: nothing was sampled
        if req.max_new_tokens == 0 and not req.output_ids:
            self.kv.cache_finished_req(req, insert=True)
            self._finish(req, FinishReason.length("max_new_tokens"))
            return
        self._append_token(req, sampled[req.handle])
        if not req.finished:
            self._push_remap(self.kv.cache_unfinished_req(req))

    def _append_token(self, req: Request, token: int) -> None:
        req.append_output(token)
        reason, visible = self._check_finished(req, token)
        if reason is None:
            self._updates.append(RequestUpdate(req.rid, (token,)))
            return
        self.kv.cache_finished_req(req, insert=True)
        self._finish(req, reason, (token,) if visible else ())

    def _check_finished(self, req: Request, token: int) -> tuple[FinishReason | None, bool]:
        """SGLang's order: the length limit first, then a matched stop or EOS token (not streamed)."""
        if len(req.output_ids) >= req.max_new_tokens:
            matched = token in req.params.stop_token_ids or (
                not req.params.ignore_eos and token in self.limits.eos_token_ids
            )
            return FinishReason.length("max_new_tokens"), not matched
        if len(req.output_ids) < req.min_new_tokens:
            return None, True  # stop conditions do not count yet (§1.5 min_new_tokens)
        if token in req.params.stop_token_ids:
            return FinishReason.stop(f"stop token {token}"), False
        if not req.params.ignore_eos and token in self.limits.eos_token_ids:
            return FinishReason.stop("eos"), False
        return None, True
