"""Which worker serves a request: the same worker for the same routing key, else the least loaded."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable

import numpy as np

from control_plane.config import ControlConfig
from control_plane.engine import Engine
from control_plane.tokenizer import Tokenizer
from protos.stepwise.v1 import generation_pb2 as gen_pb


class Router:
    def __init__(self, model_name: str, on_change: Callable[[int], None] | None = None) -> None:
        self.model_name = model_name
        self.engines: dict[str, Engine] = {}
        self.model_fingerprint = ""
        self._on_change = on_change

    def has(self, worker_id: str) -> bool:
        return worker_id in self.engines

    def attach(self, engine: Engine) -> None:
        self.engines[engine.limits.worker_id] = engine
        self.model_fingerprint = self.model_fingerprint or engine.limits.model_fingerprint
        self._changed()

    def detach(self, engine: Engine) -> None:
        if self.engines.get(engine.limits.worker_id) is engine:
            del self.engines[engine.limits.worker_id]
        if not self.engines:
            self.model_fingerprint = ""
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(len(self.engines))

    def pick(self, routing_key: str = "") -> Engine | None:
        """A stable choice per routing key (hash over sorted worker ids); otherwise least loaded."""
        if not self.engines:
            return None
        if routing_key:
            ids = sorted(self.engines)
            return self.engines[ids[zlib.crc32(routing_key.encode()) % len(ids)]]
        return min(self.engines.values(), key=lambda e: (sum(e.load()), e.limits.worker_id))

    def successor(self, lost: Engine) -> Engine | None:
        """The least loaded other worker, to continue a lost worker's requests."""
        others = [e for e in self.engines.values() if e is not lost]
        return min(others, key=lambda e: (sum(e.load()), e.limits.worker_id), default=None)

    def find(self, rid: str) -> Engine | None:
        for engine in self.engines.values():
            if engine.knows(rid):
                return engine
        return None

    def stop_all(self) -> None:
        for engine in self.engines.values():
            engine.stop()

    def server_info(self, config: ControlConfig, tokenizer: Tokenizer, version: str) -> gen_pb.ServerInfo:
        workers = [
            self._worker_info(e) for e in sorted(self.engines.values(), key=lambda e: e.limits.worker_id)
        ]
        limits = [e.limits for e in self.engines.values()]
        return gen_pb.ServerInfo(
            model=self.model_name,
            model_fingerprint=self.model_fingerprint,
            max_context=min((lim.max_context for lim in limits), default=0),
            vocab_size=tokenizer.vocab_size,
            workers=workers,
            kv_capacity_tokens=sum(lim.kv_capacity_tokens for lim in limits),
            queued=sum(w.queued for w in workers),
            running=sum(w.running for w in workers),
            version=version,
        )

    @staticmethod
    def _worker_info(engine: Engine) -> gen_pb.WorkerInfo:
        queued, running = engine.load()
        sched = engine.scheduler
        books = sched.books()
        return gen_pb.WorkerInfo(
            worker_id=engine.limits.worker_id,
            device=engine.limits.device,
            dtype=engine.limits.dtype,
            kv_capacity_tokens=engine.limits.kv_capacity_tokens,
            page_size=sched.page_size,
            running=running,
            queued=queued,
            kv_used_tokens=sched.kv.used_tokens(),
            book_live_seqs=books[0],
            book_seq_slots=books[1],
            reported_live_seqs=engine.reported_kv[0],
            reported_seq_slots=engine.reported_kv[1],
            kv_mismatches=engine.kv_mismatches,
            wait_p50_s=_percentile(engine.waits, 50),
            wait_p99_s=_percentile(engine.waits, 99),
            wait_total_s=engine.wait_total_s,
            step_total_s=engine.step_total_s,
            steps=engine.steps,
            retractions=sched.num_retracted_total,
        )


def _percentile(values: Iterable[float], q: float) -> float:
    window = list(values)
    return float(np.percentile(window, q)) if window else 0.0
