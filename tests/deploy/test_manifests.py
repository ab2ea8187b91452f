"""The rendered manifests: valid Kubernetes 1.33 objects, and wired the way the planes expect.

Probes point at the health services each plane serves, grace periods cover the drains, every
ConfigMap key is a flag of the command that reads it, containers run non-root on a read-only root
filesystem, and each overlay does what its name says.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.manifests import (
    CONTROL,
    GATEWAY,
    K8S,
    OVERLAYS,
    WORKER,
    WORKER_SERVICE,
    command_parser,
    config_maps,
    container,
    env_flags,
    env_of,
    find,
    flag_value,
    parse_container,
    pod_spec,
    pod_templates,
    rendered,
)

KUBERNETES_VERSION = "1.33"
# Health service names (common contract): the control plane's worker port serves "liveness" while
# the process runs, its client port "" while a worker is attached and it is not draining; the
# worker's health port serves "" once the model is loaded, "stepwise.v1.WorkerLink" while attached.
LIVENESS = "liveness"
WORKER_READINESS = "stepwise.v1.WorkerLink"
# A worker that hears nothing from its control plane after SIGTERM exits this long after its drain timeout.
WORKER_DRAIN_GRACE_S = 10
# Plaintext gRPC probes (not examples/mtls).
PLANE_OVERLAYS = ("overlays/cpu-sim", "overlays/gpu", "overlays/gpu-pd")
Obj = dict[str, Any]


@pytest.fixture(params=OVERLAYS)
def objects(request: pytest.FixtureRequest) -> list[Obj]:
    return rendered(request.param)


@pytest.fixture(params=PLANE_OVERLAYS)
def plain(request: pytest.FixtureRequest) -> list[Obj]:
    return rendered(request.param)


# --- schema ---------------------------------------------------------------------------------------


def test_every_object_is_valid_for_kubernetes_1_33(objects: list[Obj]) -> None:
    # validate() falls back to the newest older schema it has: make sure 1.33's own is there.
    known = {kubernetes_validate.utils.major_minor(v) for v in kubernetes_validate.utils.all_versions()}
    assert KUBERNETES_VERSION in known
    for obj in objects:
        assert kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION


def test_strict_validation_rejects_an_unknown_field() -> None:
    deployment = copy.deepcopy(find(rendered("overlays/cpu-sim"), "Deployment", CONTROL))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_every_object_carries_the_recommended_labels(objects: list[Obj]) -> None:
    for obj in objects:
        labels = obj["metadata"].get("labels", {})
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component"):
            assert key in labels, f"{obj['kind']}/{obj['metadata']['name']}: no {key}"
    for name, template in pod_templates(objects):
        selector = find(objects, "Deployment", name)["spec"]["selector"]["matchLabels"]
        assert selector.items() <= template["metadata"]["labels"].items()
        assert "app.kubernetes.io/version" not in selector  # a selector cannot change on upgrade


# --- Services and probes --------------------------------------------------------------------------


def test_worker_service_is_headless_and_lists_control_planes_ready_or_not(objects: list[Obj]) -> None:
    service = find(objects, "Service", WORKER_SERVICE)["spec"]
    assert service["clusterIP"] == "None"
    assert service.get("publishNotReadyAddresses") is True
    (port,) = service["ports"]
    assert port["port"] == 50052
    control = container(objects, CONTROL)
    named = {p["name"]: p["containerPort"] for p in control["ports"]}
    assert named[port["targetPort"]] == int(flag_value(objects, CONTROL, "--worker-port") or 0) == 50052
    labels = find(objects, "Deployment", CONTROL)["spec"]["template"]["metadata"]["labels"]
    assert service["selector"].items() <= labels.items()


def test_client_service_serves_grpc_and_metrics(objects: list[Obj]) -> None:
    ports = {p["name"]: p for p in find(objects, "Service", "stepwise")["spec"]["ports"]}
    assert (ports["grpc"]["port"], ports["grpc"]["appProtocol"]) == (50051, "grpc")
    assert ports["metrics"]["port"] == 9090
    assert flag_value(objects, CONTROL, "--port") == "50051"
    assert flag_value(objects, CONTROL, "--metrics-port") == "9090"
    assert flag_value(objects, CONTROL, "--host") == "0.0.0.0"


def test_workers_and_peers_dial_the_headless_service(objects: list[Obj]) -> None:
    target = f"dns:///{WORKER_SERVICE}:50052"
    assert flag_value(objects, WORKER, "--control") == target
    assert flag_value(objects, CONTROL, "--peers") == target


def _grpc(probe: Obj) -> tuple[int, str]:
    return probe["grpc"]["port"], probe["grpc"].get("service", "")


def test_control_plane_probes(plain: list[Obj]) -> None:
    control = container(plain, CONTROL)
    worker_port = int(flag_value(plain, CONTROL, "--worker-port") or 0)
    client_port = int(flag_value(plain, CONTROL, "--port") or 0)
    assert _grpc(control["startupProbe"]) == (worker_port, LIVENESS)
    assert _grpc(control["livenessProbe"]) == (worker_port, LIVENESS)
    assert _grpc(control["readinessProbe"]) == (client_port, "")


def test_worker_probes_use_its_health_port(plain: list[Obj]) -> None:
    worker = container(plain, WORKER)
    health_port = int(flag_value(plain, WORKER, "--health-port") or 0)
    assert health_port in {p["containerPort"] for p in worker["ports"]}
    assert _grpc(worker["startupProbe"]) == (health_port, "")
    assert _grpc(worker["livenessProbe"]) == (health_port, "")
    assert _grpc(worker["readinessProbe"]) == (health_port, WORKER_READINESS)


def test_gateway_readiness_follows_the_control_planes_liveness_does_not(objects: list[Obj]) -> None:
    gateway = container(objects, GATEWAY)
    port = int(flag_value(objects, GATEWAY, "--port") or 0)
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health", "port": port}
    for probe in ("livenessProbe", "startupProbe"):
        assert gateway[probe] == {**gateway[probe], "tcpSocket": {"port": port}}
        assert "httpGet" not in gateway[probe]
    assert flag_value(objects, GATEWAY, "--control") == "dns:///stepwise-headless:50051"
    headless = find(objects, "Service", "stepwise-headless")["spec"]
    assert headless["clusterIP"] == "None" and not headless.get("publishNotReadyAddresses")


def test_mtls_example_replaces_the_plaintext_grpc_probes() -> None:
    objects = rendered("examples/mtls")
    control = container(objects, CONTROL)
    for probe in ("startupProbe", "livenessProbe"):
        assert control[probe]["tcpSocket"] == {"port": 50052} and "grpc" not in control[probe]
    readiness = control["readinessProbe"]
    assert "grpc" not in readiness and "127.0.0.1:50051" in readiness["exec"]["command"][-1]
    env = env_of(objects, CONTROL)
    assert env["STEPWISE_WORKER_CA"] == "/tls/ca.crt" and env["STEPWISE_ALLOW_INSECURE_WORKERS"] == "false"
    assert env_of(objects, WORKER)["STEPWISE_TLS_CERT"] == "/tls/tls.crt"
    assert env_of(objects, GATEWAY)["STEPWISE_TLS_CA"] == "/tls/ca.crt"


# --- drains ---------------------------------------------------------------------------------------


def _pre_stop_s(objects: list[Obj], deployment: str) -> int:
    sleep = container(objects, deployment).get("lifecycle", {}).get("preStop", {}).get("sleep", {})
    return int(sleep.get("seconds", 0))


def test_control_plane_grace_covers_pre_stop_and_drain(objects: list[Obj]) -> None:
    drain_s = float(flag_value(objects, CONTROL, "--drain-timeout") or "nan")
    pre_stop_s = _pre_stop_s(objects, CONTROL)
    assert pre_stop_s >= 2  # endpoints must update before the drain refuses new calls
    grace = pod_spec(objects, CONTROL)["terminationGracePeriodSeconds"]
    assert grace >= pre_stop_s + drain_s + 5


def test_worker_grace_covers_its_drain_and_the_control_planes(objects: list[Obj]) -> None:
    worker_drain_s = float(flag_value(objects, WORKER, "--drain-timeout") or "nan")
    control_drain_s = float(flag_value(objects, CONTROL, "--drain-timeout") or "nan")
    grace = pod_spec(objects, WORKER)["terminationGracePeriodSeconds"]
    assert grace >= _pre_stop_s(objects, WORKER) + worker_drain_s + WORKER_DRAIN_GRACE_S
    assert grace > control_drain_s  # the control plane lets the worker's requests finish this long


# --- configuration --------------------------------------------------------------------------------


def _readers(objects: list[Obj]) -> dict[str, set[str]]:
    """ConfigMap name -> the stepwise commands whose containers take it with envFrom."""
    readers: dict[str, set[str]] = {}
    for _, template in pod_templates(objects):
        for c in template["spec"]["containers"]:
            for source in c.get("envFrom", []):
                readers.setdefault(source["configMapRef"]["name"], set()).add(c["args"][0])
    return readers


def test_every_config_map_key_is_a_flag_of_its_reader(objects: list[Obj]) -> None:
    readers = _readers(objects)
    for name, data in config_maps(objects).items():
        assert readers.get(name), f"ConfigMap {name} is read by no container"
        for command in readers[name]:
            known = env_flags(command_parser(command))
            for key in data:
                assert key.startswith("STEPWISE_"), f"{name}: {key}"
                assert key in known, f"{name}: {key} is not a flag of stepwise {command}"


def test_keys_shared_by_commands_mean_the_same(objects: list[Obj]) -> None:
    models = {name: data.get("STEPWISE_MODEL") for name, data in config_maps(objects).items()}
    assert len(set(models.values())) == 1, models


@pytest.fixture
def secret_files(tmp_path: Path) -> dict[str, str]:
    """The files examples/mtls mounts from Secrets, as real PEM files here (the TLS flags read them)."""
    from tests.certs import make_ca, make_cert

    ca = make_ca(tmp_path)
    issued = make_cert(ca, tmp_path, "stepwise", dns=("stepwise", "stepwise-workers"))
    return {"/tls/ca.crt": str(ca.cert), "/tls/tls.crt": str(issued.cert), "/tls/tls.key": str(issued.key)}


def test_every_container_parses_as_its_command(objects: list[Obj], secret_files: dict[str, str]) -> None:
    """Args and environment together are accepted by the command's own parser."""
    for deployment, template in pod_templates(objects):
        for c in template["spec"]["containers"]:
            env = {k: secret_files.get(v, v) for k, v in env_of(objects, deployment).items()}
            assert all(k.startswith("STEPWISE_") for k in env), env
            parse_container(c["args"][0], c["args"][1:], env)


