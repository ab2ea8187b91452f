"""The Mooncake trace reader of `stepwise simulate` (docs/debugging.md#mooncake-traces): shared hash ids
give shared prompt prefixes, lengths are exact, bad lines are refused naming line and field, and the
replay flags rescale arrivals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from control_plane.record.files import read_entries
from control_plane.record.replay import replay_scheduler
from stepwise import simulate as sim
from stepwise.traces import block_tokens, load_mooncake, read_trace

EXCERPT = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_head300.jsonl"
VOCAB = 32000


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def write(tmp_path: Path, lines: list[object]) -> Path:
    path = tmp_path / "mc.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_the_excerpt_reads_with_exact_lengths_and_shared_blocks() -> None:
    trace = load_mooncake(EXCERPT, VOCAB, 512)
    raw = [json.loads(line) for line in EXCERPT.read_text().splitlines()]
    assert len(trace) == len(raw) == 300
    for req, line in zip(trace, raw, strict=True):
        ids = list(req.input_ids)
        assert len(ids) == len(req.input_ids) == line["input_length"]
        assert req.params.max_new_tokens == line["output_length"]
        assert req.arrival == line["timestamp"] / 1000
        assert all(3 <= t < VOCAB for t in ids)
    # Pairs share exactly their common leading blocks (the last block of the shorter prompt may be
    # partial), and nothing more: every pair of the first 30 (they share block 0 only) and every
    # pair of the excerpt that shares more than one block (22 pairs, up to 38 blocks).
    pairs = [(i, j) for i in range(30) for j in range(i)]
    pairs += [
        (i, j)
        for i in range(300)
        for j in range(i)
        if common_prefix(raw[i]["hash_ids"], raw[j]["hash_ids"]) > 1
    ]
    assert len(pairs) == 435 + 22
    prompts: dict[int, list[int]] = {}
    for i, j in pairs:
        a, b = raw[i], raw[j]
        blocks = common_prefix(a["hash_ids"], b["hash_ids"])
        expected = min(blocks * 512, a["input_length"], b["input_length"])
        pa = prompts.setdefault(i, list(trace[i].input_ids))
        pb = prompts.setdefault(j, list(trace[j].input_ids))
        assert common_prefix(pa, pb) == expected, (i, j)


def test_a_partial_block_is_a_prefix_of_the_whole() -> None:
    assert block_tokens(7, 100, VOCAB).tolist() == block_tokens(7, 512, VOCAB)[:100].tolist()
    assert block_tokens(7, 512, VOCAB).tolist() != block_tokens(8, 512, VOCAB).tolist()


def test_block_size_is_a_flag(tmp_path: Path) -> None:
    path = write(tmp_path, [{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1, 2, 3]}])
    trace = load_mooncake(path, VOCAB, 4)
    assert list(trace[0].input_ids)[:8] == list(load_mooncake(path, VOCAB, 4)[0].input_ids)[:8]
    with pytest.raises(sim.TraceError, match="hash_ids: 3 ids for input_length 10 in blocks of 8"):
        load_mooncake(path, VOCAB, 8)


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("{not json", "mc.jsonl:2: not JSON"),
        ("[1, 2]", "mc.jsonl:2: a line must be a JSON object"),
        ({"input_length": 4, "output_length": 1, "hash_ids": [1]}, "mc.jsonl:2: missing field 'timestamp'"),
        ({"timestamp": -1, "input_length": 4, "output_length": 1, "hash_ids": [1]}, "mc.jsonl:2: timestamp"),
        ({"timestamp": 5, "input_length": 0, "output_length": 1, "hash_ids": []}, "mc.jsonl:2: input_length"),
        (
            {"timestamp": 5, "input_length": 4, "output_length": "1", "hash_ids": [1]},
            "mc.jsonl:2: output_length",
        ),
        ({"timestamp": 5, "input_length": 4, "output_length": 1, "hash_ids": ["a"]}, "mc.jsonl:2: hash_ids"),
        (
            {"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [1]},
            "mc.jsonl:2: hash_ids: 1 ids",
        ),
        (
            {"timestamp": 1, "input_length": 4, "output_length": 1, "hash_ids": [1]},
            "mc.jsonl:2: timestamp 1 is before",
        ),
    ],
)
def test_a_bad_line_is_named_with_its_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: object, words: str
) -> None:
    path = write(tmp_path, [{"timestamp": 2, "input_length": 4, "output_length": 1, "hash_ids": [0]}, line])
    assert sim.main([str(path), "--trace-format", "mooncake", "--summary-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stepwise simulate: ") and words in err
    assert len(err.splitlines()) == 1


def test_limit_and_scales(tmp_path: Path) -> None:
    ns = sim.build_parser().parse_args(
        [
            str(EXCERPT),
            "--trace-format",
            "mooncake",
            "--limit",
            "50",
            "--time-scale",
            "0.5",
            "--load-scale",
            "2",
        ]
    )
    trace = read_trace(ns, VOCAB)
    full = load_mooncake(EXCERPT, VOCAB, 512)
    assert len(trace) == 50
    assert [r.arrival for r in trace] == [r.arrival / 4 for r in full[:50]]


def test_the_excerpt_simulates(capsys: pytest.CaptureFixture[str]) -> None:
    flags = [str(EXCERPT), "--trace-format", "mooncake", "--limit", "60", "--summary-only"]
    assert sim.main([*flags, "--max-context", "131072", "--schedule-policy", "lpm"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])["summary"]
    assert summary["requests"] == 60
    assert summary["finish_reasons"] == {"length": 60}
    assert summary["cached_tokens"] > 0


@pytest.mark.parametrize(
    "policy",
    [
        ["--schedule-policy", "lpm-aging", "--cache-aware-queue-limit", "0", "--max-queue-wait-s", "0.5"],
        ["--schedule-policy", "hrrn", "--cache-aware-queue-limit", "0"],
        ["--schedule-policy", "shortest-prefill-first"],
    ],
    ids=["lpm-aging+bound", "hrrn", "spf"],
)
def test_deep_queue_policies_replay_identically(tmp_path: Path, policy: list[str]) -> None:
    """Kept matches, the queue clock and the bound read only what a recording holds: replaying the
    recorded calls into a fresh scheduler gives the same plans, past 128 waiting."""
    lines = [
        {
            "rid": f"s{i}",
            "arrival": round(i * 0.002, 6),
            "prompt_len": 300,
            "prefix_group": f"g{(i * 7) % 60}",
            "prefix_len": 200,
            "max_new_tokens": 8,
        }
        for i in range(600)
    ]
    trace = write(tmp_path, lines)
    rec = tmp_path / "rec"
    flags = [str(trace), "--kv-tokens", "20000", "--summary-only", "--record", str(rec), *policy]
    assert sim.main(flags) == 0
    report = replay_scheduler(list(read_entries(rec)))
    assert report.identical, report.describe()
    assert report.counts["plans"] > 50
