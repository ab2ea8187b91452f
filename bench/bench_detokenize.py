"""Incremental detokenizing cost per generated token, before and after the byte road, side by side.

"window" is the detokenizer before it (tests/control_plane/frontend/test_detokenize.py keeps it as the
reference: two decodes of a window of ids per push); "now" is `IncrementalDetokenizer`, which
decodes a byte-level tokenizer's ids from their bytes (`Tokenizer.token_bytes`). Pushes of one id
are what a sample with stop strings makes, or one without at `--stream-interval 1`; pushes of 8
what a message of coalesced ids makes. Both must produce the same text; the run checks it. Prints
figures; not a test.

    python bench/bench_detokenize.py [--model-dir DIR ...]

Tokenizers: the embedded model's, SmolLM2's when its local cache has it, and any --model-dir.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from control_plane.frontend.detokenize import IncrementalDetokenizer
from control_plane.tokenizer import Tokenizer
from stepwise import embedded, smollm2
from tests.control_plane.frontend.test_detokenize import _WindowDetokenizer

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 4000
PUSH_SIZES = (1, 8)
REPEATS = 7
MULTILINGUAL = "Café naïve résumé — 日本語のテキスト、東京 数据流 😀🚀🎉 straße €100 über piñata. " * 80

Detokenizer = IncrementalDetokenizer | _WindowDetokenizer


def _texts() -> dict[str, str]:
    return {"english": (ROOT / "README.md").read_text(), "multilingual": MULTILINGUAL}


def _per_token_us(make: Callable[[], Detokenizer], ids: Sequence[int], size: int) -> tuple[float, str]:
    """Best of REPEATS: µs per token to push `ids` `size` at a time and flush, and the text."""
    pushes = [ids[start : start + size] for start in range(0, len(ids), size)]
    best, text = float("inf"), ""
    for _ in range(REPEATS):
        detok = make()
        started = time.perf_counter()
        pieces = [detok.push(push) for push in pushes]
        pieces.append(detok.flush())
        best = min(best, time.perf_counter() - started)
        text = "".join(pieces)
    return best / len(ids) * 1e6, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, action="append", default=[], help="another tokenizer")
    args = parser.parse_args()
    dirs = {"embedded": embedded.resolve()}
    if (smollm2.checkpoint_dir() / "tokenizer.json").is_file():
        dirs["smollm2"] = smollm2.checkpoint_dir()
    dirs |= {str(d): d for d in args.model_dir}
    gc.disable()
    print(f"{'tokenizer':<10} {'text':<13} {'push':>4} {'window µs/tok':>14} {'now µs/tok':>11} {'ratio':>6}")
    for name, model_dir in dirs.items():
        tok = Tokenizer.from_dir(model_dir)
        started = time.perf_counter()
        road = "byte road" if tok.token_bytes() is not None else "no byte table: the window's way"
        build_ms = (time.perf_counter() - started) * 1e3
        for label, text in _texts().items():
            ids = tok.encode(text)[:TOKENS]
            prompt = ids[:16]
            for size in PUSH_SIZES:
                before, want = _per_token_us(partial(_WindowDetokenizer, tok, prompt), ids, size)
                after, got = _per_token_us(partial(IncrementalDetokenizer, tok, prompt), ids, size)
                if got != want:
                    raise SystemExit(f"{name} {label} push {size}: the texts differ")
                print(
                    f"{name:<10} {label:<13} {size:>4} {before:>14.3f} {after:>11.3f} {before / after:>5.1f}x"
                )
        print(f"{name:<10} {road}; table built in {build_ms:.0f} ms, vocabulary {tok.vocab_size}")


if __name__ == "__main__":
    main()
