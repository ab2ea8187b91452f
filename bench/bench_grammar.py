"""Grammar backends side by side (not a test): `python bench/bench_grammar.py`.

Per installed backend (grammars/) and tokenizer, it prints:

- backend build: the per-tokenizer set-up a worker pays once (llguidance's token trie, xgrammar's
  TokenizerInfo and compiler);
- compile: ten realistic grammars (eight JSON schemas, from a flat enum to an OpenAI tool call,
  a regex and an EBNF grammar), first compile and again (a cache hit where the backend has a
  cache: xgrammar's compiler keeps one; llguidance has none and repeats the work), wall ms;
- matcher start: µs to start one matcher on a compiled grammar (a worker does it per request);
- mask fill: µs of wall and of CPU per row per step at batch 64, each row walking a valid
  output of one of the ten grammars (a row whose output ends starts again; that start is not in
  the figure), two rounds, so each figure is printed twice;
- memory: resident growth per matcher for 1,024 matchers part-way through the tool-call schema
  (and xgrammar's own figure for the compiled grammar's tables).

Tokenizers: the embedded model's (1k), SmolLM2-135M's (49k) when the local cache has it, and a
~150k one built here offline from SmolLM2's (or, without it, the embedded one's): its vocabulary
plus random merged pairs of its tokens and byte-level CJK characters, with their merges, to
150,000 tokens. Last, the installed size of each backend's packages that Stepwise does not
already depend on (`du` of the package folders and their dist-info).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenizers import Tokenizer

from grammars import backend
from grammars.spec import GrammarSpec

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "stepwise/assets/embedded/tokenizer.json"
SMOLLM2 = Path.home() / ".cache/stepwise/smollm2-135m-instruct/tokenizer.json"
BIG_VOCAB = 150_000
BATCH = 64
MATCHERS = 1024

TOOL_CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "City and country, e.g. Paris, France"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["location", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
# (name, spec, a valid output)
GRAMMARS: list[tuple[str, GrammarSpec, str]] = [
    (
        "enum",
        GrammarSpec("json_schema", json.dumps({"enum": ["positive", "negative", "neutral"]})),
        '"neutral"',
    ),
    (
        "person",
        GrammarSpec(
            "json_schema",
            json.dumps(
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "age": {"type": "integer", "minimum": 0},
                        "email": {"type": "string", "format": "email"},
                    },
                    "required": ["name", "age"],
                }
            ),
        ),
        '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"}',
    ),
    (
        "nested",
        GrammarSpec(
            "json_schema",
            json.dumps(
                {
                    "type": "object",
                    "properties": {
                        "order": {
                            "type": "object",
                            "properties": {
                                "id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
                                "customer": {
                                    "type": "object",
                                    "properties": {
                                        "name": {"type": "string"},
                                        "address": {
                                            "type": "object",
                                            "properties": {
                                                "street": {"type": "string"},
                                                "city": {"type": "string"},
                                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                            },
                                            "required": ["street", "city", "zip"],
                                        },
                                    },
                                    "required": ["name", "address"],
                                },
                            },
                            "required": ["id", "customer"],
                        }
                    },
                    "required": ["order"],
                }
            ),
        ),
        '{"order": {"id": "ORD-123456", "customer": {"name": "Bo", "address": {"street": "1 Main St", '
        '"city": "Oslo", "zip": "01234"}}}}',
    ),
    (
        "array",
        GrammarSpec(
            "json_schema",
            json.dumps(
                {
                    "type": "object",
                    "properties": {
                        "tags": {
                            "type": "array",
                            "items": {"type": "string", "maxLength": 12},
                            "minItems": 1,
                            "maxItems": 5,
                        },
                        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
                    },
                    "required": ["tags"],
                }
            ),
        ),
        '{"tags": ["fast", "cheap"], "scores": [0.5, 2]}',
    ),
    (
        "anyof",
        GrammarSpec(
            "json_schema",
            json.dumps(
                {
                    "type": "object",
                    "properties": {
                        "result": {
                            "anyOf": [
                                {
                                    "type": "object",
                                    "properties": {"ok": {"type": "boolean"}},
                                    "required": ["ok"],
                                },
                                {
                                    "type": "object",
                                    "properties": {"error": {"type": "string"}},
                                    "required": ["error"],
                                },
                                {"type": "null"},
                            ]
                        }
                    },
                    "required": ["result"],
                }
            ),
        ),
        '{"result": {"error": "timeout"}}',
    ),
    (
        "patterns",
        GrammarSpec(
            "json_schema",
            json.dumps(
                {
                    "type": "object",
                    "properties": {
                        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                        "phone": {"type": "string", "pattern": "^\\+[0-9]{1,3} [0-9]{3}-[0-9]{4}$"},
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2,4}$"},
                    },
                    "required": ["date", "phone", "sku"],
                }
            ),
        ),
        '{"date": "2026-12-02", "phone": "+47 555-0100", "sku": "ABC123"}',
    ),
    (
        "defs",
        GrammarSpec(
            "json_schema",
            json.dumps(
                {
                    "$defs": {
                        "node": {
                            "type": "object",
                            "properties": {
                                "value": {"type": "integer"},
                                "children": {
                                    "type": "array",
                                    "items": {"$ref": "#/$defs/node"},
                                    "maxItems": 3,
                                },
                            },
                            "required": ["value"],
                        }
                    },
                    "$ref": "#/$defs/node",
                }
            ),
        ),
        '{"value": 1, "children": [{"value": 2}, {"value": 3, "children": []}]}',
    ),
    (
        "tool_call",
        GrammarSpec("json_schema", json.dumps(TOOL_CALL)),
        json.dumps(
            {"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius", "days": 3}}
        ),
    ),
    (
        "regex",
        GrammarSpec("regex", r"[a-z][a-z0-9._]{0,15}@[a-z0-9]{1,12}\.(com|org|net)"),
        "jane.doe@example.com",
    ),
    (
        "ebnf",
        GrammarSpec(
            "ebnf",
            'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n'
            'factor ::= num | "(" expr ")"\nnum ::= [0-9]+',
        ),
        "(12+3)*4-5/6",
    ),
]


def big_tokenizer(base_text: str, size: int, seed: int = 0) -> str:
    """A byte-level BPE tokenizer of `size` tokens, from `base_text`'s: merged pairs of its tokens
    (as further BPE merges would make) and multi-byte CJK characters, each with the merges that
    reach it, so the result loads and encodes like a real large tokenizer."""
    rng = np.random.default_rng(seed)
    document = json.loads(base_text)
    model = document["model"]
    vocab: dict[str, int] = model["vocab"]
    merges: list = model["merges"]
    added = {item["content"] for item in document["added_tokens"]}
    byte_char = _bytes_to_unicode()
    next_id = max([*vocab.values(), *(item["id"] for item in document["added_tokens"])]) + 1

    def add(left: str, right: str) -> None:
        nonlocal next_id
        if left + right in vocab or left + right in added:
            return
        vocab[left + right] = next_id
        merges.append([left, right])
        next_id += 1

    for code in range(0x4E00, 0x4E00 + 12_000):
        b = [byte_char[x] for x in chr(code).encode("utf-8")]
        for piece in (b[0], b[1], b[2]):
            if piece not in vocab:
                vocab[piece] = next_id
                next_id += 1
        add(b[0], b[1])
        add(b[0] + b[1], b[2])
    pieces = [t for t in vocab if t not in added]
    while next_id < size:
        left, right = rng.choice(len(pieces), 2)
        add(pieces[left], pieces[right])
    return json.dumps(document)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character table (printable bytes stand for themselves, the rest shifted
    past U+0100), which byte-level vocabularies are written in."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in kept}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def rss_bytes() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096


def bench_one(name: str, label: str, text: str, eos: tuple[int, ...]) -> None:
    tokenizer = Tokenizer.from_str(text)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    started = time.perf_counter()
    back = backend.create(name, text, vocab, eos)
    build = time.perf_counter() - started
    print(f"\n{name} on {label} ({vocab:,} tokens): backend build {build * 1000:.0f} ms")
    compiled = {}
    rows = []
    for gname, spec, _ in GRAMMARS:
        started = time.perf_counter()
        compiled[gname] = back.compile(spec)
        first = time.perf_counter() - started
        started = time.perf_counter()
        back.compile(spec)
        again = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(20):
            back.matcher(compiled[gname])
        start_us = (time.perf_counter() - started) / 20 * 1e6
        rows.append((gname, first * 1000, again * 1000, start_us))
    print(f"  {'grammar':<10} {'first ms':>9} {'again ms':>9} {'matcher start µs':>17}")
    for gname, first, again, start_us in rows:
        print(f"  {gname:<10} {first:9.2f} {again:9.3f} {start_us:17.1f}")
    firsts = [r[1] for r in rows]
    print(
        f"  compile first: total {sum(firsts):.1f} ms, median {np.median(firsts):.2f} ms,"
        f" max {max(firsts):.1f} ms;"
        f" again: total {sum(r[2] for r in rows):.2f} ms"
    )
    outputs = {g: tokenizer.encode(out, add_special_tokens=False).ids for g, _, out in GRAMMARS}
    names = [g for g, _, _ in GRAMMARS]
    words = np.zeros((BATCH, backend.mask_words(vocab)), dtype=np.int32)
    row_grammar = [names[i % len(names)] for i in range(BATCH)]
    matchers = [back.matcher(compiled[g]) for g in row_grammar]
    positions = [(i * 3) % len(outputs[g]) for i, g in enumerate(row_grammar)]
    for i, g in enumerate(row_grammar):  # stagger the rows, as a running batch is
        for token in outputs[g][: positions[i]]:
            assert matchers[i].accept(token)
    steps = 48
    for round_ in (1, 2):
        cpu = 0.0
        each: list[int] = []
        for _ in range(steps):
            # Each row's fill timed on its own (a second fill of an unchanged state would hit
            # llguidance's mask cache), the step's CPU around them all.
            c0 = time.process_time()
            for i, matcher in enumerate(matchers):
                t0 = time.perf_counter_ns()
                matcher.fill(words[i])
                each.append(time.perf_counter_ns() - t0)
            cpu += time.process_time() - c0
            for i, g in enumerate(row_grammar):
                token = outputs[g][positions[i]]
                assert words[i, token // 32] >> (token % 32) & 1, (g, positions[i])
                assert matchers[i].accept(token)
                positions[i] += 1
                if positions[i] == len(outputs[g]):
                    matchers[i], positions[i] = back.matcher(compiled[g]), 0
        per = BATCH * steps
        print(
            f"  mask fill, batch {BATCH}, round {round_}: {sum(each) / per / 1e3:7.1f} µs wall,"
            f" {cpu / per * 1e6:7.1f} µs CPU per row per step;"
            f" one row p50 {np.percentile(each, 50) / 1e3:.1f}"
            f" p99 {np.percentile(each, 99) / 1e3:.0f} max {max(each) / 1e3:.0f} µs"
        )
    gc.collect()
    before = rss_bytes()
    tool = outputs["tool_call"]
    held = []
    for _ in range(MATCHERS):
        matcher = back.matcher(compiled["tool_call"])
        for token in tool[: len(tool) // 2]:
            matcher.accept(token)
        matcher.fill(words[0])
        held.append(matcher)
    grown = rss_bytes() - before
    tables = getattr(compiled["tool_call"].grammar, "memory_size_bytes", None)
    print(
        f"  memory: {grown / MATCHERS / 1024:.1f} KiB resident per matcher ({MATCHERS} matchers, tool-call"
        " schema)" + (f"; compiled tool-call grammar {tables / 2**20:.2f} MiB" if tables is not None else "")
    )
    del held


def du(paths: list[Path]) -> int:
    total = 0
    for path in paths:
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        total += sum(p.stat().st_size for p in files)
    return total


def package_paths(module: str, dist: str) -> list[Path] | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    return [folder, *folder.parent.glob(f"{dist}-*.dist-info")]


def install_sizes() -> None:
    # What each backend adds to Stepwise's own dependencies (torch, transformers, numpy and
    # pydantic, through fastapi, are there already).
    extra = {
        "llguidance": [("llguidance", "llguidance")],
        "xgrammar": [("xgrammar", "xgrammar"), ("tvm_ffi", "apache_tvm_ffi"), ("triton", "triton")],
    }
    print("\ninstalled size of what each backend adds:")
    for name, packages in extra.items():
        parts = []
        total = 0
        for module, dist in packages:
            paths = package_paths(module, dist)
            if paths is None:
                parts.append(f"{module} not installed here")
                continue
            size = du(paths)
            total += size
            parts.append(f"{module} {size / 2**20:.1f} MiB")
        print(f"  {name}: {total / 2**20:.1f} MiB ({', '.join(parts)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default=",".join(backend.installed()))
    parser.add_argument("--tokenizers", default="embedded,smollm2,big150k")
    args = parser.parse_args()
    base = SMOLLM2 if SMOLLM2.exists() else EMBEDDED
    tokenizers = {"embedded": (EMBEDDED.read_text(), (0,))}
    if SMOLLM2.exists():
        tokenizers["smollm2"] = (SMOLLM2.read_text(), (0, 2))
    started = time.perf_counter()
    tokenizers["big150k"] = (big_tokenizer(base.read_text(), BIG_VOCAB), (0,))
    print(f"big150k: built from {base.parent.name}'s tokenizer in {time.perf_counter() - started:.1f} s")
    for name in args.backends.split(","):
        started = time.perf_counter()
        backend.create(name, EMBEDDED.read_text(), 1024, (0,))
        print(
            f"{name}: first backend in this process (imports included) {time.perf_counter() - started:.2f} s"
        )
    for label in args.tokenizers.split(","):
        if label not in tokenizers:
            continue
        text, eos = tokenizers[label]
        for name in args.backends.split(","):
            bench_one(name, label, text, eos)
    install_sizes()


if __name__ == "__main__":
    main()
