"""What a built Shoal install (`kubectl kustomize deploy/k8s/overlays/NAME`) must satisfy.

Each ``check_*`` takes the built objects (plain dicts) and returns the problems it finds, one
readable line each, so a test asserts an empty list and another shows that a broken manifest is
caught. Nothing here talks to a cluster.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]

NAMESPACE = "shoal"
SHOAL_IMAGE = "shoal"
GPU_RESOURCE = "nvidia.com/gpu"
SPOT_TAINT_KEY = "cloud.google.com/gke-spot"
CHECKPOINT_CLAIM = "shoal-checkpoints"
CHECKPOINT_ROOT_VAR = "SHOAL_CHECKPOINT_ROOT"
SECRET_NAME_RE = re.compile(r"TOKEN|PASSWORD|SECRET|DATABASE_URL|CREDENTIAL", re.IGNORECASE)
# KubeRay refuses a group whose rayStartParams declares resources while its `resources` field does.
RAY_START_RESOURCE_KEYS = ("num-cpus", "num-gpus", "memory", "resources")
LABEL_NAME_RE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$")
LABEL_PREFIX_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS1035_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class Pod:
    """One pod template of the install: where it is, its spec, and for Ray pods its group."""

    where: str
    spec: Obj
    ray_group: Obj | None = None
    ray_head: bool = False
    cluster: Obj | None = None

    @property
    def is_ray(self) -> bool:
        return self.cluster is not None

    @property
    def ray_container(self) -> Obj:
        """KubeRay's Ray container is the pod's first one."""
        container: Obj = self.spec["containers"][0]
        return container


def of_kind(objs: Sequence[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o.get("kind") == kind]


def one(objs: Sequence[Obj], kind: str, name: str | None = None) -> Obj:
    found = [o for o in of_kind(objs, kind) if name is None or o["metadata"]["name"] == name]
    if len(found) != 1:
        raise LookupError(f"expected one {kind} {name or ''}, found {len(found)}")
    return found[0]


def pods(objs: Sequence[Obj]) -> Iterator[Pod]:
    """Every pod template: Deployments, StatefulSets, each RayCluster's head and worker groups."""
    for obj in objs:
        kind, name = obj.get("kind"), obj["metadata"]["name"]
        if kind in ("Deployment", "StatefulSet"):
            yield Pod(f"{kind}/{name}", obj["spec"]["template"]["spec"])
        elif kind == "RayCluster":
            head = obj["spec"]["headGroupSpec"]
            yield Pod(f"RayCluster/{name} head", head["template"]["spec"], head, True, obj)
            for group in obj["spec"].get("workerGroupSpecs") or []:
                where = f"RayCluster/{name} group {group['groupName']}"
                yield Pod(where, group["template"]["spec"], group, False, obj)


def ray_workers(objs: Sequence[Obj]) -> list[Pod]:
    return [p for p in pods(objs) if p.is_ray and not p.ray_head]


def containers(pod: Pod) -> Iterator[tuple[str, Obj]]:
    for key in ("initContainers", "containers"):
        for container in pod.spec.get(key) or []:
            yield f"{pod.where} container {container['name']}", container


def all_containers(objs: Sequence[Obj]) -> Iterator[tuple[str, Obj, Pod]]:
    """Every container, with KubeRay's autoscaler sidecar (from autoscalerOptions) in its pod."""
    for pod in pods(objs):
        for where, container in containers(pod):
            yield where, container, pod
        if pod.ray_head and pod.cluster and pod.cluster["spec"].get("enableInTreeAutoscaling"):
            options = pod.cluster["spec"].get("autoscalerOptions") or {}
            yield f"{pod.where} autoscaler", {"name": "autoscaler", **options}, pod


def is_shoal_image(image: str) -> bool:
    return image.rsplit("/", 1)[-1].split(":", 1)[0] == SHOAL_IMAGE


