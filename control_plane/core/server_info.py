"""GetServerInfo's answer: the model, and each attached worker's load, books and counters."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from control_plane.core.engine import Engine
from control_plane.core.fleet import Router
from control_plane.tenants.book import TenantBook
from control_plane.tokenizer import Tokenizer
from protos.stepwise.v1 import reports_pb2 as reports_pb


def server_info(
    router: Router[Engine], tokenizer: Tokenizer, version: str, *, model_path: str
) -> reports_pb.ServerInfo:
    engines = sorted(router.engines.values(), key=lambda e: e.limits.worker_id)
    workers = [_worker_info(e) for e in engines]
    limits = [e.limits for e in engines]
    return reports_pb.ServerInfo(
        model=router.model_name,
        model_path=model_path,
        model_fingerprint=router.model_fingerprint,
        max_context=min((lim.max_context for lim in limits), default=0),
        vocab_size=tokenizer.vocab_size,
        workers=workers,
        kv_capacity_tokens=sum(lim.kv_capacity_tokens for lim in limits),
        queued=sum(w.queued for w in workers),
        running=sum(w.running for w in workers),
        version=version,
    )


def _worker_info(engine: Engine) -> reports_pb.WorkerInfo:
    queued, running = engine.load()
    sched = engine.scheduler
    books = sched.books()
    return reports_pb.WorkerInfo(
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
        reported_live_seqs=engine.books.reported_kv[0],
        reported_seq_slots=engine.books.reported_kv[1],
        kv_mismatches=engine.books.kv_mismatches,
        wait_p50_s=_percentile(engine.step_log.waits, 50),
        wait_p99_s=_percentile(engine.step_log.waits, 99),
        wait_total_s=engine.step_log.wait_total_s,
        step_total_s=engine.step_log.step_total_s,
        steps=engine.steps,
        retractions=sched.num_retracted_total,
        leaving=engine.leaving is not None,
        prompt_tokens_total=engine.step_log.prompt_tokens_total,
        cached_tokens_total=engine.step_log.cached_tokens_total,
        transfer_address=engine.limits.transfer_address,
        migrated_out=engine.migration.migrated_out,
        migrated_in=engine.migration.migrated_in,
        migration_fallbacks=engine.migration.fallbacks,
        role=engine.limits.role,
    )


def _percentile(values: Iterable[float], q: float) -> float:
    window = list(values)
    return float(np.percentile(window, q)) if window else 0.0


def tenant_infos(book: TenantBook) -> list[reports_pb.TenantInfo]:
    """Per-tenant totals, bounded (TenantBook.report), with what each holds now."""
    infos = []
    report = book.report()
    held = book.held_now({name for name, _ in report})
    for name, served in report:
        concurrent, queued = held.get(name, (0, 0))
        infos.append(
            reports_pb.TenantInfo(
                name=name,
                requests=served.requests,
                rejected=served.rejected,
                prompt_tokens=served.prompt_tokens,
                output_tokens=served.output_tokens,
                concurrent=concurrent,
                queued=queued,
            )
        )
    return infos
