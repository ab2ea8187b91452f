"""The rendered manifests as local processes: what each Deployment's pods would run, on 127.0.0.1.

`process_specs(objects)` gives one ProcessSpec per replica and container: its command line (the
image's ENTRYPOINT plus the container's args, or its command) and its environment (envFrom
ConfigMaps resolved, then `env`, with fieldRefs given local values). `remap(specs, objects)` then
moves them onto this machine: every containerPort gets a free ephemeral port, a Service address
(`NAME:PORT`, `dns:///NAME:PORT`, also with `.NAMESPACE.svc.cluster.local`) becomes the comma list
of the local addresses behind it, `0.0.0.0` becomes 127.0.0.1, and `stepwise` runs as
`sys.executable -m stepwise.cli`.
"""

from __future__ import annotations

import re
import socket
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

# The image's ENTRYPOINT (Dockerfile) and how the same program runs from this checkout.
ENTRYPOINT = ("stepwise",)
LOCAL_ENTRYPOINT = (sys.executable, "-m", "stepwise.cli")
LOOPBACK = "127.0.0.1"
NAMESPACE = "default"
# What a fieldRef reads in a pod; `{pod}` is the local pod name.
FIELD_VALUES = {
    "metadata.name": "{pod}",
    "metadata.namespace": NAMESPACE,
    "spec.nodeName": "localhost",
    "spec.serviceAccountName": "default",
    "status.podIP": LOOPBACK,
    "status.hostIP": LOOPBACK,
}
SERVICE_ADDRESS = re.compile(
    r"^(?:dns:///)?(?P<name>[a-z0-9]([-a-z0-9]*[a-z0-9])?)"
    r"(?:\.(?P<namespace>[a-z0-9-]+)(?:\.svc(?:\.cluster\.local)?)?)?:(?P<port>\d+)$"
)

Obj = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    """One container of one replica, as a process."""

    pod: str  # `DEPLOYMENT-INDEX`
    container: str
    labels: Mapping[str, str]  # the pod's labels (Service selectors match them)
    argv: tuple[str, ...]
    env: Mapping[str, str]
    # containerPort -> the port it listens on here (the same number until remapped).
    ports: Mapping[int, int]
    port_names: Mapping[str, int]  # a named containerPort -> its number

    @property
    def component(self) -> str:
        return self.labels.get("app.kubernetes.io/component", "")

    @property
    def command(self) -> str:
        """The stepwise subcommand (`control`, `worker`, ...), or "" for another program."""
        for entry in (ENTRYPOINT, LOCAL_ENTRYPOINT):
            if self.argv[: len(entry)] == entry and len(self.argv) > len(entry):
                return self.argv[len(entry)]
        return ""


def process_specs(objects: Sequence[Obj]) -> list[ProcessSpec]:
    """Every Deployment's replicas and containers, in the objects' order."""
    config_maps = {o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}
    specs = []
    for deployment in (o for o in objects if o["kind"] == "Deployment"):
        template = deployment["spec"]["template"]
        for index in range(deployment["spec"].get("replicas", 1)):
            pod = f"{deployment['metadata']['name']}-{index}"
            for container in template["spec"]["containers"]:
                specs.append(_container_spec(pod, template["metadata"]["labels"], container, config_maps))
    return specs


def _container_spec(
    pod: str, labels: Mapping[str, str], container: Obj, config_maps: Mapping[str, Mapping[str, str]]
) -> ProcessSpec:
    argv = tuple(container.get("command", ENTRYPOINT)) + tuple(container.get("args", ()))
    declared = container.get("ports", [])
    return ProcessSpec(
        pod=pod,
        container=container["name"],
        labels=dict(labels),
        argv=argv,
        env=container_env(pod, container, config_maps),
        ports={p["containerPort"]: p["containerPort"] for p in declared},
        port_names={p["name"]: p["containerPort"] for p in declared if "name" in p},
    )


