"""tests/deploy/local.py: the rendered cpu-sim overlay as local process specs, and their remapping."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from tests.deploy.local import LOCAL_ENTRYPOINT, ProcessSpec, container_env, process_specs, remap
from tests.deploy.manifests import rendered

Obj = dict[str, Any]


def _by_pod(specs: list[ProcessSpec]) -> dict[str, ProcessSpec]:
    return {spec.pod: spec for spec in specs}


def test_one_spec_per_replica_with_the_entrypoint_and_the_config_map() -> None:
    specs = process_specs(rendered("overlays/cpu-sim"))
    assert sorted(s.pod for s in specs) == sorted(
        ["stepwise-control-0", "stepwise-control-1", "stepwise-gateway-0", "stepwise-gateway-1"]
        + [f"stepwise-worker-{i}" for i in range(4)]
    )
    worker = _by_pod(specs)["stepwise-worker-3"]
    assert worker.argv[:2] == ("stepwise", "worker")
    assert worker.command == "worker" and worker.component == "worker"
    assert worker.env["STEPWISE_BACKEND"] == "sim"
    assert worker.env["STEPWISE_WORKER_ID"] == "stepwise-worker-3"  # fieldRef metadata.name
    control = _by_pod(specs)["stepwise-control-0"]
    assert control.ports == {50051: 50051, 50052: 50052, 9090: 9090}
    assert control.port_names == {"client": 50051, "worker": 50052, "metrics": 9090}


def test_env_wins_over_env_from_and_reads_config_map_keys() -> None:
    config_maps = {"a": {"STEPWISE_X": "1", "STEPWISE_Y": "2"}, "b": {"K": "from-b"}}
    container = {
        "envFrom": [{"configMapRef": {"name": "a"}}],
        "env": [
            {"name": "STEPWISE_Y", "value": "3"},
            {"name": "STEPWISE_Z", "valueFrom": {"configMapKeyRef": {"name": "b", "key": "K"}}},
            {"name": "STEPWISE_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        ],
    }
    env = container_env("p-0", container, config_maps)
    assert env == {"STEPWISE_X": "1", "STEPWISE_Y": "3", "STEPWISE_Z": "from-b", "STEPWISE_NS": "default"}
    with pytest.raises(ValueError, match="secretRef"):
        container_env("p-0", {"envFrom": [{"secretRef": {"name": "s"}}]}, config_maps)


def test_remap_moves_ports_and_service_names_onto_loopback() -> None:
    objects = rendered("overlays/cpu-sim")
    ports = itertools.count(41000)
    specs = _by_pod(remap(process_specs(objects), objects, pick_port=lambda: next(ports)))
    control = [specs[f"stepwise-control-{i}"] for i in range(2)]
    assert len({p for c in control for p in c.ports.values()}) == 6  # every port its own
    worker_ports = ",".join(f"127.0.0.1:{c.ports[50052]}" for c in control)
    client_ports = ",".join(f"127.0.0.1:{c.ports[50051]}" for c in control)

    argv = control[0].argv
    assert argv[: len(LOCAL_ENTRYPOINT) + 1] == (*LOCAL_ENTRYPOINT, "control")
    assert control[0].command == "control"
    assert _after(argv, "--host") == "127.0.0.1"
    assert _after(argv, "--port") == str(control[0].ports[50051])
    assert _after(argv, "--worker-port") == str(control[0].ports[50052])
    assert _after(argv, "--metrics-port") == str(control[0].ports[9090])
    assert _after(argv, "--peers") == worker_ports  # the headless Service: both control planes

    worker = specs["stepwise-worker-0"]
    assert _after(worker.argv, "--control") == worker_ports
    assert _after(worker.argv, "--health-port") == str(worker.ports[8081])
    assert worker.env["STEPWISE_DRAIN_TIMEOUT"] == "30"  # not a port: left alone

    gateway = specs["stepwise-gateway-1"]
    assert _after(gateway.argv, "--control") == client_ports
    assert _after(gateway.argv, "--host") == "127.0.0.1"


def test_remap_resolves_full_service_names_and_numbered_target_ports() -> None:
    objects: list[Obj] = [
        {
            "kind": "Deployment",
            "metadata": {"name": "server"},
            "spec": {
                "replicas": 2,
                "template": {
                    "metadata": {"labels": {"app": "s"}},
                    "spec": {
                        "containers": [{"name": "s", "args": ["control"], "ports": [{"containerPort": 7}]}]
                    },
                },
            },
        },
        {
            "kind": "Deployment",
            "metadata": {"name": "client"},
            "spec": {
                "template": {
                    "metadata": {"labels": {"app": "c"}},
                    "spec": {
                        "containers": [
                            {
                                "name": "c",
                                "command": ["other"],
                                "args": [
                                    "--to",
                                    "dns:///svc.team.svc.cluster.local:70",
                                    "--listen",
                                    "0.0.0.0",
                                ],
                                "env": [
                                    {"name": "TARGET", "value": "svc:70"},
                                    {"name": "OTHER", "value": "x:70"},
                                ],
                            }
                        ]
                    },
                },
            },
        },
        {
            "kind": "Service",
            "metadata": {"name": "svc"},
            "spec": {"selector": {"app": "s"}, "ports": [{"port": 70, "targetPort": 7}]},
        },
    ]
    ports = iter([5001, 5002])
    specs = _by_pod(remap(process_specs(objects), objects, pick_port=lambda: next(ports)))
    client = specs["client-0"]
    assert client.argv == ("other", "--to", "127.0.0.1:5001,127.0.0.1:5002", "--listen", "127.0.0.1")
    assert client.command == ""
    assert client.env == {"TARGET": "127.0.0.1:5001,127.0.0.1:5002", "OTHER": "x:70"}


def _after(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]
