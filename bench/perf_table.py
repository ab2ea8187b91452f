"""Regenerate the baselines table in docs/performance.md: run `stepwise compare` and rewrite the
block between `<!-- perf-table:begin -->` and `<!-- perf-table:end -->` with the machine, the date,
the exact command and the table (contender, tokens/s, ratio to stepwise, tokens per CPU second,
steps next to the ideal).

    .venv/bin/python bench/perf_table.py [--rounds 3] [--dry-run] [--doc PATH]

`--dry-run` prints the block instead of writing the document. The measurement takes minutes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The document's prose is wrapped at this width.
WIDTH = 100
BEGIN = "<!-- perf-table:begin -->"
END = "<!-- perf-table:end -->"


def replace_block(text: str, block: str) -> str:
    """`text` with everything between the one BEGIN marker and the END marker after it replaced by
    `block` (the markers stay, each on its own line); ValueError unless both occur exactly once,
    in that order."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"expected one {BEGIN} followed by one {END}")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{block.strip()}\n{END}{tail}"


def machine() -> str:
    """CPU model and logical cores (from /proc/cpuinfo) and the torch version."""
    import torch

    cpuinfo = Path("/proc/cpuinfo").read_text()
    models = re.findall(r"^model name\s*:\s*(.+)$", cpuinfo, flags=re.MULTILINE)
    cores = len(re.findall(r"^processor\s*:", cpuinfo, flags=re.MULTILINE))
    model = models[0].strip() if models else "unknown CPU"
    return f"{model}, {cores} logical cores, torch {torch.__version__}"


def render_block(report: dict[str, Any], command: str, where: str, date: str) -> str:
    """The document's block: a paragraph on the run, then the table, one row per contender."""
    work = report["workload"]
    about = (
        f"Measured {date} on {where}, with `{command}`: {work['requests']} requests, prompts "
        f"{work['prompt_len'][0]}-{work['prompt_len'][1]} tokens, outputs "
        f"{work['output_len'][0]}-{work['output_len'][1]} ({work['useful_tokens']:,} useful tokens), "
        f"{work['concurrency']} at a time, greedy, EOS ignored, one thread per process; medians of "
        f"{work['rounds']} interleaved rounds."
    )
    lines = [
        *textwrap.wrap(about, WIDTH, break_long_words=False, break_on_hyphens=False),
        "",
        f"| contender | tokens/s | vs stepwise | tokens per CPU s | steps (ideal {report['ideal_steps']}) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, row in report["contenders"].items():
        ratio = "-" if row["vs_stepwise"] is None else f"{row['vs_stepwise']:.2f}x"
        steps = "-" if row["steps"] is None else f"{row['steps']:,}"
        lines.append(f"| {name} | {row['tok_s']:,.0f} | {ratio} | {row['tok_per_cpu_s']:,.0f} | {steps} |")
    raw = report["contenders"].get("raw-forward")
    if raw and raw.get("forward_tok_s") and report.get("vs_raw_loop") is not None:
        about_raw = (
            f"raw-forward's batched decode loop computes {raw['forward_tok_s']:,.0f} tokens/s counting every "
            f"row (the padding of its static batches included); stepwise's useful tokens/s are "
            f"{report['vs_raw_loop']:.2f}x of that."
        )
        lines += ["", *textwrap.wrap(about_raw, WIDTH, break_long_words=False, break_on_hyphens=False)]
    return "\n".join(lines)


def measure(compare_args: list[str]) -> dict[str, Any]:
    """Run `stepwise compare` with `compare_args` (which hold `--json`); its report."""
    done = subprocess.run(
        [sys.executable, "-m", "stepwise.cli", "compare", *compare_args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"stepwise compare failed ({done.returncode}):\n{done.stderr[-3000:]}")
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of `stepwise compare`")
    parser.add_argument(
        "--doc",
        "--readme",
        dest="doc",
        type=Path,
        default=ROOT / "docs" / "performance.md",
        help="the file to rewrite (--readme is the old name of this flag)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the block, leave the document alone")
    ns = parser.parse_args(argv)
    compare_args = ["--rounds", str(ns.rounds), "--json"]
    report = measure(compare_args)
    command = shlex.join(["python", "-m", "stepwise.cli", "compare", *compare_args])
    date = datetime.date.today().isoformat()
    block = render_block(report, command, machine(), date)
    if ns.dry_run:
        print(block)
    else:
        ns.doc.write_text(replace_block(ns.doc.read_text(), block))
        print(f"rewrote the perf table in {ns.doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
