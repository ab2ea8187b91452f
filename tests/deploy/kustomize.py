"""Render a kustomization directory to its objects: `kubectl kustomize` when kubectl is on PATH, else
a small renderer that supports exactly what `k8s/` uses.

The renderer understands `resources` (files, and directories holding a kustomization.yaml, read
recursively), `patches` given by `path` (strategic-merge patches: maps merge, a `null` removes a
key, the lists Kubernetes merges by key are merged by it, every other list is replaced) and
`images` (newName, newTag, digest). Anything else in a kustomization, and the `$patch` directives,
raise UnsupportedError: the renderer never quietly renders something other than kubectl would.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_FIELDS = {"apiVersion", "kind", "resources", "patches", "images"}
# The lists a strategic-merge patch merges item by item, by the key Kubernetes' API types declare
# (patchMergeKey); the last element names the list's field, the one before it its parent's field.
MERGE_KEYS: dict[tuple[str, ...], str] = {
    ("containers",): "name",
    ("initContainers",): "name",
    ("volumes",): "name",
    ("imagePullSecrets",): "name",
    ("containers", "env"): "name",
    ("initContainers", "env"): "name",
    ("containers", "volumeMounts"): "mountPath",
    ("initContainers", "volumeMounts"): "mountPath",
    ("containers", "ports"): "containerPort",
    ("initContainers", "ports"): "containerPort",
}
# Service.spec.ports merges by port; NetworkPolicy ports and the like are replaced.
SERVICE_PORTS = ("spec", "ports")

Obj = dict[str, Any]


class UnsupportedError(ValueError):
    """The kustomization uses something this renderer does not implement."""


def render(directory: Path) -> list[Obj]:
    """The objects `directory`'s kustomization produces (kubectl's rendering when it is installed)."""
    if shutil.which("kubectl"):
        return render_with_kubectl(directory)
    return render_locally(directory)


def render_with_kubectl(directory: Path) -> list[Obj]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def render_locally(directory: Path) -> list[Obj]:
    kustomization = _read_kustomization(directory)
    unknown = set(kustomization) - SUPPORTED_FIELDS
    if unknown:
        raise UnsupportedError(f"{directory}: kustomization fields {sorted(unknown)}")
    objects: list[Obj] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        objects.extend(render_locally(path) if path.is_dir() else _load(path))
    for patch in kustomization.get("patches", []):
        if set(patch) != {"path"}:
            raise UnsupportedError(f"{directory}: patch {patch} (only `path:` patches)")
        for doc in _load(directory / patch["path"]):
            target = _find(objects, doc)
            objects[objects.index(target)] = strategic_merge(target, doc, kind=target["kind"])
    for image in kustomization.get("images", []):
        objects = [set_image(obj, image) for obj in objects]
    return objects


def _read_kustomization(directory: Path) -> Obj:
    for name in KUSTOMIZATION_FILES:
        if (directory / name).exists():
            loaded: Obj = yaml.safe_load((directory / name).read_text())
            return loaded
    raise FileNotFoundError(f"no kustomization in {directory}")


def _load(path: Path) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _find(objects: Sequence[Obj], patch: Obj) -> Obj:
    """The object a patch applies to: same kind and name (kustomize's rule for `path:` patches)."""
    for obj in objects:
        if obj["kind"] == patch["kind"] and obj["metadata"]["name"] == patch["metadata"]["name"]:
            return obj
    raise ValueError(f"patch target {patch['kind']}/{patch['metadata']['name']} not found")


def strategic_merge(original: Obj, patch: Obj, kind: str) -> Obj:
    """`original` with `patch` applied as a strategic-merge patch; neither argument changes."""
    return _merge_map(copy.deepcopy(original), patch, kind, ())


def _merge_map(into: Obj, patch: Mapping[str, Any], kind: str, path: tuple[str, ...]) -> Obj:
    for key, value in patch.items():
        if key.startswith("$"):
            raise UnsupportedError(f"strategic-merge directive {key} at {'.'.join(path)}")
        if value is None:
            into.pop(key, None)
        elif isinstance(value, dict) and isinstance(into.get(key), dict):
            into[key] = _merge_map(into[key], value, kind, (*path, key))
        elif isinstance(value, list) and isinstance(into.get(key), list):
            into[key] = _merge_list(into[key], value, kind, (*path, key))
        else:
            into[key] = copy.deepcopy(value)
    return into


def _merge_list(into: list[Any], patch: list[Any], kind: str, path: tuple[str, ...]) -> list[Any]:
    """Merged item by item when the list has a merge key, else replaced.

    kubectl's order: the patch's items first (each merged into its original), then the original
    items the patch does not name, in their order.
    """
    key = merge_key(kind, path)
    if key is None:
        return copy.deepcopy(patch)
    originals = {item[key]: item for item in into}
    merged = [
        _merge_map(copy.deepcopy(originals[item[key]]), item, kind, path)
        if item[key] in originals
        else copy.deepcopy(item)
        for item in patch
    ]
    named = {item[key] for item in patch}
    return merged + [copy.deepcopy(item) for item in into if item[key] not in named]


def merge_key(kind: str, path: tuple[str, ...]) -> str | None:
    """The key a list at `path` (field names from the object's root) merges by, or None: replace."""
    if kind == "Service" and path == SERVICE_PORTS:
        return "port"
    return MERGE_KEYS.get(path[-2:]) or MERGE_KEYS.get(path[-1:])


def set_image(obj: Obj, image: Mapping[str, str]) -> Obj:
    """`obj` with the `images:` entry applied to its pod template's containers."""
    pod = obj.get("spec", {}).get("template", {}).get("spec")
    if pod is None:
        return obj
    obj = copy.deepcopy(obj)
    pod = obj["spec"]["template"]["spec"]
    for container in [*pod.get("containers", []), *pod.get("initContainers", [])]:
        name, tag = split_image(container["image"])
        if name != image["name"]:
            continue
        name = image.get("newName", name)
        if "digest" in image:
            container["image"] = f"{name}@{image['digest']}"
        elif "newTag" in image:
            container["image"] = f"{name}:{image['newTag']}"
        else:
            container["image"] = name + tag
    return obj


def split_image(image: str) -> tuple[str, str]:
    """(name, its tag or digest with the separator): `reg:5000/a/b:1.0` -> (`reg:5000/a/b`, `:1.0`)."""
    if "@" in image:
        name, digest = image.split("@", 1)
        return name, "@" + digest
    head, _, last = image.rpartition("/")
    if ":" in last:
        repo, tag = last.split(":", 1)
        return (f"{head}/{repo}" if head else repo), ":" + tag
    return image, ""
