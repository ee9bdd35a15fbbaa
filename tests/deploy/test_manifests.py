"""Every overlay renders with kustomize, every object it renders validates against the
Kubernetes schemas (offline, bundled with kubernetes-validate), and the invariants hold: probes on
endpoints the services implement, resources and a non-root security context everywhere, images
only from the base, and configuration keys that are exactly what the code reads."""

from __future__ import annotations

import os
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from services.checkpoint.config import CheckpointConfig
from services.gateway.config import GatewayConfig
from services.sampler.config import SamplerConfig
from services.trainer.config import TrainerConfig
from tests.deploy.manifests import (
    KUSTOMIZE,
    OVERLAYS,
    SERVICES,
    Obj,
    config_map,
    containers,
    image_repo,
    one,
    pod_spec,
    render,
    variables_read,
    workloads,
)
from tinsmith import health, runtime, tenants

# TINSMITH_* variables the code reads that have no place in a cluster's configuration, each with
# the reason. (None today: `tinsmith up` sets its per-machine values itself, in the environment of
# the processes it starts.)
PER_MACHINE: dict[str, str] = {}

# Variables the manifests provide before the code reads them, each with the reason; the test
# fails once the code reads one, so that it leaves this list.
AHEAD_OF_CODE: dict[str, str] = {}

# Keys of the ConfigMap that are not tinsmith's own: the OpenTelemetry SDK's standard variables
# (DESIGN.md section 7), set by components/otel-collector.
STANDARD_PREFIXES = ("OTEL_",)


# Where each overlay's engines compute (services/device.py), said outright: never `auto`, so that
# a GPU node does not move dev's engines off the CPU, and a prod pod without its GPU stops at start
# instead of computing on the CPU. TINSMITH_DTYPE and TINSMITH_DEVICE_MEMORY_MB keep the base's
# empty values, the device's defaults: bfloat16 on a GPU (float32 on the CPU), 90% of a GPU.
DEVICES = {"dev": "cpu", "staging": "cpu", "prod": "cuda"}
DEVICE, DTYPE, DEVICE_MEMORY = "TINSMITH_DEVICE", "TINSMITH_DTYPE", "TINSMITH_DEVICE_MEMORY_MB"


def _objects(overlay: str) -> tuple[Obj, ...]:
    return render(f"overlays/{overlay}")


def _service_containers(objects: tuple[Obj, ...]) -> dict[str, Obj]:
    return {name: containers(one(objects, "Deployment", name))[0] for name in SERVICES}