def env_sources(container: Obj, objs: Sequence[Obj]) -> dict[str, tuple[str, Any]]:
    """Each environment variable of ``container`` -> (how it is set, what): ``("value", v)``,
    ``("secret", (name, key, optional))`` or ``("configmap", (name, value))``. ``env`` wins
    over ``envFrom``, as in Kubernetes."""
    out: dict[str, tuple[str, Any]] = {}
    maps = {o["metadata"]["name"]: o.get("data") or {} for o in of_kind(objs, "ConfigMap")}
    for source in container.get("envFrom") or []:
        ref = source.get("configMapRef")
        if ref:
            for key, value in maps.get(ref["name"], {}).items():
                out[key] = ("configmap", (ref["name"], value))
    for var in container.get("env") or []:
        if "value" in var:
            out[var["name"]] = ("value", var["value"])
        elif "secretKeyRef" in (var.get("valueFrom") or {}):
            ref = var["valueFrom"]["secretKeyRef"]
            out[var["name"]] = ("secret", (ref["name"], ref["key"], bool(ref.get("optional"))))
        else:
            out[var["name"]] = ("other", var.get("valueFrom"))
    return out


def resolved_env(container: Obj, objs: Sequence[Obj]) -> dict[str, str]:
    """The plain (non-secret) values of ``container``'s environment."""
    return {
        name: (what if how == "value" else what[1])
        for name, (how, what) in env_sources(container, objs).items()
        if how in ("value", "configmap")
    }


# --- the whole install ------------------------------------------------------------------------


def check_namespaced(objs: Sequence[Obj]) -> list[str]:
    return [
        f"{o['kind']}/{o['metadata']['name']} is in namespace {o['metadata'].get('namespace')}"
        for o in objs
        if o["kind"] != "Namespace" and o["metadata"].get("namespace") != NAMESPACE
    ]


def check_references(objs: Sequence[Obj]) -> list[str]:
    """Every Secret, ConfigMap and claim a pod names exists in the build, with the keys it reads
    (a RayCluster's references are renamed by kustomize only through kustomizeconfig.yaml)."""
    secrets = {o["metadata"]["name"]: o.get("data") or {} for o in of_kind(objs, "Secret")}
    maps = {o["metadata"]["name"] for o in of_kind(objs, "ConfigMap")}
    claims = {o["metadata"]["name"] for o in of_kind(objs, "PersistentVolumeClaim")}
    problems = []
    for where, container, _pod in all_containers(objs):
        for name, (how, what) in env_sources(container, objs).items():
            if how == "secret":
                secret, key, optional = what
                if secret not in secrets:
                    problems.append(f"{where}: {name} reads missing Secret {secret}")
                elif key not in secrets[secret] and not optional:
                    problems.append(f"{where}: {name} reads missing key {key} of {secret}")
        for source in container.get("envFrom") or []:
            ref = source.get("configMapRef") or {}
            if ref and ref["name"] not in maps:
                problems.append(f"{where}: envFrom names missing ConfigMap {ref['name']}")
    for pod in pods(objs):
        for volume in pod.spec.get("volumes") or []:
            if "configMap" in volume and volume["configMap"]["name"] not in maps:
                problems.append(f"{pod.where}: volume of missing ConfigMap {volume['configMap']}")
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if claim is not None and claim not in claims:
                problems.append(f"{pod.where}: volume of missing claim {claim}")
    return problems


def check_no_secret_values(objs: Sequence[Obj]) -> list[str]:
    """Secrets only through secretKeyRef: none in a ConfigMap, none as a literal `value:`."""
    problems = []
    for cm in of_kind(objs, "ConfigMap"):
        for key in cm.get("data") or {}:
            if SECRET_NAME_RE.search(key):
                problems.append(f"ConfigMap/{cm['metadata']['name']} holds secret-like {key}")
    for where, container, _pod in all_containers(objs):
        for var in container.get("env") or []:
            if SECRET_NAME_RE.search(var["name"]) and "secretKeyRef" not in (
                var.get("valueFrom") or {}
            ):
                problems.append(f"{where}: {var['name']} is not read from a Secret")
    return problems


