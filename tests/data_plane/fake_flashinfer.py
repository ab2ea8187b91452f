"""A stand-in for the `flashinfer` package on CPU: the two paged-KV wrappers the flashinfer backend
uses, computed request by request from the page table exactly as FlashInfer documents it (NHD
layout, `indptr`/`indices` in CSR form, `last_page_len` tokens in each last page, causal queries at
the end of their keys, `window_left` keys to the left of a query).

It checks the backend's metadata and call contract, not FlashInfer's kernels: those only run on a
GPU (tests/gpu/run.sh)."""

from __future__ import annotations

import torch


class _PagedWrapper:
    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD") -> None:
        assert workspace.dtype == torch.uint8 and kv_layout == "NHD"
        self.planned: dict[str, object] | None = None
        self.runs = 0

    def _plan(
        self,
        qo_indptr: torch.Tensor | None,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        heads: tuple[int, int, int, int],
        causal: bool,
        window_left: int = -1,
        q_data_type: torch.dtype | None = None,
        kv_data_type: torch.dtype | None = None,
        sm_scale: float | None = None,
    ) -> None:
        for t in (indptr, indices, last_page_len, *(() if qo_indptr is None else (qo_indptr,))):
            assert t.dtype == torch.int32, "FlashInfer takes int32 index arrays"
        page_size = heads[3]
        assert bool(((last_page_len >= 1) & (last_page_len <= page_size)).all())
        assert len(indptr) == len(last_page_len) + 1 and int(indptr[-1]) == len(indices)
        self.planned = {
            "qo_indptr": qo_indptr,
            "indptr": indptr.tolist(),
            "indices": indices.long(),
            "last_page_len": last_page_len.tolist(),
            "heads": heads,
            "causal": causal,
            "window_left": window_left,
            "q_dtype": q_data_type,
            "scale": sm_scale,
        }

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        assert self.planned is not None, "run before plan"
        p = self.planned
        num_qo, num_kv, head_dim, page_size = p["heads"]  # type: ignore[misc]
        k_cache, v_cache = paged_kv_cache
        assert k_cache.shape[1:] == (page_size, num_kv, head_dim) and q.dtype == p["q_dtype"]
        indptr, last = p["indptr"], p["last_page_len"]
        qo = p["qo_indptr"].tolist() if p["qo_indptr"] is not None else list(range(len(last) + 1))  # type: ignore[union-attr]
        out = torch.empty_like(q)
        for b in range(len(last)):  # type: ignore[arg-type]
            pages = p["indices"][indptr[b] : indptr[b + 1]]  # type: ignore[index]
            kv_len = (len(pages) - 1) * page_size + last[b]  # type: ignore[index]
            keys = k_cache[pages].reshape(-1, num_kv, head_dim)[:kv_len]
            values = v_cache[pages].reshape(-1, num_kv, head_dim)[:kv_len]
            queries = q[qo[b] : qo[b + 1]]
            positions = torch.arange(kv_len - len(queries), kv_len)[:, None]
            key_pos = torch.arange(kv_len)[None, :]
            allowed = (
                key_pos <= positions if p["causal"] or len(queries) == 1 else torch.ones_like(key_pos > 0)
            )
            if p["window_left"] >= 0:  # type: ignore[operator]
                allowed = allowed & (key_pos >= positions - p["window_left"])  # type: ignore[operator]
            group = num_qo // num_kv
            k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
            v = values.repeat_interleave(group, dim=1).transpose(0, 1)
            scores = (queries.transpose(0, 1) @ k.transpose(1, 2)) * p["scale"]  # [Hq, n, L]
            scores = scores.masked_fill(~allowed[None], float("-inf"))
            out[qo[b] : qo[b + 1]] = (scores.softmax(-1) @ v).transpose(0, 1)
        self.runs += 1
        return out


class BatchDecodeWithPagedKVCacheWrapper(_PagedWrapper):
    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        **options: object,
    ) -> None:
        heads = (num_qo_heads, num_kv_heads, head_dim, page_size)
        self._plan(None, indptr, indices, last_page_len, heads, causal=True, **options)  # type: ignore[arg-type]


class BatchPrefillWithPagedKVCacheWrapper(_PagedWrapper):
    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        causal: bool = False,
        **options: object,
    ) -> None:
        heads = (num_qo_heads, num_kv_heads, head_dim_qk, page_size)
        args = (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, heads, causal)
        self._plan(*args, **options)  # type: ignore[arg-type]
