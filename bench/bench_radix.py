"""Micro-benchmarks of the control plane's KV bookkeeping (not a test): `python bench/bench_radix.py`.

Figures: prefix match of a 2k-token key on a ~100k-node tree, insert with a split, eviction of a few
tokens from a ~100k-leaf tree, and batched decode allocation for 256 and 1024 sequences.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from array import array
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from control_plane.cache.allocator import SlotAllocator
from control_plane.cache.radix import RadixCache

KEY_LEN = 2048
TURN = 128
TURNS = KEY_LEN // TURN
VOCAB = 32_000


def percentiles(samples_ns: list[int]) -> str:
    us = np.array(samples_ns) / 1000
    return f"p50 {np.percentile(us, 50):7.2f} µs  p99 {np.percentile(us, 99):7.2f} µs  (n={len(us)})"


def time_each(fn: Callable[[], object], repeats: int) -> list[int]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - start)
    return samples


def build_chat_tree(num_nodes: int, page_size: int, seed: int) -> tuple[RadixCache, list[array]]:
    """A conversation tree: every node is one 128-token turn, and a conversation of 16 turns is a
    2k-token key. Each conversation continues a random earlier one after a random number of turns,
    and is inserted turn by turn (as a chat's requests would be), so each new turn is a new node and
    a 2k-token match walks 16 nodes."""
    rng = random.Random(seed)
    alloc = SlotAllocator(capacity=_capacity(num_nodes * TURN, page_size), page_size=page_size)
    tree = RadixCache(alloc, page_size=page_size)
    seqs: list[array] = []
    nodes = 0
    while nodes < num_nodes:
        base = rng.choice(seqs) if seqs else array("q")
        seq = base[: rng.randrange(0, len(base) // TURN + 1) * TURN]
        while len(seq) < KEY_LEN and nodes < num_nodes:
            seq = seq + array("q", (rng.randrange(VOCAB) for _ in range(TURN)))
            _insert_fresh(tree, seq)
            nodes += 1
        seqs.append(seq)
    return tree, seqs


def build_random_cut_tree(num_nodes: int, page_size: int, seed: int) -> tuple[RadixCache, list[array]]:
    """An adversarial shape: each insert shares a prefix of random length (any page boundary) with an
    earlier key and adds 32 tokens, so a 2k-token key crosses hundreds of short nodes. Shows the
    per-node cost of a match."""
    rng = random.Random(seed)
    alloc = SlotAllocator(capacity=_capacity(num_nodes * 32, page_size), page_size=page_size)
    tree = RadixCache(alloc, page_size=page_size)
    seqs = [array("q", [rng.randrange(VOCAB) for _ in range(KEY_LEN)])]
    _insert_fresh(tree, seqs[0])
    for _ in range(num_nodes // 2):  # about two nodes per insert: a split and a leaf
        base = rng.choice(seqs)
        cut = rng.randrange(0, len(base) // page_size) * page_size
        seq = (base[:cut] + array("q", [rng.randrange(VOCAB) for _ in range(32)]))[:KEY_LEN]
        _insert_fresh(tree, seq)
        seqs.append(seq)
    return tree, seqs


def _capacity(tokens: int, page_size: int) -> int:
    headroom = 2 * KEY_LEN + 20_000 * 16  # for bench_insert_split's keys and leaves
    return (tokens + headroom) // page_size * page_size


def _insert_fresh(tree: RadixCache, seq: array) -> None:
    alloc = tree.allocator
    assert alloc is not None
    slots = alloc.alloc(len(seq) - len(seq) % tree.page_size)
    assert slots is not None
    cached = tree.insert(seq[: len(slots)], slots)
    alloc.free(slots[:cached])


def bench_match(tree: RadixCache, seqs: list[array], repeats: int) -> None:
    deepest = max(seqs, key=lambda seq: (len(seq), len(_path(tree, seq))))
    depth = sum(1 for _ in _path(tree, deepest))
    as_list = list(deepest)
    as_numpy = np.array(deepest, dtype=np.int64)
    tree.match_prefix(deepest)
    print(f"match_prefix, {len(deepest)}-token key, path of {depth} nodes (same key repeated, hot cache):")
    print(f"  array('q') key : {percentiles(time_each(lambda: tree.match_prefix(deepest), repeats))}")
    print(f"  numpy key      : {percentiles(time_each(lambda: tree.match_prefix(as_numpy), repeats))}")
    print(f"  list key       : {percentiles(time_each(lambda: tree.match_prefix(as_list), repeats))}")
    full = [seq for seq in seqs if len(seq) == KEY_LEN]
    rng = random.Random(0)
    cold = [rng.choice(full) for _ in range(repeats)]
    samples = []
    for key in cold:  # a different stored key each time: nodes and keys come from cold cache lines
        start = time.perf_counter_ns()
        tree.match_prefix(key)
        samples.append(time.perf_counter_ns() - start)
    print(f"  random 2k keys : {percentiles(samples)}  (array('q'), cold paths)")
    miss = array("q", [VOCAB + 1]) + deepest[1:]
    print(f"  miss at root   : {percentiles(time_each(lambda: tree.match_prefix(miss), repeats))}")


def _path(tree: RadixCache, key: array) -> list[object]:
    node = tree.match_prefix(key).last_node
    path = []
    while node is not tree.root:
        path.append(node)
        node = node.parent  # type: ignore[assignment]
    return path


def bench_insert_split(tree: RadixCache, seqs: list[array], repeats: int, seed: int) -> None:
    """Each insert shares a prefix of an existing key that ends inside its last 128 tokens, so it
    diverges inside a deep node (spread over many paths, so the splits do not pile up on the shared
    top of the tree): one split and one new 16-token leaf."""
    rng = random.Random(seed)
    alloc = tree.allocator
    assert alloc is not None
    samples = []
    for _ in range(repeats):
        base = rng.choice(seqs)
        cut = max(len(base) - rng.randrange(1, TURN), 1) // tree.page_size * tree.page_size
        seq = base[:cut] + array("q", [rng.randrange(VOCAB) for _ in range(16)])
        slots = alloc.alloc(len(seq) - len(seq) % tree.page_size)
        assert slots is not None
        start = time.perf_counter_ns()
        cached = tree.insert(seq[: len(slots)], slots)
        samples.append(time.perf_counter_ns() - start)
        alloc.free(slots[:cached])
    print(f"insert with split (shared prefix < 2k, 16 new tokens): {percentiles(samples)}")


def bench_evict(num_leaves: int, repeats: int, seed: int) -> None:
    """A flat tree of `num_leaves` 4-token leaves under distinct first tokens, touched in random
    order; each sample evicts 8 tokens (2 leaves)."""
    rng = random.Random(seed)
    alloc = SlotAllocator(capacity=num_leaves * 4)
    tree = RadixCache(alloc)
    keys = [array("q", [i, 1, 2, 3]) for i in range(num_leaves)]
    for key in keys:
        tree.insert(key, alloc.alloc(4))
    for key in rng.sample(keys, k=num_leaves // 2):
        tree.match_prefix(key)
    samples = time_each(lambda: tree.evict(8), repeats)
    print(f"evict 8 tokens from a {num_leaves}-leaf tree (lru): {percentiles(samples)}")


def bench_decode_batch(batch: int, page_size: int, repeats: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    alloc = SlotAllocator(capacity=batch * 4096, page_size=page_size)
    seq_lens = rng.integers(1, 2048, size=batch)
    samples = []
    for _ in range(repeats):
        last_slots = np.empty(batch, dtype=np.int64)
        for i, n in enumerate(seq_lens):  # set up: each sequence owns pages up to position n - 1
            slots = alloc.alloc_extend(0, -1, int(n))
            assert slots is not None
            last_slots[i] = slots[-1]
        start = time.perf_counter_ns()
        out = alloc.alloc_decode_batch(seq_lens, last_slots)
        samples.append(time.perf_counter_ns() - start)
        assert out is not None
        alloc.clear()
    print(f"alloc_decode_batch, {batch:4d} sequences, page {page_size:2d}: {percentiles(samples)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() after each build (as a server would after warm-up)",
    )
    args = parser.parse_args()
    for builder in (build_chat_tree, build_random_cut_tree):
        for page_size in (1, 16):
            start = time.perf_counter()
            tree, seqs = builder(args.nodes, page_size, args.seed)
            if args.gc_freeze:  # keep the cyclic GC from rescanning 100k long-lived nodes
                gc.collect()
                gc.freeze()
            nodes = sum(1 for _ in tree.iter_nodes())
            print(f"\n== {builder.__name__}, page_size {page_size}: {nodes} nodes, ", end="")
            print(f"{tree.total_size()} tokens (built in {time.perf_counter() - start:.1f} s)")
            bench_match(tree, seqs, args.repeats)
            bench_insert_split(tree, seqs, args.repeats, args.seed)
    print()
    bench_evict(args.nodes, args.repeats, args.seed)
    for page_size in (1, 16):
        for batch in (256, 1024):
            bench_decode_batch(batch, page_size, 200, args.seed)


if __name__ == "__main__":
    main()