def check_hardened(objs: Sequence[Obj]) -> list[str]:
    """Every container: not root, no privilege escalation, no capabilities; every pod: the
    runtime's seccomp profile, no Service environment variables (SHOAL_*_PORT would look like
    settings)."""
    problems = []
    for pod in pods(objs):
        pod_ctx = pod.spec.get("securityContext") or {}
        if (pod_ctx.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
            problems.append(f"{pod.where}: no RuntimeDefault seccomp profile")
        if pod.spec.get("enableServiceLinks") is not False:
            problems.append(f"{pod.where}: enableServiceLinks is not false")
    for where, container, pod in all_containers(objs):
        pod_ctx = pod.spec.get("securityContext") or {}
        ctx = container.get("securityContext") or {}
        non_root = ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot"))
        uid = ctx.get("runAsUser", pod_ctx.get("runAsUser"))
        if non_root is not True or uid == 0:
            problems.append(f"{where}: may run as root")
        if ctx.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{where}: allowPrivilegeEscalation is not false")
        if (ctx.get("capabilities") or {}).get("drop") != ["ALL"]:
            problems.append(f"{where}: does not drop all capabilities")
        if ctx.get("privileged"):
            problems.append(f"{where}: privileged")
    return problems


def check_no_kubernetes_api_rights(objs: Sequence[Obj]) -> list[str]:
    """Shoal talks to Ray, not to the Kubernetes API: no RBAC objects, no API tokens in pods.
    The exception is the Ray head when KubeRay's autoscaler runs beside it (KubeRay gives it
    its own ServiceAccount and Role)."""
    problems = [
        f"{o['kind']}/{o['metadata']['name']}: Shoal needs no RBAC"
        for o in objs
        if o["kind"] in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding")
    ]
    for sa in of_kind(objs, "ServiceAccount"):
        if sa.get("automountServiceAccountToken") is not False:
            problems.append(f"ServiceAccount/{sa['metadata']['name']} mounts API tokens")
    for pod in pods(objs):
        autoscaled = bool(pod.cluster and pod.cluster["spec"].get("enableInTreeAutoscaling"))
        wanted = pod.ray_head and autoscaled
        mounted = pod.spec.get("automountServiceAccountToken")
        if wanted and mounted is False:
            problems.append(f"{pod.where}: the autoscaler sidecar needs its API token")
        if not wanted and mounted is not False:
            problems.append(f"{pod.where}: mounts an API token it does not need")
    return problems


# --- the control plane ------------------------------------------------------------------------


def _probe_target(probe: Obj | None) -> tuple[str, Any] | None:
    get = (probe or {}).get("httpGet")
    return (get["path"], get["port"]) if get else None


def check_control_plane(objs: Sequence[Obj]) -> list[str]:
    """One replica, replaced with Recreate (one controller); probes on /readyz and /healthz;
    requests and limits; read-only root with writable /tmp and SHOAL_HOME; its Service."""
    problems = []
    dep = one(objs, "Deployment", "shoal-control-plane")
    spec, pod = dep["spec"], dep["spec"]["template"]["spec"]
    if spec.get("replicas") != 1:
        problems.append(f"control plane replicas {spec.get('replicas')}, not 1")
    if (spec.get("strategy") or {}).get("type") != "Recreate":
        problems.append("control plane strategy is not Recreate")
    sa = pod.get("serviceAccountName")
    if sa not in {o["metadata"]["name"] for o in of_kind(objs, "ServiceAccount")}:
        problems.append(f"control plane service account {sa!r} is not in the install")
    (container,) = pod["containers"]
    if [*container.get("command", []), *container.get("args", [])] != [
        "shoal-entrypoint",
        "control-plane",
    ]:
        problems.append("control plane does not run `shoal-entrypoint control-plane`")
    if _probe_target(container.get("readinessProbe")) != ("/readyz", 8000):
        problems.append("control plane readiness probe is not GET /readyz on 8000")
    if _probe_target(container.get("livenessProbe")) != ("/healthz", 8000):
        problems.append("control plane liveness probe is not GET /healthz on 8000")
    resources = container.get("resources") or {}
    for part in ("requests", "limits"):
        if not {"cpu", "memory"} <= set(resources.get(part) or {}):
            problems.append(f"control plane has no cpu and memory {part}")
    if (container.get("securityContext") or {}).get("readOnlyRootFilesystem") is not True:
        problems.append("control plane root filesystem is writable")
    env = resolved_env(container, objs)
    empty_dirs = {v["name"] for v in pod.get("volumes") or [] if "emptyDir" in v}
    mounts = container.get("volumeMounts") or []
    mounted = {m["mountPath"] for m in mounts if m["name"] in empty_dirs}
    for path in ("/tmp", env.get("SHOAL_HOME")):
        if path not in mounted:
            problems.append(f"control plane has no writable emptyDir at {path}")
    if env.get("SHOAL_PORT", "8000") != "8000":
        problems.append(f"control plane SHOAL_PORT {env['SHOAL_PORT']}, probes use 8000")
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports") or []}
    service = one(objs, "Service", "shoal-control-plane")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    if service["spec"].get("type", "ClusterIP") != "ClusterIP":
        problems.append("control plane Service is not ClusterIP")
    if any(labels.get(k) != v for k, v in service["spec"]["selector"].items()):
        problems.append("control plane Service does not select its pods")
    for port in service["spec"]["ports"]:
        target = port.get("targetPort", port["port"])
        if port["port"] != 8000 or ports.get(target, target) != 8000:
            problems.append(f"control plane Service port {port} does not reach 8000")
    return problems


# --- Ray --------------------------------------------------------------------------------------


def ray_resources(group: Mapping[str, Any]) -> dict[str, float]:
    """The Ray resources a group's pods declare: rayStartParams (num-cpus, num-gpus, the
    `resources` JSON, quoted for the shell) or the group's `resources` field."""
    params = group.get("rayStartParams") or {}
    out: dict[str, float] = {}
    if "num-cpus" in params:
        out["CPU"] = float(params["num-cpus"])
    if "num-gpus" in params:
        out["GPU"] = float(params["num-gpus"])
    if "resources" in params:
        text = params["resources"].strip()
        if text[:1] in "'\"" and text[:1] == text[-1:]:
            text = text[1:-1].replace("\\", "")
        out.update({k: float(v) for k, v in json.loads(text).items()})
    for key, value in (group.get("resources") or {}).items():
        out["GPU" if key.lower() in ("gpu", GPU_RESOURCE) else key] = float(value)
    return out


def _quantity(value: Any) -> float:
    return float(value) if value is not None else 0.0


def check_kuberay_admission(objs: Sequence[Obj]) -> list[str]:
    """What KubeRay's ValidateRayClusterSpec refuses, which no schema can tell (kuberay
    ray-operator/controllers/ray/utils/validation.go)."""
    problems = []
    for rc in of_kind(objs, "RayCluster"):
        name = rc["metadata"]["name"]
        if not DNS1035_RE.match(name):
            problems.append(f"RayCluster {name}: not a DNS-1035 label")
        autoscaled = bool(rc["spec"].get("enableInTreeAutoscaling"))
        v2 = (rc["spec"].get("autoscalerOptions") or {}).get("version") == "v2"
        groups = [("head", rc["spec"]["headGroupSpec"])] + [
            (g["groupName"], g) for g in rc["spec"].get("workerGroupSpecs") or []
        ]
        for group_name, group in groups:
            params = group.get("rayStartParams") or {}
            if "labels" in params:
                problems.append(f"{group_name}: rayStartParams labels (use the labels field)")
            if group.get("resources") and any(params.get(k) for k in RAY_START_RESOURCE_KEYS):
                problems.append(f"{group_name}: resources in rayStartParams and resources")
            for key, value in (group.get("labels") or {}).items():
                prefix, _, label = key.rpartition("/")
                if (prefix and not LABEL_PREFIX_RE.match(prefix)) or not LABEL_NAME_RE.match(label):
                    problems.append(f"{group_name}: label key {key!r} is invalid")
                if value and (len(value) > 63 or not LABEL_NAME_RE.match(value)):
                    problems.append(f"{group_name}: label {key}={value!r} has an invalid value")
            restart = group["template"]["spec"].get("restartPolicy")
            if autoscaled and v2 and restart not in (None, "Never"):
                problems.append(f"{group_name}: restartPolicy {restart} under autoscaler v2")
        for group in rc["spec"].get("workerGroupSpecs") or []:
            low, high = group.get("minReplicas"), group.get("maxReplicas")
            if not autoscaled and (low is None or high is None):
                problems.append(f"{group['groupName']}: needs minReplicas and maxReplicas")
            replicas = group.get("replicas", low or 0)
            if low is not None and high is not None and not low <= replicas <= high:
                problems.append(f"{group['groupName']}: replicas {replicas} not in [{low}, {high}]")
    return problems


def check_gpu_counts(objs: Sequence[Obj]) -> list[str]:
    """Each Ray pod's GPUs for Ray (num-gpus) equal its container's nvidia.com/gpu; the head
    has none."""
    problems = []
    for pod in pods(objs):
        if not pod.is_ray:
            continue
        assert pod.ray_group is not None
        resources = pod.ray_container.get("resources") or {}
        limit = _quantity((resources.get("limits") or {}).get(GPU_RESOURCE))
        request = (resources.get("requests") or {}).get(GPU_RESOURCE)
        declared = ray_resources(pod.ray_group).get("GPU", 0.0)
        if limit != declared:
            problems.append(f"{pod.where}: {GPU_RESOURCE} limit {limit} but num-gpus {declared}")
        if request is not None and _quantity(request) != limit:
            problems.append(f"{pod.where}: {GPU_RESOURCE} request differs from its limit")
        if pod.ray_head and (limit or declared):
            problems.append(f"{pod.where}: the head must hold no GPU")
    return problems


def _tolerates_spot(spec: Obj) -> bool:
    return any(
        t.get("key") == SPOT_TAINT_KEY or (t.get("operator") == "Exists" and not t.get("key"))
        for t in spec.get("tolerations") or []
    )


def _spot_affinity(spec: Obj) -> set[str]:
    """How the pod's required node affinity treats the spot label: ``{"spot"}`` (In true),
    ``{"on-demand"}`` (DoesNotExist, NotIn true) or empty (it does not care)."""
    terms = (
        ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        )
        or {}
    ).get("nodeSelectorTerms") or []
    seen = set()
    for term in terms:
        for expr in term.get("matchExpressions") or []:
            if expr["key"] != SPOT_TAINT_KEY:
                continue
            if expr["operator"] == "In" and "true" in expr.get("values", []):
                seen.add("spot")
            elif expr["operator"] in ("DoesNotExist", "NotIn"):
                seen.add("on-demand")
    if (spec.get("nodeSelector") or {}).get(SPOT_TAINT_KEY) == "true":
        seen.add("spot")
    return seen