def container_env(pod: str, container: Obj, config_maps: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom in order, then env (which wins)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if set(source) != {"configMapRef"}:
            raise ValueError(f"{pod}: envFrom {source} (only configMapRef without a prefix)")
        env.update(config_maps[source["configMapRef"]["name"]])
    for var in container.get("env", []):
        env[var["name"]] = _env_value(pod, var, config_maps)
    return env


def _env_value(pod: str, var: Obj, config_maps: Mapping[str, Mapping[str, str]]) -> str:
    if "valueFrom" not in var:
        return str(var.get("value", ""))
    source = var["valueFrom"]
    if "fieldRef" in source:
        return FIELD_VALUES[source["fieldRef"]["fieldPath"]].format(pod=pod)
    if "configMapKeyRef" in source:
        ref = source["configMapKeyRef"]
        return config_maps[ref["name"]][ref["key"]]
    raise ValueError(f"{pod}: env {var['name']} from {source} (only fieldRef and configMapKeyRef)")


def free_port() -> int:
    """A port nothing listens on now (the kernel's choice); the caller binds it soon after."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def remap(
    specs: Sequence[ProcessSpec], objects: Sequence[Obj], pick_port: Callable[[], int] = free_port
) -> list[ProcessSpec]:
    """`specs` moved onto 127.0.0.1: ephemeral ports, Service names as local address lists."""
    placed = [replace(spec, ports={port: pick_port() for port in spec.ports}) for spec in specs]
    services = service_addresses(placed, [o for o in objects if o["kind"] == "Service"])
    return [_rewrite(spec, services) for spec in placed]


def service_addresses(specs: Sequence[ProcessSpec], services: Sequence[Obj]) -> dict[tuple[str, int], str]:
    """(Service name, Service port) -> `127.0.0.1:P,127.0.0.1:Q`: the local ports of the pods its
    selector picks, in pod order (every pod: the local processes are all "ready")."""
    addresses = {}
    for service in services:
        selector = service["spec"].get("selector", {})
        pods = [s for s in specs if selector and selector.items() <= s.labels.items()]
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            local = [f"{LOOPBACK}:{s.ports[_container_port(s, target)]}" for s in pods]
            addresses[(service["metadata"]["name"], port["port"])] = ",".join(local)
    return addresses


def _container_port(spec: ProcessSpec, target: int | str) -> int:
    return spec.port_names[target] if isinstance(target, str) else target


def _rewrite(spec: ProcessSpec, services: Mapping[tuple[str, int], str]) -> ProcessSpec:
    argv = list(spec.argv)
    if tuple(argv[: len(ENTRYPOINT)]) == ENTRYPOINT:
        argv[: len(ENTRYPOINT)] = LOCAL_ENTRYPOINT
    argv = [_local_value(spec, services, value, flag) for flag, value in _with_flags(argv)]
    env = {name: _local_value(spec, services, value, name) for name, value in spec.env.items()}
    return replace(spec, argv=tuple(argv), env=env)


def _with_flags(argv: Sequence[str]) -> Iterator[tuple[str, str]]:
    """Each argument with the flag it is the value of ("" for flags and positionals)."""
    previous = ""
    for arg in argv:
        yield (previous if previous.startswith("--") else ""), arg
        previous = arg


def _local_value(spec: ProcessSpec, services: Mapping[tuple[str, int], str], value: str, name: str) -> str:
    """`value` (of flag or variable `name`) as it reads on this machine."""
    if value == "0.0.0.0":
        return LOOPBACK
    match = SERVICE_ADDRESS.match(value)
    if match and (match["name"], int(match["port"])) in services:
        return services[(match["name"], int(match["port"]))]
    # `--health-port 8081`, STEPWISE_METRICS_PORT=9090: a port of this container, moved.
    if name.lower().replace("_", "-").endswith("port") and value.isdigit() and int(value) in spec.ports:
        return str(spec.ports[int(value)])
    return value
