"""The Kubernetes deployment (deploy/k8s), checked offline: each overlay built with `kubectl
kustomize`, every core object against the Kubernetes schemas (kubernetes-validate, strict), the
RayCluster against KubeRay's own CRD schema and admission rules, and what Shoal needs of them
(tests/deploy/k8s_checks.py). Each check is also shown to catch a broken manifest.

The builds run on a temporary copy of deploy/k8s whose base/secrets.env is the committed example
(a real secrets.env is never copied or read). Without kubectl they skip, unless
SHOAL_REQUIRE_KUBECTL is set (CI), where they fail."""

from __future__ import annotations

import copy
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from shoal.scheduler.devices import NodeInfo, node_devices
from shoal.service.localray import WORKER_PRESTART
from shoal.service.settings import Settings
from tests.deploy import k8s_checks as checks

pytestmark = pytest.mark.unit

Objs = list[dict[str, Any]]

REPO = Path(__file__).resolve().parents[2]
K8S_DIR = REPO / "deploy" / "k8s"
OVERLAYS = ("dev", "gpu")
IMAGE_TAGS = {"dev": "0.1.0", "gpu": "0.1.0-cuda"}
HOOK = K8S_DIR / "base" / "hooks" / "drain-node.py"
# The oldest Kubernetes the manifests are written for, and the newest the package knows.
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())


@pytest.fixture(scope="session")
def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        reason = "kubectl not found on PATH: the Kubernetes manifests cannot be built"
        if os.environ.get("SHOAL_REQUIRE_KUBECTL"):
            pytest.fail(f"{reason} (SHOAL_REQUIRE_KUBECTL is set)")
        pytest.skip(f"{reason}; install kubectl (it bundles kustomize) to run these tests")
    return path