def is_spot(pod: Pod) -> bool:
    """A Ray group whose devices Shoal sees as spot (the node label shoal.io/spot)."""
    labels = (pod.ray_group or {}).get("labels") or {}
    return bool(labels.get("shoal.io/spot") == "true")


def _deadline_s(command: Sequence[str]) -> int | None:
    args = list(command)
    return int(args[args.index("--deadline-s") + 1]) if "--deadline-s" in args else None


def check_spot_groups(objs: Sequence[Obj]) -> list[str]:
    """Spot workers drain before they stop (preStop hook, a grace period longer than its
    deadline, the hook script mounted); spot GPU workers tolerate and select spot nodes;
    everything else tolerates no spot taint, and once any pod selects spot nodes, all others
    keep off them."""
    problems = []
    uses_spot_nodes = any("spot" in _spot_affinity(p.spec) for p in pods(objs))
    for pod in pods(objs):
        if is_spot(pod):
            grace = pod.spec.get("terminationGracePeriodSeconds", 30)
            if grace < 60:
                problems.append(f"{pod.where}: terminationGracePeriodSeconds {grace} < 60")
            hook = ((pod.ray_container.get("lifecycle") or {}).get("preStop") or {}).get("exec")
            if not hook:
                problems.append(f"{pod.where}: no preStop hook")
                continue
            deadline = _deadline_s(hook["command"])
            if deadline is not None and deadline >= grace:
                problems.append(f"{pod.where}: hook deadline {deadline} s >= grace {grace} s")
            scripts = [a for a in hook["command"] if a.startswith("/")]
            mounts = [m["mountPath"] for m in pod.ray_container.get("volumeMounts") or []]
            for script in scripts:
                if not any(script.startswith(m.rstrip("/") + "/") for m in mounts):
                    problems.append(f"{pod.where}: hook script {script} is not mounted")
            has_gpu = ray_resources(pod.ray_group or {}).get("GPU", 0) > 0
            if has_gpu and not _tolerates_spot(pod.spec):
                problems.append(f"{pod.where}: spot GPU group does not tolerate {SPOT_TAINT_KEY}")
            if has_gpu and "spot" not in _spot_affinity(pod.spec):
                problems.append(f"{pod.where}: spot GPU group does not select spot nodes")
        else:
            if _tolerates_spot(pod.spec):
                problems.append(f"{pod.where}: tolerates spot nodes")
            if "spot" in _spot_affinity(pod.spec):
                problems.append(f"{pod.where}: selects spot nodes")
            if uses_spot_nodes and "on-demand" not in _spot_affinity(pod.spec):
                problems.append(f"{pod.where}: may land on a spot node")
    return problems