def test_control_plane_flags_parse_to_the_deployed_values(objects: list[Obj]) -> None:
    c = container(objects, CONTROL)
    ns = parse_container("control", c["args"][1:], env_of(objects, CONTROL))
    assert (ns.host, ns.port, ns.worker_port, ns.metrics_port) == ("0.0.0.0", 50051, 50052, 9090)
    # Beyond loopback without --worker-ca the control plane refuses to start unless told.
    assert ns.allow_insecure_workers or ns.worker_ca is not None


def test_service_links_are_off(objects: list[Obj]) -> None:
    """A Service named `stepwise` would put STEPWISE_PORT=tcp://... into every pod's environment,
    which the commands read as --port."""
    for name, template in pod_templates(objects):
        assert template["spec"].get("enableServiceLinks") is False, name


# --- security and resources -----------------------------------------------------------------------


def test_every_container_is_non_root_on_a_read_only_root(objects: list[Obj]) -> None:
    for name, template in pod_templates(objects):
        pod = template["spec"]
        pod_security = pod.get("securityContext", {})
        assert pod.get("automountServiceAccountToken") is False, name
        for c in [*pod["containers"], *pod.get("initContainers", [])]:
            security = {**pod_security, **c.get("securityContext", {})}
            assert security.get("runAsNonRoot") is True, name
            assert security.get("runAsUser", 0) != 0, name
            assert security.get("readOnlyRootFilesystem") is True, name
            assert security.get("allowPrivilegeEscalation") is False, name
            assert security.get("capabilities", {}).get("drop") == ["ALL"], name
            assert security.get("seccompProfile", {}).get("type") == "RuntimeDefault", name
            # The image keeps HOME, caches and temporary files under /tmp: it must be writable.
            tmp = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/tmp"]
            assert tmp and not tmp[0].get("readOnly"), name
            volume = next(v for v in pod["volumes"] if v["name"] == tmp[0]["name"])
            assert "emptyDir" in volume, name