@pytest.fixture(scope="session")
def k8s_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/k8s with base/secrets.env made from secrets.env.example."""
    root = tmp_path_factory.mktemp("deploy") / "k8s"
    shutil.copytree(K8S_DIR, root, ignore=shutil.ignore_patterns("secrets.env"))
    shutil.copyfile(root / "base" / "secrets.env.example", root / "base" / "secrets.env")
    return root


def kustomize(kubectl: str, path: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize path` builds; a failed build fails the test with its error."""
    result = subprocess.run(
        [kubectl, "kustomize", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0:
        pytest.fail(f"kubectl kustomize {path} failed:\n{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="session")
def builds(kubectl: str, k8s_tree: Path) -> dict[str, list[dict[str, Any]]]:
    """Each overlay's objects, built once per session."""
    return {name: kustomize(kubectl, k8s_tree / "overlays" / name) for name in OVERLAYS}


@pytest.fixture(scope="session")
def kuberay_schema() -> dict[str, Any]:
    """The openAPIV3Schema of KubeRay's RayCluster v1 (data/kuberay/README.md: its source)."""
    path = Path(__file__).parent / "data" / "kuberay" / "ray.io_rayclusters.yaml"
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with path.open() as f:
        crd = yaml.load(f, Loader=loader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest, builds: dict[str, Objs]) -> tuple[str, Objs]:
    name: str = request.param
    return name, builds[name]


def test_overlays_build_the_whole_install(overlay: tuple[str, Objs]) -> None:
    name, objs = overlay
    kinds = sorted(o["kind"] for o in objs)
    expected = [
        "ConfigMap",
        "ConfigMap",
        "Deployment",
        "Namespace",
        "PersistentVolumeClaim",
        "RayCluster",
        "Secret",
        "Service",
        "Service",
        "ServiceAccount",
        "StatefulSet",
    ]
    if name == "gpu":
        expected = sorted([*expected, "Ingress"])
    assert kinds == expected
    assert checks.check_namespaced(objs) == []


def test_core_objects_match_the_kubernetes_schemas(overlay: tuple[str, Objs]) -> None:
    """Strict: an unknown field fails, as `kubectl apply --validate=strict` would. The Ray pods'
    templates are checked as core PodTemplates too."""
    _, objs = overlay
    docs = [o for o in objs if o["kind"] != "RayCluster"]
    for pod in checks.pods(objs):
        if pod.is_ray:
            name = re.sub(r"[^a-z0-9]+", "-", pod.where.lower())
            template = (pod.ray_group or {})["template"]
            docs.append(
                {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
                 "template": template}
            )  # fmt: skip
    assert [d["kind"] for d in docs].count("PodTemplate") >= 2
    for version in K8S_VERSIONS:
        for doc in docs:
            name = f"{doc['kind']}/{doc['metadata']['name']}"
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{name} is invalid for Kubernetes {version}: {exc.message}")


def test_raycluster_matches_kuberay_crd(
    overlay: tuple[str, Objs], kuberay_schema: dict[str, Any]
) -> None:
    _, objs = overlay
    rc = checks.one(objs, "RayCluster")
    errors = sorted(
        jsonschema.Draft202012Validator(kuberay_schema).iter_errors(rc), key=lambda e: e.path
    )
    assert [f"{list(e.path)}: {e.message}" for e in errors] == []
    assert checks.unknown_fields(kuberay_schema, rc) == []


def test_raycluster_passes_kuberay_admission(overlay: tuple[str, Objs]) -> None:
    assert checks.check_kuberay_admission(overlay[1]) == []


@pytest.mark.parametrize(
    "check",
    [
        checks.check_references,
        checks.check_no_secret_values,
        checks.check_hardened,
        checks.check_no_kubernetes_api_rights,
        checks.check_control_plane,
        checks.check_gpu_counts,
        checks.check_spot_groups,
        checks.check_ray_auth,
        checks.check_checkpoints_shared,
    ],
)
def test_install_is_sound(overlay: tuple[str, Objs], check: Callable[[Objs], list[str]]) -> None:
    assert check(overlay[1]) == []


def test_images(overlay: tuple[str, Objs]) -> None:
    name, objs = overlay
    assert checks.check_images(objs, IMAGE_TAGS[name]) == []


def test_dev_overlay_is_cpu_only_with_virtual_devices(builds: dict[str, Objs]) -> None:
    objs = builds["dev"]
    assert checks.check_no_gpus(objs) == []
    rc = checks.one(objs, "RayCluster")
    assert not rc["spec"].get("enableInTreeAutoscaling")
    devices = {g["groupName"]: _devices(g) for g in rc["spec"]["workerGroupSpecs"]}
    assert {name: [d.kind for d in ds] for name, ds in devices.items()} == {
        "cpu-fast": ["cpu-fast", "cpu-fast"],
        "cpu-slow-spot": ["cpu-slow", "cpu-slow"],
    }
    assert all(not d.gpu and not d.spot and d.emulate_slowdown == 1 for d in devices["cpu-fast"])
    assert all(d.spot and d.emulate_slowdown == 2 for d in devices["cpu-slow-spot"])
    checks.one(objs, "StatefulSet", "shoal-postgres")


def test_gpu_overlay_is_production_shaped(builds: dict[str, Objs]) -> None:
    objs = builds["gpu"]
    rc = checks.one(objs, "RayCluster")
    assert rc["spec"]["enableInTreeAutoscaling"] is True
    groups = rc["spec"]["workerGroupSpecs"]
    devices = {g["groupName"]: _devices(g) for g in groups}
    assert all(d.gpu for ds in devices.values() for d in ds)
    assert {g: {(d.kind, d.spot) for d in ds} for g, ds in devices.items()} == {
        "gpu-a100": {("a100", False)},
        "gpu-l4-spot": {("l4", True)},
    }
    for group in groups:
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert group["maxReplicas"] > group["minReplicas"]
    ingress = checks.one(objs, "Ingress")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == "shoal-control-plane"
    # Larger than the dev control plane.
    dev_cp = checks.one(builds["dev"], "Deployment")["spec"]["template"]["spec"]["containers"][0]
    gpu_cp = checks.one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert _gib(gpu_cp["resources"]["limits"]["memory"]) > _gib(
        dev_cp["resources"]["limits"]["memory"]
    )


def test_every_ray_pod_starts_its_workers_with_shoals_actor_code_imported(
    overlay: tuple[str, Objs],
) -> None:
    """A node that joins starts its Python workers as it starts, with Shoal's actor code
    imported (README): every Ray container reads the settings that ask Ray for it."""
    name, objs = overlay
    maps = {o["metadata"]["name"]: o.get("data") or {} for o in objs if o["kind"] == "ConfigMap"}
    rc = checks.one(objs, "RayCluster")
    for group in [rc["spec"]["headGroupSpec"], *rc["spec"]["workerGroupSpecs"]]:
        for container in group["template"]["spec"]["containers"]:
            env: dict[str, Any] = {}
            for source in container.get("envFrom") or []:
                env.update(maps[source["configMapRef"]["name"]] if "configMapRef" in source else {})
            env.update({var["name"]: var.get("value") for var in container.get("env") or []})
            where = (name, group.get("groupName", "head"), container["name"])
            assert WORKER_PRESTART.items() <= env.items(), (where, env)


def test_head_holds_no_devices(overlay: tuple[str, Objs]) -> None:
    rc = checks.one(overlay[1], "RayCluster")
    head = rc["spec"]["headGroupSpec"]
    assert "shoal.io/device-kind" not in (head.get("labels") or {})
    assert _devices(head) == []


def test_external_database_component_removes_postgres(kubectl: str, k8s_tree: Path) -> None:
    variant = k8s_tree / "overlays" / "gpu-external-db"
    variant.mkdir(exist_ok=True)
    (variant / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources: [../gpu]\ncomponents: [../../components/external-database]\n"
    )
    objs = kustomize(kubectl, variant)
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert not {n for n in names if n[1] == "shoal-postgres"}
    assert ("Deployment", "shoal-control-plane") in names
    assert checks.check_references(objs) == []


# --- the secrets ------------------------------------------------------------------------------


def _env_file(path: Path) -> dict[str, str]:
    lines = [line.strip() for line in path.read_text().splitlines()]
    pairs = [line.split("=", 1) for line in lines if line and not line.startswith("#")]
    return {key: value for key, value in pairs}


def test_secrets_example_has_placeholders_for_every_key_read(builds: dict[str, Objs]) -> None:
    example = _env_file(K8S_DIR / "base" / "secrets.env.example")
    assert example, "secrets.env.example declares no secret"
    assert all("CHANGE_ME" in value for value in example.values())
    read = {
        (what[1], what[2])
        for objs in builds.values()
        for _where, container, _pod in checks.all_containers(objs)
        for how, what in checks.env_sources(container, objs).values()
        if how == "secret"
    }
    required = {key for key, optional in read if not optional}
    assert required <= set(example), f"missing from the example: {required - set(example)}"
    # The values have the shapes Shoal accepts (a filled-in copy only replaces CHANGE_ME).
    Settings(
        database_url=example["SHOAL_DATABASE_URL"],
        admin_token=example["SHOAL_ADMIN_TOKEN"],
    )


def test_real_secrets_file_is_git_ignored() -> None:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    path = "deploy/k8s/base/secrets.env"
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", path], cwd=REPO, check=False, timeout=30
    ).returncode
    assert ignored == 0, f"{path} is not git-ignored"
    tracked = subprocess.run(
        ["git", "ls-files", "--", path], cwd=REPO, capture_output=True, text=True, timeout=30
    ).stdout
    assert tracked == ""


# --- the spot workers' preStop hook -----------------------------------------------------------


def _load_hook() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("shoal_drain_node_hook", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_ray(monkeypatch: pytest.MonkeyPatch, *, actors: list[list[str]], fail: bool) -> list[str]:
    """A stand-in `ray` (no cluster is ever reached): ``actors`` are the successive answers of
    list_actors; returns the log of calls."""
    calls: list[str] = []
    ray = types.ModuleType("ray")
    util = types.ModuleType("ray.util")
    state = types.ModuleType("ray.util.state")

    def init(**kwargs: Any) -> None:
        calls.append(f"init {kwargs['address']}")
        if fail:
            raise ConnectionError("no Ray here")

    def list_actors(filters: list[tuple[str, str, str]]) -> list[str]:
        calls.append(f"list_actors {filters}")
        return actors.pop(0)

    ray.init = init  # type: ignore[attr-defined]
    ray.get_runtime_context = lambda: types.SimpleNamespace(get_node_id=lambda: "ab" * 28)  # type: ignore[attr-defined]
    state.list_actors = list_actors  # type: ignore[attr-defined]
    for name, module in (("ray", ray), ("ray.util", util), ("ray.util.state", state)):
        monkeypatch.setitem(sys.modules, name, module)
    return calls


def _record_sleeps(
    monkeypatch: pytest.MonkeyPatch, hook: Any, calls: list[str], say: Callable[[float], str]
) -> None:
    """The hook's sleeps become entries of ``calls``. ``time.sleep`` is patched for the
    whole process, so another thread's sleeps (a library's, left from an earlier test) sleep
    as before and are not recorded."""
    here, sleep = threading.get_ident(), time.sleep

    def recorded(seconds: float) -> None:
        if threading.get_ident() == here:
            calls.append(say(seconds))
        else:
            sleep(seconds)

    monkeypatch.setattr(hook.time, "sleep", recorded)


def test_drain_hook_drains_then_waits_for_the_actors_to_leave(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hook = _load_hook()
    calls = _fake_ray(monkeypatch, actors=[["stage-worker"], ["stage-worker"], []], fail=False)
    commands: list[list[str]] = []
    monkeypatch.setattr(hook.subprocess, "run", lambda cmd, **kw: commands.append(cmd))
    _record_sleeps(monkeypatch, hook, calls, lambda s: f"sleep {s}")
    assert hook.main(["--deadline-s", "100"]) == 0
    (drain,) = commands
    assert drain[1:4] == ["-m", "ray.scripts.scripts", "drain-node"]
    assert drain[drain.index("--node-id") + 1] == "ab" * 28
    assert drain[drain.index("--reason") + 1] == "DRAIN_NODE_REASON_PREEMPTION"
    assert drain[drain.index("--deadline-remaining-seconds") + 1] == "100"
    assert calls[0] == "init auto"
    assert [c.split()[0] for c in calls[1:]] == ["list_actors", "sleep"] * 2 + ["list_actors"]


def test_drain_hook_waits_out_its_deadline_when_ray_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    hook = _load_hook()
    calls = _fake_ray(monkeypatch, actors=[], fail=True)
    _record_sleeps(monkeypatch, hook, calls, lambda s: f"sleep {round(s)}")
    assert hook.main(["--deadline-s", "40"]) == 0
    assert calls == ["init auto", "sleep 40"]


# --- the checks catch broken manifests --------------------------------------------------------


def _cp(objs: Objs) -> dict[str, Any]:
    return checks.one(objs, "Deployment", "shoal-control-plane")


def _cp_container(objs: Objs) -> dict[str, Any]:
    container: dict[str, Any] = _cp(objs)["spec"]["template"]["spec"]["containers"][0]
    return container


def _group(objs: Objs, name: str) -> dict[str, Any]:
    rc = checks.one(objs, "RayCluster")
    groups: list[dict[str, Any]] = rc["spec"]["workerGroupSpecs"]
    (group,) = [g for g in groups if g["groupName"] == name]
    return group


def _worker(objs: Objs, name: str) -> dict[str, Any]:
    container: dict[str, Any] = _group(objs, name)["template"]["spec"]["containers"][0]
    return container


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(target: dict[str, Any]) -> None:
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return apply


Breakage = tuple[str, str, Callable[[Objs], None], Callable[[Objs], list[str]]]
BREAKAGES: list[Breakage] = [
    (
        "gpu",
        "two control planes",
        lambda o: _set(["spec", "replicas"], 2)(_cp(o)),
        checks.check_control_plane,
    ),
    (
        "gpu",
        "rolling update",
        lambda o: _set(["spec", "strategy"], {"type": "RollingUpdate"})(_cp(o)),
        checks.check_control_plane,
    ),
    (
        "dev",
        "readiness on /healthz",
        lambda o: _set(["readinessProbe", "httpGet", "path"], "/healthz")(_cp_container(o)),
        checks.check_control_plane,
    ),
    (
        "dev",
        "writable root",
        lambda o: _set(["securityContext", "readOnlyRootFilesystem"], False)(_cp_container(o)),
        checks.check_control_plane,
    ),
    (
        "gpu",
        "token in a ConfigMap",
        lambda o: _set(["data", "SHOAL_ADMIN_TOKEN"], "x")(checks.of_kind(o, "ConfigMap")[0]),
        checks.check_no_secret_values,
    ),
    (
        "dev",
        "database URL as a value",
        lambda o: _cp_container(o)["env"].append({"name": "SHOAL_DATABASE_URL", "value": "x"}),
        checks.check_no_secret_values,
    ),
    (
        "gpu",
        "unrenamed Secret in a worker",
        lambda o: _set(["env", 1, "valueFrom", "secretKeyRef", "name"], "shoal-secrets")(
            _worker(o, "gpu-a100")
        ),
        checks.check_references,
    ),
    (
        "gpu",
        "root worker",
        lambda o: _set(["securityContext", "runAsNonRoot"], False)(_worker(o, "gpu-l4-spot")),
        checks.check_hardened,
    ),
    (
        "dev",
        "service links",
        lambda o: _group(o, "cpu-fast")["template"]["spec"].pop("enableServiceLinks"),
        checks.check_hardened,
    ),
    (
        "gpu",
        "two GPUs for Ray, one for Kubernetes",
        lambda o: _set(["rayStartParams", "num-gpus"], "2")(_group(o, "gpu-a100")),
        checks.check_gpu_counts,
    ),
    (
        "gpu",
        "no preStop on spot",
        lambda o: _worker(o, "gpu-l4-spot").pop("lifecycle"),
        checks.check_spot_groups,
    ),
    (
        "dev",
        "short grace on spot",
        lambda o: _set(["template", "spec", "terminationGracePeriodSeconds"], 30)(
            _group(o, "cpu-slow-spot")
        ),
        checks.check_spot_groups,
    ),
    (
        "gpu",
        "spot without toleration",
        lambda o: _group(o, "gpu-l4-spot")["template"]["spec"].pop("tolerations"),
        checks.check_spot_groups,
    ),
    (
        "gpu",
        "on-demand tolerating spot",
        lambda o: _group(o, "gpu-a100")["template"]["spec"]["tolerations"].append(
            {"key": checks.SPOT_TAINT_KEY, "operator": "Exists"}
        ),
        checks.check_spot_groups,
    ),
    (
        "gpu",
        "control plane allowed on spot",
        lambda o: _cp(o)["spec"]["template"]["spec"].pop("affinity"),
        checks.check_spot_groups,
    ),
    (
        "gpu",
        "checkpoints elsewhere on a worker",
        lambda o: _set(["volumeMounts", 0, "mountPath"], "/data")(_worker(o, "gpu-a100")),
        checks.check_checkpoints_shared,
    ),
    (
        "dev",
        "worker without Ray token",
        lambda o: _worker(o, "cpu-fast")["env"].pop(1),
        checks.check_ray_auth,
    ),
    (
        "dev",
        "Ray labels in rayStartParams",
        lambda o: _set(["rayStartParams", "labels"], "a=b")(_group(o, "cpu-fast")),
        checks.check_kuberay_admission,
    ),
    (
        "dev",
        "invalid label value",
        lambda o: _set(["labels", "shoal.io/device-kind"], "fast cpu")(_group(o, "cpu-fast")),
        checks.check_kuberay_admission,
    ),
    (
        "gpu",
        "a control plane with API rights",
        lambda o: _cp(o)["spec"]["template"]["spec"].pop("automountServiceAccountToken"),
        checks.check_no_kubernetes_api_rights,
    ),
    (
        "gpu",
        "a CPU image on a GPU worker",
        lambda o: _set(["image"], "shoal:0.1.0")(_worker(o, "gpu-a100")),
        lambda o: checks.check_images(o, IMAGE_TAGS["gpu"]),
    ),
    (
        "dev",
        "a GPU in dev",
        lambda o: _set(["resources", "limits", checks.GPU_RESOURCE], 1)(_worker(o, "cpu-fast")),
        checks.check_no_gpus,
    ),
]


@pytest.mark.parametrize(
    ("overlay_name", "breakage", "check"),
    [(b[0], b[1], b[3]) for b in BREAKAGES],
    ids=[b[1] for b in BREAKAGES],
)
def test_checks_catch_broken_manifests(
    builds: dict[str, Objs],
    overlay_name: str,
    breakage: str,
    check: Callable[[Objs], list[str]],
) -> None:
    objs = copy.deepcopy(builds[overlay_name])
    assert check(objs) == []
    (break_it,) = [b[2] for b in BREAKAGES if b[1] == breakage]
    break_it(objs)
    assert check(objs) != [], f"{breakage} went unnoticed"


def test_crd_walker_and_schema_catch_unknown_and_mistyped_fields(
    builds: dict[str, Objs], kuberay_schema: dict[str, Any]
) -> None:
    rc = copy.deepcopy(checks.one(builds["gpu"], "RayCluster"))
    rc["spec"]["workerGroupSpecs"][0]["nodeSelector"] = {"a": "b"}  # belongs in the template
    rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["cmd"] = ["x"]
    assert checks.unknown_fields(kuberay_schema, rc) == [
        "spec.headGroupSpec.template.spec.containers[0].cmd",
        "spec.workerGroupSpecs[0].nodeSelector",
    ]
    rc["spec"]["workerGroupSpecs"][0]["maxReplicas"] = "four"
    assert not jsonschema.Draft202012Validator(kuberay_schema).is_valid(rc)


# --- helpers ----------------------------------------------------------------------------------


def _devices(group: dict[str, Any]) -> list[Any]:
    """The devices Shoal's inventory (scheduler.devices) reads from one pod of ``group``."""
    node = NodeInfo(
        node_id="0" * 56,
        alive=True,
        resources=checks.ray_resources(group),
        labels=group.get("labels") or {},
    )
    return node_devices(node)


def _gib(quantity: str) -> float:
    units = {"Mi": 1 / 1024, "Gi": 1.0, "Ti": 1024.0}
    return float(quantity[:-2]) * units[quantity[-2:]]