def check_ray_auth(objs: Sequence[Obj]) -> list[str]:
    """Every Ray process, the control plane's Ray node included, runs with token auth, the token
    from the Secret, both under `env` (KubeRay copies a worker's `env` into its init container,
    not its `envFrom`)."""
    problems = []
    for where, container, pod in all_containers(objs):
        uses_ray = pod.is_ray or is_shoal_image(container.get("image", ""))
        if not uses_ray:
            continue
        env = {v["name"]: v for v in container.get("env") or []}
        if (env.get("RAY_AUTH_MODE") or {}).get("value") != "token":
            problems.append(f"{where}: RAY_AUTH_MODE is not token under env")
        if "secretKeyRef" not in ((env.get("RAY_AUTH_TOKEN") or {}).get("valueFrom") or {}):
            problems.append(f"{where}: RAY_AUTH_TOKEN is not read from a Secret under env")
    return problems


def check_checkpoints_shared(objs: Sequence[Obj]) -> list[str]:
    """SHOAL_CHECKPOINT_ROOT is the same everywhere; a directory is the ReadWriteMany checkpoint
    claim, mounted at that path in the control plane and in every Ray container (an object store
    URL, s3://..., needs no volume)."""
    problems = []
    claim = one(objs, "PersistentVolumeClaim", CHECKPOINT_CLAIM)
    if "ReadWriteMany" not in claim["spec"]["accessModes"]:
        problems.append(f"{CHECKPOINT_CLAIM} is not ReadWriteMany")
    roots = set()
    for pod in pods(objs):
        container = pod.ray_container
        if not (pod.is_ray or is_shoal_image(container.get("image", ""))):
            continue
        root = resolved_env(container, objs).get(CHECKPOINT_ROOT_VAR)
        roots.add(root)
        volumes = {
            v["name"]
            for v in pod.spec.get("volumes") or []
            if (v.get("persistentVolumeClaim") or {}).get("claimName") == CHECKPOINT_CLAIM
        }
        mounts = container.get("volumeMounts") or []
        paths = [m["mountPath"] for m in mounts if m["name"] in volumes]
        if root is not None and "://" in root:
            continue
        if paths != [root]:
            problems.append(f"{pod.where}: {CHECKPOINT_CLAIM} at {paths}, root is {root}")
    if len(roots) != 1:
        problems.append(f"{CHECKPOINT_ROOT_VAR} differs between pods: {sorted(map(str, roots))}")
    return problems


