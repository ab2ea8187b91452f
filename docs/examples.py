"""Regenerate the example outputs in docs/debugging.md by running their commands.

    .venv/bin/python docs/examples.py          # rewrite the example blocks
    .venv/bin/python docs/examples.py --check  # exit 1 (and name them) when blocks are out of date

Each block sits between `<!-- example: NAME -->` and `<!-- /example -->` and shows the commands of
EXAMPLES[NAME] as a shell session, `$ ` before each command, each followed by what it printed. The
commands run in order, from the repository root, with `REC` set to one temporary directory that all
of them share, and with no `STEPWISE_*` variable of the caller's environment (each would change a
flag). `.venv/bin/stepwise` in a command stands for `python -m stepwise.cli` of this checkout, run by
this interpreter, so the script works whichever virtual environment runs it.

Only commands whose output is the same on every run may appear here: `stepwise simulate` and the
replays of its recordings run on a simulated clock and print no wall-clock figure. Trailing spaces
are stripped from every line (the tables pad their last column).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "debugging.md"
STEPWISE = ".venv/bin/stepwise"

# Name -> the commands of one block, in order. Later blocks may read what earlier ones wrote to $REC.
EXAMPLES: dict[str, list[str]] = {
    "trace": ["cat docs/examples/shared-prefix.jsonl"],
    "simulate": [f"{STEPWISE} simulate docs/examples/shared-prefix.jsonl --chunked-prefill-size 256"],
    "record": [
        f"{STEPWISE} simulate docs/examples/retraction.jsonl --kv-tokens 64 "
        '--schedule-conservativeness 0.1 --record "$REC"'
    ],
    "replay": [f'{STEPWISE} replay scheduler "$REC"', f'{STEPWISE} replay worker "$REC"'],
    "show-json": [f'{STEPWISE} replay show "$REC" --json | sed -n 16p'],
}

BLOCK = re.compile(r"<!-- example: (?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- /example -->", re.DOTALL)


class ExampleError(RuntimeError):
    """A command failed, or the document's blocks and EXAMPLES do not match."""


def run(command: str, rec: Path) -> str:
    """What `command` prints, trailing spaces stripped; ExampleError when it fails."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWISE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["STEPWISE_DOCS_PYTHON"] = sys.executable
    env["REC"] = str(rec)
    shell = command.replace(STEPWISE, '"$STEPWISE_DOCS_PYTHON" -m stepwise.cli')
    done = subprocess.run(
        ["bash", "-c", shell], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise ExampleError(f"`{command}` exited {done.returncode}:\n{done.stderr[-2000:]}")
    return "\n".join(line.rstrip() for line in done.stdout.splitlines())


def render(commands: list[str], rec: Path) -> str:
    """The block's body: a console session of the commands and their output."""
    lines = ["```console"]
    for command in commands:
        lines.append(f"$ {command}")
        output = run(command, rec)
        if output:
            lines.append(output)
    lines.append("```")
    return "\n".join(lines) + "\n"


def regenerate(text: str) -> str:
    """`text` with every example block's body produced afresh."""
    names = [m["name"] for m in BLOCK.finditer(text)]
    unknown = sorted(set(names) - set(EXAMPLES))
    missing = [name for name in EXAMPLES if name not in names]
    if unknown or missing or len(names) != len(set(names)):
        raise ExampleError(f"blocks in {DOC.name}: unknown {unknown}, missing {missing}, listed {names}")
    with tempfile.TemporaryDirectory(prefix="stepwise-docs-") as tmp:
        rec = Path(tmp) / "rec"
        bodies = {name: render(commands, rec) for name, commands in EXAMPLES.items()}

    def body(match: re.Match[str]) -> str:
        return f"<!-- example: {match['name']} -->\n{bodies[match['name']]}<!-- /example -->"

    return BLOCK.sub(body, text)


def stale(old: str, new: str) -> list[str]:
    """Names of the blocks whose body differs between `old` and `new`."""
    before = {m["name"]: m["body"] for m in BLOCK.finditer(old)}
    return [m["name"] for m in BLOCK.finditer(new) if before.get(m["name"]) != m["body"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the document is out of date")
    ns = parser.parse_args(argv)
    old = DOC.read_text()
    try:
        new = regenerate(old)
    except ExampleError as exc:
        print(f"docs/examples.py: {exc}", file=sys.stderr)
        return 2
    if ns.check:
        if new != old:
            print(f"{DOC.relative_to(ROOT)} is out of date: {', '.join(stale(old, new))}", file=sys.stderr)
            print("run `.venv/bin/python docs/examples.py` to rewrite it", file=sys.stderr)
            return 1
        return 0
    if new != old:
        DOC.write_text(new)
        print(f"rewrote {', '.join(stale(old, new))} in {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
