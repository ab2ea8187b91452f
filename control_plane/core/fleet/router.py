"""Which worker serves a request.

The same worker for the same routing key; otherwise the worker whose prefix cache holds the longest
part of the prompt, unless the load is imbalanced, and the least loaded when no cache helps. The
control plane owns every attached worker's radix tree, so the match is exact (SGLang's gateway keeps
an approximate tree of its own for this). Imbalance is SGLang gateway's rule and defaults: the
busiest and the idlest worker differ by more than `balance_abs_threshold` requests AND the busiest
has more than `balance_rel_threshold` times the idlest's load.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable
from typing import Generic, TypeVar

import numpy as np

from control_plane import metrics
from control_plane.cache.radix import as_token_bytes
from control_plane.config import RoutingConfig
from control_plane.core.fleet.member import Member

M = TypeVar("M", bound=Member)


class Router(Generic[M]):
    def __init__(
        self,
        model_name: str,
        on_change: Callable[[int], None] | None = None,
        routing: RoutingConfig | None = None,
    ) -> None:
        self.model_name = model_name
        self.engines: dict[str, M] = {}
        self.model_fingerprint = ""
        self._on_change = on_change
        self.routing = routing or RoutingConfig()
        # How each choice was made: "key", "cache", "load" (no cache helped) or "balance" (imbalanced).
        self.decisions: Counter[str] = Counter()

    def has(self, worker_id: str) -> bool:
        return worker_id in self.engines

    def attach(self, engine: M) -> None:
        self.engines[engine.limits.worker_id] = engine
        self.model_fingerprint = self.model_fingerprint or engine.limits.model_fingerprint
        self._changed()

    def detach(self, engine: M) -> None:
        if self.engines.get(engine.limits.worker_id) is engine:
            del self.engines[engine.limits.worker_id]
        if not self.engines:
            self.model_fingerprint = ""
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(len(self.engines))

    def available(self) -> list[M]:
        """Attached engines that are not leaving (draining or moving away) and whose loop has not
        ended (an engine stays attached until its session's last message is out), in order of
        attachment: the ones a new request may go to."""
        return [e for e in self.engines.values() if e.serving]

    def pick(self, routing_key: str = "", input_ids: np.ndarray | None = None) -> M | None:
        """The engine for a new request (None when no worker can take it); see the module docstring."""
        engine, how = self._choose(routing_key, input_ids)
        if engine is not None:
            self.decisions[how] += 1
            metrics.ROUTING_DECISIONS.labels(how).inc()
        return engine

    def takers(self) -> list[M]:
        """The engines a new request may go to: prefill and mixed workers, or, when none serves,
        decode workers (a decode worker can prefill: better than refusing the request)."""
        available = self.available()
        return [e for e in available if e.limits.role != "decode"] or available

    def _choose(self, routing_key: str, input_ids: np.ndarray | None) -> tuple[M | None, str]:
        candidates = self.takers()
        if not candidates:
            return None, ""
        if routing_key:
            ordered = sorted(candidates, key=lambda e: e.limits.worker_id)
            return ordered[zlib.crc32(routing_key.encode()) % len(ordered)], "key"
        loads = [sum(e.load()) for e in candidates]
        least = min(range(len(candidates)), key=lambda i: (loads[i], candidates[i].limits.worker_id))
        if len(candidates) == 1 or not self.routing.cache_aware or input_ids is None or not len(input_ids):
            return candidates[least], "load"
        busiest, idlest = max(loads), loads[least]
        if (
            busiest - idlest > self.routing.balance_abs_threshold
            and busiest > self.routing.balance_rel_threshold * idlest
        ):
            return candidates[least], "balance"
        tokens = as_token_bytes(input_ids)
        cached = [e.scheduler.kv.tree.cached_len(tokens) for e in candidates]
        best = min(
            range(len(candidates)), key=lambda i: (-cached[i], loads[i], candidates[i].limits.worker_id)
        )
        if cached[best] == 0:
            return candidates[least], "load"
        return candidates[best], "cache"

    def successor(self, lost: M) -> M | None:
        """The least loaded other worker that is not leaving, to continue a lost worker's requests."""
        others = [e for e in self.available() if e is not lost]
        return min(others, key=lambda e: (sum(e.load()), e.limits.worker_id), default=None)

    def find(self, rid: str) -> M | None:
        for engine in self.engines.values():
            if engine.knows(rid):
                return engine
        return None

    def stop_all(self) -> None:
        for engine in self.engines.values():
            engine.stop()