def check_images(objs: Sequence[Obj], tag: str) -> list[str]:
    """Every Shoal container (and KubeRay's autoscaler, which runs the head's image) uses
    ``shoal:<tag>``."""
    problems = []
    for where, container, _pod in all_containers(objs):
        image = container.get("image")
        if image is None and where.endswith("autoscaler"):
            continue
        if is_shoal_image(image or "") and not (image or "").endswith(f":{tag}"):
            problems.append(f"{where}: image {image}, not tag {tag}")
    if not any(is_shoal_image(c.get("image", "")) for _w, c, _p in all_containers(objs)):
        problems.append("no container runs the shoal image")
    return problems


def check_no_gpus(objs: Sequence[Obj]) -> list[str]:
    problems = []
    for where, container, pod in all_containers(objs):
        resources = container.get("resources") or {}
        for part in ("requests", "limits"):
            if GPU_RESOURCE in (resources.get(part) or {}):
                problems.append(f"{where}: {part} {GPU_RESOURCE}")
        if pod.ray_group and ray_resources(pod.ray_group).get("GPU"):
            problems.append(f"{pod.where}: declares GPUs to Ray")
    return problems


# --- KubeRay's CRD schema ---------------------------------------------------------------------


def unknown_fields(schema: Mapping[str, Any], value: Any, path: str = "") -> list[str]:
    """Fields of ``value`` that ``schema`` (a structural CRD schema) does not define, which the
    API server would prune (or refuse, with strict field validation). ``x-kubernetes-*``
    extensions other than preserve-unknown-fields don't change what is known."""
    if isinstance(value, list):
        items = schema.get("items")
        if not isinstance(items, Mapping):
            return []
        return [p for i, v in enumerate(value) for p in unknown_fields(items, v, f"{path}[{i}]")]
    if not isinstance(value, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if path == "" or path == "metadata":  # the object's own metadata: checked by the server
        props = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
        value = {k: v for k, v in value.items() if k != "metadata"}
    else:
        props = schema.get("properties") or {}
    extra = schema.get("additionalProperties")
    problems = []
    for key, sub in value.items():
        where = f"{path}.{key}" if path else key
        if key in props:
            problems += unknown_fields(props[key], sub, where)
        elif isinstance(extra, Mapping):
            problems += unknown_fields(extra, sub, where)
        elif extra is not True:
            problems.append(where)
    return problems