def _config_literals(kustomization: Path) -> list[str]:
    """The ``NAME=value`` literals a kustomization (or component) gives tinsmith's ConfigMap."""
    return [
        literal
        for generator in yaml.safe_load(kustomization.read_text()).get("configMapGenerator", [])
        if generator["name"] == "tinsmith-config"
        for literal in generator.get("literals", [])
    ]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_is_valid_kubernetes(overlay: str) -> None:
    version = kubernetes_validate.latest_version()
    for obj in _objects(overlay):
        # strict: an unknown field (a typo) fails too; a kind without a schema raises.
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {where}: {exc.message}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_probes_resources_and_runs_as_non_root(overlay: str) -> None:
    for workload in workloads(_objects(overlay)):
        where = f"{overlay}: {workload['kind']}/{workload['metadata']['name']}"
        pod = pod_spec(workload)
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert pod.get("automountServiceAccountToken") is False, where
        for container in containers(workload):
            if workload["kind"] != "Job":  # a Job runs to completion: nothing to probe
                assert {"readinessProbe", "livenessProbe"} <= container.keys(), where
            resources = container["resources"]
            assert {"cpu", "memory"} <= resources["requests"].keys(), where
            assert "memory" in resources["limits"], where
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["readOnlyRootFilesystem"] is True, where
            assert context["capabilities"]["drop"] == ["ALL"], where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_services_are_probed_on_the_health_endpoint_they_serve(overlay: str) -> None:
    objects = _objects(overlay)
    port = int(config_map(objects)["data"][health.PORT_VARIABLE])
    served = {route.resource.canonical for route in health.HealthServer("x").app.router.routes()}
    for name, container in _service_containers(objects).items():
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["health"] == port, name
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
        assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "health"}
        assert {"/readyz", "/livez"} <= served
    gateway = _service_containers(objects)["gateway"]
    http = next(p for p in gateway["ports"] if p["name"] == "http")
    assert http["containerPort"] == int(config_map(objects)["data"]["TINSMITH_PORT"])
    assert config_map(objects)["data"]["TINSMITH_HOST"] == "0.0.0.0"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheus_scrapes_each_service_on_its_health_port(overlay: str) -> None:
    objects = _objects(overlay)
    port = config_map(objects)["data"][health.PORT_VARIABLE]
    for name in SERVICES:
        metadata = one(objects, "Deployment", name)["spec"]["template"]["metadata"]
        assert metadata["annotations"] == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": port,
            "prometheus.io/path": "/metrics",  # served by tinsmith/runtime.py on that port
        }, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_select_pods_and_target_ports_that_exist(overlay: str) -> None:
    objects = _objects(overlay)
    pods = [(pod_spec(w), w["spec"]["template"]["metadata"]["labels"]) for w in workloads(objects)]
    for service in (o for o in objects if o["kind"] == "Service"):
        selector = service["spec"]["selector"]
        matched = [spec for spec, labels in pods if selector.items() <= labels.items()]
        assert matched, f"{overlay}: Service/{service['metadata']['name']} selects no pod"
        names = {p["name"] for spec in matched for c in spec["containers"] for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in names, service["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_configuration_keys_are_exactly_the_variables_the_code_reads(overlay: str) -> None:
    objects = _objects(overlay)
    keys = set(config_map(objects)["data"])
    ours = {k for k in keys if k.startswith("TINSMITH_")}
    assert all(k.startswith(STANDARD_PREFIXES) for k in keys - ours), keys - ours
    from_secrets: set[str] = set()
    from_pods: set[str] = set()  # per pod, from the downward API (the trainer's TINSMITH_REPLICA)
    for container in _service_containers(objects).values():
        refs = {e["configMapRef"]["name"] for e in container["envFrom"] if "configMapRef" in e}
        assert refs == {config_map(objects)["metadata"]["name"]}
        for variable in container.get("env", []):
            source = variable["valueFrom"]  # values: the ConfigMap
            assert source.keys() in ({"secretKeyRef"}, {"fieldRef"}), variable
            (from_secrets if "secretKeyRef" in source else from_pods).add(variable["name"])
    code = variables_read() - PER_MACHINE.keys()
    assert not ours & from_secrets, "a variable from both the ConfigMap and a Secret"
    assert not ours & from_pods, "a per-pod variable in the ConfigMap too"
    assert not AHEAD_OF_CODE.keys() & variables_read(), "the code reads it now: drop it above"
    missing = code - ours - from_secrets - from_pods
    unknown = (ours | from_secrets | from_pods) - code - AHEAD_OF_CODE.keys()
    assert not missing, f"read by the code, missing from base/tinsmith.env: {sorted(missing)}"
    assert not unknown, f"configured, but no code reads them: {sorted(unknown)}"


# What each overlay's comment tells the operator to run for its first admin key.
FIRST_ADMIN_KEY = (
    "kubectl -n {namespace} exec deploy/{gateway} -- tinsmith keys create --tenant admin --admin"
)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_takes_only_issued_keys_and_says_how_to_create_the_first(
    overlay: str,
) -> None:
    """TINSMITH_AUTH=keys is rendered, and set by the overlay itself (not only inherited from the
    base's default); the overlay's comment names the namespace and Deployment the gateway really
    renders to."""
    objects = _objects(overlay)
    assert config_map(objects)["data"][tenants.MODE_VARIABLE] == tenants.KEYS
    path = KUSTOMIZE / "overlays" / overlay / "kustomization.yaml"
    assert f"{tenants.MODE_VARIABLE}={tenants.KEYS}" in _config_literals(path)
    gateway = one(objects, "Deployment", "gateway")
    command = FIRST_ADMIN_KEY.format(
        namespace=gateway["metadata"]["namespace"], gateway=gateway["metadata"]["name"]
    )
    assert command in path.read_text(), f"{path}: the first admin key's command"


def test_the_base_quotas_are_the_codes_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """base/tinsmith.env writes out tenants.Quotas' defaults (the README and docs quote them)."""
    for name in tenants.VARIABLES.values():
        monkeypatch.setenv(name, config_map(render("base"))["data"][name])
    assert tenants.Quotas.from_env() == tenants.Quotas()


def test_the_per_machine_allow_list_names_variables_the_code_reads() -> None:
    assert PER_MACHINE.keys() <= variables_read()


def _image_renames() -> dict[str, set[str]]:
    """Every ``images: name -> newName`` of the components and overlays."""
    renames: dict[str, set[str]] = {}
    for path in KUSTOMIZE.glob("*/*/kustomization.yaml"):
        for entry in yaml.safe_load(path.read_text()).get("images", []):
            if "newName" in entry:
                renames.setdefault(entry["name"], set()).add(entry["newName"])
    return renames


def test_no_patch_sets_an_image() -> None:
    for path in [*KUSTOMIZE.glob("components/**/*.yaml"), *KUSTOMIZE.glob("overlays/**/*.yaml")]:
        if path.name == "kustomization.yaml":
            patches = [
                p.get("patch", "") for p in yaml.safe_load(path.read_text()).get("patches", [])
            ]
            text = "\n".join(patches)
        else:
            text = path.read_text()
            docs = [d for d in yaml.safe_load_all(text) if d]
            if any(isinstance(d, dict) and "kind" in d for d in docs):
                continue  # a resource of its own (a component's server), not a patch
        assert not re.search(r"(/image\b|\bimage:)", text), f"{path} patches an image"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_images_come_from_the_base(overlay: str) -> None:
    base = render("base")
    renames = _image_renames()
    for name, container in _service_containers(_objects(overlay)).items():
        origin = containers(one(base, "Deployment", name))[0]["image"]
        allowed = {image_repo(origin)}
        while True:
            more = set().union(*(renames.get(repo, set()) for repo in allowed)) - allowed
            if not more:
                break
            allowed |= more
        assert image_repo(container["image"]) in allowed, (overlay, container["image"])
        assert container["image"].rpartition(":")[2] == origin.rpartition(":")[2]


# Trainer replicas per overlay: one on a CPU cluster, two in prod (a GPU each).
TRAINERS = {"dev": 1, "staging": 1, "prod": 2}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_trainers_scale_one_at_a_time_each_under_its_pods_name(overlay: str) -> None:
    """The trainer fleet: replicas replaced (and drained) one at a time with no spare started,
    each named by its pod (a restarted container takes its runs back at once), and given the time
    to snapshot and hand over its runs, more than the service's own bound on a stop."""
    objects = _objects(overlay)
    trainer = one(objects, "Deployment", "trainer")
    assert trainer["spec"]["replicas"] == TRAINERS[overlay]
    assert trainer["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    env = {e["name"]: e["valueFrom"] for e in containers(trainer)[0]["env"]}
    assert env["TINSMITH_REPLICA"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert "TINSMITH_REPLICA" not in config_map(objects)["data"]
    grace = pod_spec(trainer)["terminationGracePeriodSeconds"]
    assert grace >= 120 and grace > runtime.SHUTDOWN_TIMEOUT_S
    budget = one(objects, "PodDisruptionBudget", "trainer")
    assert budget["spec"]["maxUnavailable"] == 1
    labels = trainer["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_dev_and_staging_run_on_cpu_with_every_dependency_in_the_cluster() -> None:
    for overlay in ("dev", "staging"):
        objects = _objects(overlay)
        assert config_map(objects)["data"]["TINSMITH_SAMPLER_ENGINE"] == "torch"
        assert config_map(objects)["data"][DEVICE] == "cpu"
        for workload in workloads(objects):
            assert "nodeSelector" not in pod_spec(workload)
            for container in containers(workload):
                assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
        kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
        assert {
            ("StatefulSet", "nats"),
            ("StatefulSet", "postgres"),
            ("StatefulSet", "object-store"),
            ("Job", "object-store-bucket"),
            ("Deployment", "otel-collector"),
        } <= kinds
        secrets = {
            o["metadata"]["name"].rsplit("-", 1)[0] for o in objects if o["kind"] == "Secret"
        }
        assert secrets == {"tinsmith-object-store", "tinsmith-catalog"}


def test_prod_runs_the_vllm_sampler_on_gpus_scaled_by_load() -> None:
    objects = _objects("prod")
    assert config_map(objects)["data"]["TINSMITH_SAMPLER_ENGINE"] == "vllm"
    assert config_map(objects)["data"][DEVICE] == "cuda"
    services = _service_containers(objects)
    assert image_repo(services["sampler"]["image"]) == "tinsmith/sampler-vllm"
    assert image_repo(services["trainer"]["image"]) == "tinsmith/trainer-cuda"
    for name in ("trainer", "sampler"):
        pod = pod_spec(one(objects, "Deployment", name))
        assert services[name]["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert pod["nodeSelector"] and pod["tolerations"]
    for name in ("gateway", "checkpoint"):
        assert "nvidia.com/gpu" not in services[name]["resources"]["limits"]
    hpa = one(objects, "HorizontalPodAutoscaler", "sampler")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "sampler",
    }
    assert "replicas" not in one(objects, "Deployment", "sampler")["spec"]  # the HPA owns it
    # The object store and the database are outside, through Secrets the operator creates.
    assert not [o for o in objects if o["kind"] == "Secret"]
    names = {o["metadata"]["name"] for o in objects}
    assert not {"postgres", "object-store"} & names
    for name in ("trainer", "gateway"):  # the gateway streams checkpoint archives from it
        env = {
            e["name"]: e["valueFrom"]["secretKeyRef"]["name"]
            for e in services[name]["env"]
            if "secretKeyRef" in e["valueFrom"]
        }
        assert env == {"TINSMITH_BLOB_URL": "tinsmith-object-store"}, name


def test_the_gpu_component_gives_the_engines_a_gpu_and_computes_on_it() -> None:
    component = KUSTOMIZE / "components" / "gpu"
    kustomization = yaml.safe_load((component / "kustomization.yaml").read_text())
    assert f"{DEVICE}=cuda" in _config_literals(component / "kustomization.yaml")
    assert not [v for v in _config_literals(component / "kustomization.yaml") if DTYPE in v]
    targets = {p["target"]["name"] for p in kustomization["patches"] if p["path"] == "gpu.yaml"}
    assert targets == {"trainer", "sampler"}
    patch = yaml.safe_load((component / "gpu.yaml").read_text())
    assert {
        "op": "add",
        "path": "/spec/template/spec/containers/0/resources/limits/nvidia.com~1gpu",
        "value": 1,
    } in patch


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_says_where_the_engines_compute(overlay: str) -> None:
    """cpu in dev and staging (set by the overlay itself), cuda where components/gpu is used, and
    a GPU requested by the trainer and the sampler exactly there."""
    objects = _objects(overlay)
    data = config_map(objects)["data"]
    device = DEVICES[overlay]
    assert data[DEVICE] == device
    assert (data[DTYPE], data[DEVICE_MEMORY]) == ("", "")  # the device's defaults
    path = KUSTOMIZE / "overlays" / overlay / "kustomization.yaml"
    components = yaml.safe_load(path.read_text()).get("components", [])
    assert ("../../components/gpu" in components) == (device == "cuda")
    if device == "cpu":
        assert f"{DEVICE}=cpu" in _config_literals(path)
    for name, container in _service_containers(objects).items():
        gpus = container["resources"]["limits"].get("nvidia.com/gpu")
        engine = name in ("trainer", "sampler")
        assert gpus == (1 if engine and device == "cuda" else None), (overlay, name)


def test_the_overlays_device_settings_resolve_as_documented() -> None:
    """The values, read by services/device.py (torch: not in the torch-free run): float32 base
    weights and the container's memory on the CPU overlays; bfloat16 on prod's GPUs."""
    import torch

    from services import device

    assert (device.DEVICE_VARIABLE, device.DTYPE_VARIABLE, device.MEMORY_VARIABLE) == (
        DEVICE,
        DTYPE,
        DEVICE_MEMORY,
    )
    for overlay in OVERLAYS:
        data = config_map(_objects(overlay))["data"]
        if DEVICES[overlay] == "cpu":
            placement = device.placement_from_env(data)
            assert (placement.device, placement.dtype) == (torch.device("cpu"), torch.float32)
            assert placement.memory_bytes == device.total_memory(placement.device)
        else:  # no GPU here to resolve the device on: its precision only
            dtype = device.resolve_dtype(data[DTYPE], torch.device(data[DEVICE]))
            assert dtype == torch.bfloat16


def test_every_component_is_a_component_and_every_overlay_uses_the_base() -> None:
    for path in KUSTOMIZE.glob("components/*/kustomization.yaml"):
        assert yaml.safe_load(path.read_text())["kind"] == "Component", path
    for overlay in OVERLAYS:
        kustomization = yaml.safe_load(
            (KUSTOMIZE / "overlays" / overlay / "kustomization.yaml").read_text()
        )
        assert "../../base" in kustomization["resources"]
        for component in kustomization.get("components", []):
            assert Path(component).parent.name == "components"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_service_reads_its_configuration_from_the_overlay(
    overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The services' own config readers accept every overlay's values: numbers parse, the health
    port is a port, and the base models to preload are models the registry knows."""
    for name in [n for n in os.environ if n.startswith("TINSMITH_")]:
        monkeypatch.delenv(name)
    for key, value in config_map(_objects(overlay))["data"].items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TINSMITH_BLOB_URL", "memory://tinsmith")  # from a Secret in a cluster
    assert health.port_from_env() == 8081
    assert runtime.nats_url() == "nats://nats:4222"
    assert runtime.results_max_age_s() > 0
    assert runtime.base_models()
    gateway = GatewayConfig.from_env()
    assert (gateway.host, gateway.port) == ("0.0.0.0", 8000)
    assert gateway.auth == tenants.KEYS
    assert TrainerConfig.from_env().cache_dir == Path("/var/cache/tinsmith")
    sampler = SamplerConfig.from_env()
    assert sampler.engine == ("vllm" if overlay == "prod" else "torch")
    assert CheckpointConfig.from_env().blob_url == "memory://tinsmith"