def test_every_container_has_requests_and_limits(objects: list[Obj]) -> None:
    for name, template in pod_templates(objects):
        for c in template["spec"]["containers"]:
            resources = c["resources"]
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(kind, {})), f"{name}: {kind}"


def test_images_are_tagged_and_never_latest(objects: list[Obj]) -> None:
    for name, template in pod_templates(objects):
        for c in template["spec"]["containers"]:
            image = c["image"]
            assert ":" in image.rsplit("/", 1)[-1] or "@" in image, f"{name}: {image}"
            assert not image.endswith(":latest"), f"{name}: {image}"


def test_prometheus_scrapes_the_metrics_ports(objects: list[Obj]) -> None:
    for name, port_flag in ((CONTROL, "--metrics-port"), (GATEWAY, "--port")):
        template = find(objects, "Deployment", name)["spec"]["template"]
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == flag_value(objects, name, port_flag)
        assert annotations["prometheus.io/path"] == "/metrics"


def test_network_policy_admits_only_workers_and_peers_to_the_worker_port(objects: list[Obj]) -> None:
    policy = find(objects, "NetworkPolicy", "stepwise-control")["spec"]
    control_labels = find(objects, "Deployment", CONTROL)["spec"]["template"]["metadata"]["labels"]
    worker_labels = find(objects, "Deployment", WORKER)["spec"]["template"]["metadata"]["labels"]
    gateway_labels = find(objects, "Deployment", GATEWAY)["spec"]["template"]["metadata"]["labels"]
    assert policy["policyTypes"] == ["Ingress"]
    assert policy["podSelector"]["matchLabels"].items() <= control_labels.items()

    def admitted(labels: dict[str, str], port: int) -> bool:
        for rule in policy["ingress"]:
            if port not in {p["port"] for p in rule.get("ports", [])}:
                continue
            sources = rule.get("from")
            if sources is None:  # no `from`: everyone
                return True
            if any(s["podSelector"]["matchLabels"].items() <= labels.items() for s in sources):
                return True
        return False

    assert admitted(worker_labels, 50052) and admitted(control_labels, 50052)
    assert not admitted(gateway_labels, 50052)
    assert not admitted({"app": "anything"}, 50052)
    for port in (50051, 9090):
        assert admitted({"app": "anything"}, port)


