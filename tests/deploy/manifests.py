"""The rendered manifests of `k8s/`, and the questions the deploy tests ask of them."""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from stepwise import flags
from tests.deploy.kustomize import render
from tests.deploy.local import container_env

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
# Every kustomization a user applies: the overlays and the mutual-TLS example on top of cpu-sim.
OVERLAYS = ("overlays/cpu-sim", "overlays/gpu", "overlays/gpu-pd", "examples/mtls")
CONTROL, WORKER, GATEWAY = "stepwise-control", "stepwise-worker", "stepwise-gateway"
WORKER_SERVICE = "stepwise-workers"

Obj = dict[str, Any]


@functools.cache
def _rendered(overlay: str) -> tuple[Obj, ...]:
    return tuple(render(K8S / overlay))


def rendered(overlay: str) -> list[Obj]:
    return list(_rendered(overlay))


def find(objects: Sequence[Obj], kind: str, name: str) -> Obj:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} objects"
    return matches[0]


def pod_spec(objects: Sequence[Obj], deployment: str) -> Obj:
    spec: Obj = find(objects, "Deployment", deployment)["spec"]["template"]["spec"]
    return spec


def container(objects: Sequence[Obj], deployment: str) -> Obj:
    """The one container of a Deployment's pods."""
    containers = pod_spec(objects, deployment)["containers"]
    assert len(containers) == 1, f"{deployment}: {len(containers)} containers"
    main: Obj = containers[0]
    return main


def config_maps(objects: Sequence[Obj]) -> dict[str, dict[str, str]]:
    return {o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}


def env_of(objects: Sequence[Obj], deployment: str) -> dict[str, str]:
    """The container's environment, ConfigMaps resolved (fieldRefs as local values)."""
    return container_env(deployment, container(objects, deployment), config_maps(objects))


def flag_value(objects: Sequence[Obj], deployment: str, flag: str) -> str | None:
    """What `--flag` is set to in the container: its args win over its environment; None if unset."""
    args = container(objects, deployment).get("args", [])
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return str(args[i + 1])
        if arg.startswith(flag + "="):
            return str(arg.split("=", 1)[1])
    return env_of(objects, deployment).get(flags.env_name(flag))


def pod_templates(objects: Sequence[Obj]) -> Iterator[tuple[str, Obj]]:
    for obj in objects:
        if obj["kind"] == "Deployment":
            yield obj["metadata"]["name"], obj["spec"]["template"]


def command_parser(command: str) -> argparse.ArgumentParser:
    """The argparse parser `stepwise COMMAND` parses its flags with (environment not applied)."""
    from stepwise import cli

    if command == "control":
        return cli._control_parser()
    if command == "worker":
        return cli._worker_parser()
    if command == "gateway":
        return cli._gateway_parser()
    raise ValueError(f"no parser for stepwise {command}")


def long_options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings if s.startswith("--")}


def env_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """STEPWISE_X_Y -> --x-y for every long option of `parser` (--help excluded)."""
    return {flags.env_name(o): o for o in long_options(parser) if o != "--help"}


def parse_container(command: str, args: Sequence[str], env: Mapping[str, str]) -> argparse.Namespace:
    """Parse a container's flags as the command would in the pod: the environment as defaults, then
    the args. AssertionError with argparse's message when the command would refuse them."""
    parser = command_parser(command)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            flags.apply_env_defaults(parser, env)
            return parser.parse_args(list(args))
    except SystemExit:
        raise AssertionError(
            f"stepwise {command} refuses {list(args)}: {stderr.getvalue().strip()}"
        ) from None
