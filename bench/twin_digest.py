"""Every plan and result of a fleet simulation, hashed (not a test): `python bench/twin_digest.py
TRACE [stepwise simulate flags]`.

Runs `stepwise simulate` in this process and prints, after its own output, one line on stderr:
`DIGEST steps=N SHA256`, a SHA-256 over each step of every worker in the order the twin ran them
(the worker's index, then the plan's and the result's wire encodings, worker.proto). A change meant
to make the twin faster without changing a decision must leave this line as it was (with stdout and
`--per-request` rows): that is how docs/performance.md#the-fleet-simulators-speed checked its rounds.
It goes through the codec for every step, so it runs several times slower than the command.
"""

from __future__ import annotations

import hashlib
import sys

from protos import worker_codec
from protos.worker import StepPlan, StepResult
from stepwise import twin
from stepwise.cli import main


class Digest:
    """The running hash over the steps the twin executes."""

    def __init__(self) -> None:
        self.sha = hashlib.sha256()
        self.steps = 0

    def step(self, worker: int, plan: StepPlan, result: StepResult) -> None:
        self.sha.update(worker.to_bytes(4, "little"))
        self.sha.update(worker_codec.plan_to_proto(plan).plan.SerializeToString(deterministic=True))
        self.sha.update(worker_codec.result_to_proto(result).result.SerializeToString(deterministic=True))
        self.steps += 1


def hashing(digest: Digest) -> None:
    """Make every Twin hash each step it executes into `digest`."""
    execute = twin.Twin._execute

    def _execute(self: twin.Twin, worker: twin.SimWorker, plan: StepPlan) -> StepResult:
        result = execute(self, worker, plan)
        digest.step(worker.index, plan, result)
        return result

    twin.Twin._execute = _execute  # type: ignore[method-assign]


def run(argv: list[str]) -> int:
    digest = Digest()
    hashing(digest)
    code = main(["simulate", *argv])
    print(f"DIGEST steps={digest.steps} {digest.sha.hexdigest()}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