# --- scaling --------------------------------------------------------------------------------------


def test_autoscalers(objects: list[Obj]) -> None:
    workers = find(objects, "HorizontalPodAutoscaler", WORKER)["spec"]
    assert workers["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": WORKER}
    (metric,) = workers["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] == _adapter_rule()["name"]["as"]
    assert metric["external"]["target"]["type"] == "AverageValue"
    control = find(objects, "HorizontalPodAutoscaler", CONTROL)["spec"]
    assert control["scaleTargetRef"]["name"] == CONTROL
    (metric,) = control["metrics"]
    assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["type"] == "Utilization"
    assert control["minReplicas"] >= 2
    assert container(objects, CONTROL)["resources"]["requests"]["cpu"]  # utilisation is of the request


def _adapter_rule() -> dict[str, Any]:
    (rule,) = yaml.safe_load((K8S / "examples/prometheus-adapter-rules.yaml").read_text())["rules"][
        "external"
    ]
    return dict(rule)


def test_adapter_rule_sums_the_queue_gauge_the_control_plane_serves() -> None:
    from control_plane import metrics

    rule = _adapter_rule()
    name = metrics.NUM_QUEUE_REQS._name
    assert rule["seriesQuery"].startswith(name + "{")
    assert rule["name"]["matches"] == f"^{name}$"
    assert rule["metricsQuery"].startswith("sum(<<.Series>>{<<.LabelMatchers>>})")
    assert rule["resources"]["overrides"]["namespace"]["resource"] == "namespace"


def test_disruption_budgets_cover_both_planes(objects: list[Obj]) -> None:
    for name in (CONTROL, WORKER):
        budget = find(objects, "PodDisruptionBudget", name)["spec"]
        labels = find(objects, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert budget["selector"]["matchLabels"].items() <= labels.items()
        replicas = find(objects, "Deployment", name)["spec"]["replicas"]
        # It must allow some disruption, or a node drain would wait forever.
        assert budget.get("maxUnavailable", 0) >= 1 or budget["minAvailable"] < replicas


# --- the overlays ---------------------------------------------------------------------------------


def test_cpu_sim_runs_sim_workers_on_cpu() -> None:
    objects = rendered("overlays/cpu-sim")
    assert flag_value(objects, WORKER, "--backend") == "sim"
    assert flag_value(objects, WORKER, "--model") == "embedded"
    assert find(objects, "Deployment", WORKER)["spec"]["replicas"] == 4
    assert find(objects, "Deployment", CONTROL)["spec"]["replicas"] == 2
    assert find(objects, "HorizontalPodAutoscaler", WORKER)["spec"]["minReplicas"] == 4
    for _, template in pod_templates(objects):
        for c in template["spec"]["containers"]:
            assert c["image"].endswith("-cpu")
            assert not any(k.startswith("nvidia.com/") for k in c["resources"].get("limits", {}))


def _mounts_model_read_only(objects: list[Obj], deployment: str, path: str) -> bool:
    pod = pod_spec(objects, deployment)
    (mount,) = [m for m in container(objects, deployment)["volumeMounts"] if m["mountPath"] == path]
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    claim = volume["persistentVolumeClaim"]
    return bool(mount.get("readOnly") and claim.get("readOnly") and claim["claimName"] == "stepwise-model")


def test_gpu_workers_take_a_gpu_and_every_plane_reads_the_model_read_only() -> None:
    objects = rendered("overlays/gpu")
    worker = container(objects, WORKER)
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert worker["image"].endswith("-cuda")
    pod = pod_spec(objects, WORKER)
    assert pod["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    model = flag_value(objects, WORKER, "--model")
    assert model == "/models/model" and flag_value(objects, WORKER, "--device") == "cuda"
    assert flag_value(objects, WORKER, "--backend") == "model"
    for deployment in (WORKER, CONTROL, GATEWAY):
        assert flag_value(objects, deployment, "--model") == model
        assert _mounts_model_read_only(objects, deployment, model), deployment
    claim = find(objects, "PersistentVolumeClaim", "stepwise-model")["spec"]
    assert claim["accessModes"] == ["ReadOnlyMany"]  # mounted by pods on many nodes
    # The control planes and the gateway need no CUDA build of torch.
    for deployment in (CONTROL, GATEWAY):
        assert container(objects, deployment)["image"].endswith("-cpu")
        assert "nvidia.com/gpu" not in container(objects, deployment)["resources"]["limits"]


def test_gpu_pd_runs_prefill_and_decode_workers_in_deployments_of_their_own() -> None:
    objects = rendered("overlays/gpu-pd")
    decode = f"{WORKER}-decode"
    assert flag_value(objects, WORKER, "--role") == "prefill"
    assert flag_value(objects, decode, "--role") == "decode"
    gpu = {o["metadata"]["name"]: o for o in rendered("overlays/gpu") if o["kind"] == "Deployment"}
    for name in (WORKER, decode):
        deployment = find(objects, "Deployment", name)
        selector = deployment["spec"]["selector"]["matchLabels"]
        # Each Deployment's selector picks its own pods only, and its budget the same pods.
        for other, template in pod_templates(objects):
            assert (selector.items() <= template["metadata"]["labels"].items()) == (other == name), other
        budget = find(objects, "PodDisruptionBudget", name)["spec"]
        assert budget["selector"]["matchLabels"] == selector and budget["maxUnavailable"] >= 1
        # Otherwise the gpu overlay's worker pod: a GPU, the model read-only, the transfer link.
        pod = copy.deepcopy(deployment["spec"]["template"]["spec"])
        (c,) = pod["containers"]
        c["env"] = [e for e in c["env"] if e["name"] != "STEPWISE_ROLE"]
        assert pod == gpu[WORKER]["spec"]["template"]["spec"], name
        assert flag_value(objects, name, "--transfer-port") == "50060"
    # The prefill workers scale on the queue as before; the decode workers by hand.
    assert find(objects, "HorizontalPodAutoscaler", WORKER)["spec"]["scaleTargetRef"]["name"] == WORKER
    assert not [
        o for o in objects if o["kind"] == "HorizontalPodAutoscaler" and o["metadata"]["name"] == decode
    ]
    worker_policy = find(objects, "NetworkPolicy", "stepwise-worker")["spec"]["podSelector"]["matchLabels"]
    for name in (WORKER, decode):
        labels = find(objects, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert worker_policy.items() <= labels.items(), f"{name}: its transfer port is closed to others"


def test_only_files_a_kustomization_names_live_in_k8s() -> None:
    """Every YAML file under k8s/ is a kustomization, part of one, or the adapter example: a file
    nobody lists would be a manifest that is never applied or tested."""
    listed = {K8S / "examples/prometheus-adapter-rules.yaml"}
    for kustomization in K8S.rglob("kustomization.yaml"):
        listed.add(kustomization)
        spec = yaml.safe_load(kustomization.read_text())
        for entry in [*spec.get("resources", []), *(p["path"] for p in spec.get("patches", []))]:
            listed.add((kustomization.parent / entry).resolve())
    assert {p.resolve() for p in K8S.rglob("*.yaml")} <= {Path(p).resolve() for p in listed}
