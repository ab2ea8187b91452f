"""The fallback renderer: strategic-merge patches as kubectl applies them, images, and (where kubectl
is installed) the same objects as `kubectl kustomize` for every kustomization in k8s/."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.kustomize import (
    UnsupportedError,
    render_locally,
    render_with_kubectl,
    set_image,
    split_image,
    strategic_merge,
)
from tests.deploy.manifests import K8S, OVERLAYS

DEPLOYMENT: dict[str, Any] = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "x", "labels": {"a": "1"}},
    "spec": {
        "replicas": 2,
        "template": {
            "spec": {
                "containers": [
                    {
                        "name": "main",
                        "image": "stepwise:1",
                        "args": ["worker", "--control", "a:1"],
                        "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
                        "ports": [{"name": "one", "containerPort": 1}, {"name": "two", "containerPort": 2}],
                        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                    },
                    {"name": "side", "image": "other:2"},
                ],
                "volumes": [{"name": "tmp", "emptyDir": {}}],
                "tolerations": [{"key": "a", "operator": "Exists"}],
            }
        },
    },
}


def test_strategic_merge_merges_maps_and_keyed_lists_and_replaces_the_rest() -> None:
    patch = {
        "metadata": {"name": "x", "labels": {"b": "2"}},
        "spec": {
            "replicas": 4,
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "main",
                            "args": ["worker"],
                            "env": [{"name": "C", "value": "3"}, {"name": "B", "value": "22"}],
                            "ports": [{"name": "deux", "containerPort": 2}],
                            "volumeMounts": [{"name": "model", "mountPath": "/models", "readOnly": True}],
                        }
                    ],
                    "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}],
                    "tolerations": [{"key": "b", "operator": "Exists"}],
                }
            },
        },
    }
    merged = strategic_merge(DEPLOYMENT, patch, kind="Deployment")
    assert merged["metadata"]["labels"] == {"a": "1", "b": "2"}
    assert merged["spec"]["replicas"] == 4
    pod = merged["spec"]["template"]["spec"]
    main, side = pod["containers"]
    assert side == {"name": "side", "image": "other:2"}
    assert main["image"] == "stepwise:1"
    assert main["args"] == ["worker"]  # a list without a merge key is replaced
    # Keyed lists: the patch's items first (merged into their originals), then the rest in order.
    assert main["env"] == [
        {"name": "C", "value": "3"},
        {"name": "B", "value": "22"},
        {"name": "A", "value": "1"},
    ]
    assert main["ports"] == [{"name": "deux", "containerPort": 2}, {"name": "one", "containerPort": 1}]
    assert [m["mountPath"] for m in main["volumeMounts"]] == ["/models", "/tmp"]
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}]
    assert pod["tolerations"] == [{"key": "b", "operator": "Exists"}]
    assert DEPLOYMENT["spec"]["replicas"] == 2  # the original is untouched


def test_null_removes_a_key_and_directives_are_refused() -> None:
    probe = {"spec": {"probe": {"grpc": {"port": 1}, "periodSeconds": 5}}}
    merged = strategic_merge(probe, {"spec": {"probe": {"grpc": None, "tcpSocket": {"port": 1}}}}, kind="Pod")
    assert merged == {"spec": {"probe": {"tcpSocket": {"port": 1}, "periodSeconds": 5}}}
    with pytest.raises(UnsupportedError):
        strategic_merge(probe, {"spec": {"$patch": "replace"}}, kind="Pod")


def test_service_ports_merge_by_port_network_policy_ports_are_replaced() -> None:
    service = {"spec": {"ports": [{"name": "a", "port": 1}, {"name": "b", "port": 2}]}}
    merged = strategic_merge(service, {"spec": {"ports": [{"port": 2, "name": "bee"}]}}, kind="Service")
    assert merged["spec"]["ports"] == [{"port": 2, "name": "bee"}, {"name": "a", "port": 1}]
    policy = {"spec": {"ports": [{"port": 1}, {"port": 2}]}}
    merged = strategic_merge(policy, {"spec": {"ports": [{"port": 3}]}}, kind="NetworkPolicy")
    assert merged["spec"]["ports"] == [{"port": 3}]


@pytest.mark.parametrize(
    ("image", "split"),
    [
        ("stepwise", ("stepwise", "")),
        ("stepwise:0.1.0-cpu", ("stepwise", ":0.1.0-cpu")),
        ("reg.example:5000/team/stepwise:1", ("reg.example:5000/team/stepwise", ":1")),
        ("reg.example:5000/stepwise", ("reg.example:5000/stepwise", "")),
        ("stepwise@sha256:abc", ("stepwise", "@sha256:abc")),
    ],
)
def test_split_image(image: str, split: tuple[str, str]) -> None:
    assert split_image(image) == split


def test_images_rename_retag_and_pin_only_the_named_image() -> None:
    renamed = set_image(DEPLOYMENT, {"name": "stepwise", "newName": "reg/stepwise", "newTag": "2"})
    images = [c["image"] for c in renamed["spec"]["template"]["spec"]["containers"]]
    assert images == ["reg/stepwise:2", "other:2"]
    pinned = set_image(DEPLOYMENT, {"name": "stepwise", "digest": "sha256:abc"})
    assert pinned["spec"]["template"]["spec"]["containers"][0]["image"] == "stepwise@sha256:abc"


def _write(directory: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(textwrap.dedent(text))


def test_render_locally_reads_bases_patches_and_images(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "base/kustomization.yaml": "resources: [cm.yaml]\n",
            "base/cm.yaml": """
                apiVersion: v1
                kind: ConfigMap
                metadata: {name: c}
                data: {STEPWISE_A: "1", STEPWISE_B: "2"}
                """,
            "overlay/kustomization.yaml": "resources: [../base]\npatches: [{path: p.yaml}]\n",
            "overlay/p.yaml": """
                apiVersion: v1
                kind: ConfigMap
                metadata: {name: c}
                data: {STEPWISE_B: "3"}
                """,
        },
    )
    (config_map,) = render_locally(tmp_path / "overlay")
    assert config_map["data"] == {"STEPWISE_A": "1", "STEPWISE_B": "3"}


def test_render_locally_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    _write(tmp_path, {"kustomization.yaml": "resources: []\ncommonLabels: {a: b}\n"})
    with pytest.raises(UnsupportedError):
        render_locally(tmp_path)
    _write(tmp_path, {"kustomization.yaml": "resources: []\npatches: [{patch: '{}', target: {kind: X}}]\n"})
    with pytest.raises(UnsupportedError):
        render_locally(tmp_path)


def _by_name(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_render_locally_matches_kubectl(overlay: str) -> None:
    ours = render_locally(K8S / overlay)
    theirs = render_with_kubectl(K8S / overlay)
    assert len(ours) == len(theirs)
    assert _by_name(ours) == _by_name(theirs)
