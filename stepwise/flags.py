"""Every flag is also an environment variable: `--max-queued-requests` ↔ `STEPWISE_MAX_QUEUED_REQUESTS`.

Kubernetes ConfigMaps and local runs share one vocabulary. Flags given on the command line win over
the environment, which wins over the built-in defaults.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

TRUE = ("1", "true", "yes", "on")


def env_name(option: str) -> str:
    return "STEPWISE_" + option.lstrip("-").replace("-", "_").upper()


def apply_env_defaults(parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
    """Replace each long option's default with its environment variable's value, when set."""
    env = os.environ if env is None else env
    for action in parser._actions:  # argparse offers no public iterator over actions
        longs = [s for s in action.option_strings if s.startswith("--")]
        if not longs or action.dest == "help":
            continue
        raw = env.get(env_name(longs[0]))
        if raw is None or raw == "":
            continue
        if isinstance(action, argparse._StoreTrueAction):
            action.default = raw.strip().lower() in TRUE
        else:
            action.default = action.type(raw) if callable(action.type) else raw
        action.required = False
