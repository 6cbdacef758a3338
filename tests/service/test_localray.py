"""The device spec parser and the local Ray cluster of `shoal up`."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.scheduler.devices import (
    DEVICE_RESOURCE,
    LABEL_KIND,
    LABEL_MEMORY_MB,
    LABEL_SLOWDOWN,
    LABEL_SPOT,
    NodeInfo,
    inventory,
)
from shoal.service import raynode
from shoal.service.devicespec import DeviceSpecError, VirtualNode, parse_devices
from shoal.service.localray import LocalRay, LocalRayError
from shoal.service.localray_record import RECORD, ClusterRecord, ProcessId
from shoal.service.raynode import node_command
from shoal.service.settings import DEFAULT_DEVICES
from tests.service.stand_ins import record_cluster, running_in_session


@pytest.mark.unit
@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (
            DEFAULT_DEVICES,
            [
                VirtualNode(2, "cpu-fast", 2048),
                VirtualNode(2, "cpu-slow", 2048, slowdown=2.0),
            ],
        ),
        ("1xcpu:1", [VirtualNode(1, "cpu", 1)]),
        ("64xt4-16g:10000000", [VirtualNode(64, "t4-16g", 10_000_000)]),
        ("3xa.b:512:spot", [VirtualNode(3, "a.b", 512, spot=True)]),
        (
            " 1xCPU-A:1024 , 2xcpu-b:512:slowdown=1.5:spot ",
            [
                VirtualNode(1, "cpu-a", 1024),
                VirtualNode(2, "cpu-b", 512, slowdown=1.5, spot=True),
            ],
        ),
        ("1xcpu:8:spot:slowdown=4", [VirtualNode(1, "cpu", 8, slowdown=4.0, spot=True)]),
        ("1xcpu:8:slowdown=1", [VirtualNode(1, "cpu", 8)]),
    ],
)
def test_parse_devices_reads_groups(spec: str, expected: list[VirtualNode]) -> None:
    assert parse_devices(spec) == expected


@pytest.mark.unit
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "the device spec is empty"),
        ("   ", "the device spec is empty"),
        ("1xcpu:8,", "has an empty group"),
        ("1xcpu:8,,1xcpu:8", "has an empty group"),
        ("cpu:2048", "'cpu:2048': it does not start with COUNTxKIND:MEMORY_MB"),
        ("2xcpu", "'2xcpu': it does not start with COUNTxKIND:MEMORY_MB"),
        ("x cpu:8", "does not start with COUNTxKIND:MEMORY_MB"),
        ("0xcpu:8", "count 0 is outside 1..64"),
        ("65xcpu:8", "count 65 is outside 1..64"),
        ("-1xcpu:8", "does not start with COUNTxKIND:MEMORY_MB"),
        ("1xcpu:0", "memory (MB) 0 is outside 1..10000000"),
        ("1xcpu:10000001", "memory (MB) 10000001 is outside 1..10000000"),
        ("1xcpu:2GB", "memory (MB) '2GB' is not a whole number"),
        ("1xcpu:", "memory (MB) '' is not a whole number"),
        ("1xcpu:8:slowdown=0.5", "slowdown '0.5' must be a finite number >= 1"),
        ("1xcpu:8:slowdown=inf", "slowdown 'inf' must be a finite number >= 1"),
        ("1xcpu:8:slowdown=nan", "slowdown 'nan' must be a finite number >= 1"),
        ("1xcpu:8:slowdown=fast", "slowdown 'fast' is not a number"),
        ("1xcpu:8:slowdown", "option 'slowdown' is given twice or malformed"),
        ("1xcpu:8:slowdown=2:slowdown=3", "option 'slowdown' is given twice or malformed"),
        ("1xcpu:8:spot:spot", "option 'spot' is given twice or malformed"),
        ("1xcpu:8:spot=yes", "option 'spot' is given twice or malformed"),
        ("1xcpu:8:gpu", "unknown option 'gpu' (known: slowdown=F, spot)"),
        ("1xcpu_fast:8", "is not a device kind"),
        ("1x-cpu:8", "is not a device kind"),
        (",".join(["1xcpu:8"] * 17), "17 groups, more than 16"),
    ],
)
def test_parse_devices_refuses_bad_specs(spec: str, message: str) -> None:
    with pytest.raises(DeviceSpecError) as caught:
        parse_devices(spec)
    assert message in str(caught.value)


@pytest.mark.unit
def test_bad_group_error_names_the_group_and_the_form() -> None:
    with pytest.raises(DeviceSpecError) as caught:
        parse_devices("2xcpu-fast:2048,2xcpu-slow:lots")
    assert str(caught.value) == (
        "device group '2xcpu-slow:lots': memory (MB) 'lots' is not a whole number;"
        " expected COUNTxKIND:MEMORY_MB[:slowdown=F][:spot],"
        " e.g. 2xcpu-fast:2048,2xcpu-slow:2048:slowdown=2"
    )


@pytest.mark.unit
def test_labels_read_back_as_the_declared_devices() -> None:
    node = VirtualNode(3, "cpu-b", 512, slowdown=2.5, spot=True)
    devices = inventory([NodeInfo("n1", True, {DEVICE_RESOURCE: node.count}, node.labels)])
    assert [(d.kind, d.memory_mb, d.spot, d.emulate_slowdown) for d in devices] == [
        ("cpu-b", 512, True, 2.5)
    ] * 3


@pytest.mark.unit
def test_a_node_in_a_container_of_its_own_joins_with_its_devices_and_no_local_ports() -> None:
    """`shoal node GROUP --address` (docker-compose's worker nodes): the same devices as a
    node of `shoal up`'s cluster, but its own machine's address and Ray's default ports."""
    node = VirtualNode(2, "cpu-slow", 2048, slowdown=2.0, spot=True)
    alone = node_command(Path("ray"), node, address="ray-head:6379", shared_machine=False)
    shared = node_command(Path("ray"), node, address="ray-head:6379")
    assert alone[:3] == ["ray", "start", "--block"] and "--address=ray-head:6379" in alone
    assert f"--resources={json.dumps({DEVICE_RESOURCE: 2})}" in alone
    labels = next(a for a in alone if a.startswith("--labels=")).removeprefix("--labels=")
    assert dict(pair.split("=") for pair in labels.split(",")) == node.labels
    assert not [a for a in alone if a.startswith(("--node-ip-address", "--dashboard-agent"))]
    assert "--node-ip-address=127.0.0.1" in shared and set(alone) < set(shared)
    assert not [a for a in shared if a.startswith("--num-gpus")]  # Ray finds the GPUs


class _Handing:
    """A socket the kernel hands ``PORTS`` to, one per bind, a port just released again."""

    PORTS: list[int] = []

    def __init__(self, _family: int) -> None:
        self.port = 0

    def __enter__(self) -> _Handing:
        return self

    def __exit__(self, *_: object) -> None: ...

    def bind(self, _address: tuple[str, int]) -> None:
        self.port = _Handing.PORTS.pop(0)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


@pytest.mark.unit
def test_a_nodes_ports_never_repeat_each_other_or_the_heads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernel may hand out a port just released again: a node's own ports are never
    the same, nor the head's port chosen before them (in one CI run the head's metrics
    port was its GCS port, and `ray start` refused: "metrics_export is trying to use a
    port number 51913 that is used by other components")."""
    monkeypatch.setattr(raynode.socket, "socket", _Handing)
    _Handing.PORTS = [6100, 6100, 6101, 6101, 6100, 6102]
    head = node_command(Path("ray"), VirtualNode(1, "cpu-a", 4096), head_port=6100)
    ports = dict(a.split("=") for a in head if a.startswith("--") and "port=" in a)
    assert ports == {
        "--dashboard-agent-listen-port": "6101",
        "--metrics-export-port": "6102",
        "--port": "6100",
    }


@pytest.mark.unit
def test_a_node_declared_without_gpus_offers_none_even_on_a_gpu_machine() -> None:
    """``shoal bench sharp --device cpu``: its nodes' devices are virtual CPU devices even
    where Ray would find a GPU (a node with GPUs offers those as its devices)."""
    node = VirtualNode(1, "cpu-a", 4096, gpus=0)
    head = node_command(Path("ray"), node, head_port=6390)
    assert "--num-gpus=0" in head and "--head" in head
    assert "--num-gpus=0" in node_command(Path("ray"), node, address="127.0.0.1:6390")


@pytest.mark.unit
def test_local_ray_needs_a_group(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one device group"):
        LocalRay([], tmp_path)


@pytest.mark.unit
def test_address_before_start_says_so(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"not started; call start\(\) first"):
        _ = LocalRay(parse_devices("1xcpu:8"), tmp_path).address


# Asks Ray itself, from a child process: this test session may hold its own Ray connection.
_NODES_SCRIPT = """
import json, sys
import ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
print(json.dumps([
    {"alive": n["Alive"], "resources": n["Resources"], "labels": n["Labels"]} for n in ray.nodes()
]))
"""


# A task on the node of kind argv[2], defined here so that it is sent by value (it imports
# nothing of Shoal itself): whether its worker had Shoal's actor code imported, and whether
# that worker was started before the task was asked for.
_PRESTART_SCRIPT = """
import json, os, sys, time
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
node = next(n["NodeID"] for n in ray.nodes() if n["Labels"].get(sys.argv[3]) == sys.argv[2])
def probe():
    return "shoal.workers.actors" in sys.modules, os.stat(f"/proc/{os.getpid()}").st_ctime
asked = time.time()
task = ray.remote(probe).options(
    num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
)
preloaded, started = ray.get(task.remote(), timeout=60)
print(json.dumps({"preloaded": preloaded, "started_before_asked": started < asked}))
"""


@pytest.mark.integration
@pytest.mark.slow
def test_local_ray_starts_labelled_nodes_and_stops_them(tmp_path: Path) -> None:
    nodes = parse_devices("1xcpu-a:1024,1xcpu-b:512:slowdown=3:spot")
    record_path = tmp_path / RECORD
    local = LocalRay(nodes, tmp_path / "logs", record_path=record_path)
    env_path = tmp_path / "ray.env"
    with local:
        assert local.address.startswith("127.0.0.1:")
        pids = local.pids
        # What a `shoal up` started after this one was killed needs to adopt or stop it.
        record = ClusterRecord.read(record_path)
        assert record is not None and record.owner == ProcessId.this_process()
        assert (record.address, record.token) == (local.address, local.client_env["RAY_AUTH_TOKEN"])
        assert [(n.group, n.process.pid) for n in record.nodes] == list(
            zip(["1xcpu-a:1024", "1xcpu-b:512:slowdown=3:spot"], pids, strict=True)
        )
        assert all(n.process.alive() for n in record.nodes) and local.previous is None
        local.write_env(env_path)
        assert env_path.stat().st_mode & 0o777 == 0o600
        env = LocalRay.read_env(env_path)
        assert env == {"RAY_ADDRESS": local.address, **local.client_env}
        listed = subprocess.run(
            [sys.executable, "-c", _NODES_SCRIPT, env.pop("RAY_ADDRESS")],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, **env},
            timeout=120,
        )
        seen = json.loads(listed.stdout.strip().splitlines()[-1])
        assert all(node["alive"] for node in seen)
        by_kind = {node["labels"][LABEL_KIND]: node for node in seen}
        assert set(by_kind) == {"cpu-a", "cpu-b"}
        a, b = by_kind["cpu-a"], by_kind["cpu-b"]
        assert (a["resources"][DEVICE_RESOURCE], a["resources"]["CPU"]) == (1.0, 2.0)
        assert (b["resources"][DEVICE_RESOURCE], b["resources"]["CPU"]) == (1.0, 1.0)
        assert {k: a["labels"][k] for k in (LABEL_MEMORY_MB, LABEL_SPOT, LABEL_SLOWDOWN)} == {
            LABEL_MEMORY_MB: "1024",
            LABEL_SPOT: "false",
            LABEL_SLOWDOWN: "1",
        }
        assert {k: b["labels"][k] for k in (LABEL_MEMORY_MB, LABEL_SPOT, LABEL_SLOWDOWN)} == {
            LABEL_MEMORY_MB: "512",
            LABEL_SPOT: "true",
            LABEL_SLOWDOWN: "3",
        }
        assert [path.name for path in local.log_paths] == ["ray-0-cpu-a.log", "ray-1-cpu-b.log"]
        # A node that joins starts a worker ahead, Shoal's actor code imported: the first
        # actor placed there (a job growing onto it) does not wait for that import. The
        # nodes the cluster started with start their workers when asked.
        local.add_node(parse_devices("1xcpu-c:256")[0])
        pids = local.pids
        assert [path.name for path in local.log_paths][-1] == "ray-2-cpu-c.log"
        for kind, ahead in (("cpu-c", True), ("cpu-b", False)):
            probed = subprocess.run(
                [sys.executable, "-c", _PRESTART_SCRIPT, local.address, kind, LABEL_KIND],
                capture_output=True,
                text=True,
                env={**os.environ, **env},
                timeout=120,
            )
            assert probed.returncode == 0, probed.stderr[-2000:]
            worker = json.loads(probed.stdout.strip().splitlines()[-1])
            assert worker == {"preloaded": ahead, "started_before_asked": ahead}, (kind, worker)
    assert not env_path.exists() and not record_path.exists()
    # `ray start` leads a session of its own; nothing in it may outlive stop().
    assert [line for pid in pids for line in running_in_session(pid)] == []
    local.stop()  # idempotent
    with pytest.raises(RuntimeError, match="not started"):
        _ = local.address


@pytest.mark.integration
def test_start_timeout_names_the_log_and_leaves_nothing_running(tmp_path: Path) -> None:
    local = LocalRay(
        parse_devices("1xcpu:64"), tmp_path / "logs", start_timeout_s=0.1, stop_timeout_s=1.0
    )
    with pytest.raises(LocalRayError) as caught:
        local.start()
    log = tmp_path / "logs" / "ray-0-cpu.log"
    assert str(caught.value) == (
        f"timed out after 0.1 s waiting for the Ray head to accept connections; see {log}"
    )
    command = log.read_text().splitlines()[0]
    port = next(arg for arg in command.split() if arg.startswith("--port="))
    still_running = subprocess.run(
        ["pgrep", "-f", "--", f"--head {port} "], capture_output=True, text=True, check=False
    ).stdout
    assert still_running == ""


@pytest.mark.unit
@pytest.mark.parametrize(
    "spec", [DEFAULT_DEVICES, "1xcpu:1", "3xa.b:512:spot", "2xcpu-b:512:slowdown=1.5:spot"]
)
def test_a_node_group_reads_back_as_the_same_node(spec: str) -> None:
    nodes = parse_devices(spec)
    assert parse_devices(",".join(node.group for node in nodes)) == nodes


@pytest.mark.unit
def test_a_record_reads_back_private_and_an_unreadable_one_says_what_to_do(
    tmp_path: Path,
) -> None:
    me = ProcessId.this_process()
    assert me.alive() and not me.pid_reused()
    path = tmp_path / RECORD
    written = record_cluster(path, {"1xcpu:8": me, "2xcpu-b:8:spot": me})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ClusterRecord.read(path) == written
    assert ClusterRecord.read(tmp_path / "none.json") is None
    path.write_text("{")
    with pytest.raises(LocalRayError, match=r"cannot read .*\.json .* then delete the file$"):
        LocalRay.stop_recorded(path)


@pytest.mark.unit
def test_a_cluster_whose_shoal_up_runs_is_left_to_it(tmp_path: Path) -> None:
    path = tmp_path / RECORD
    ClusterRecord("127.0.0.1:1", "t", ProcessId.this_process(), ()).write(path)
    message = f"another `shoal up` (pid {os.getpid()}) runs the local Ray cluster recorded in"
    with pytest.raises(LocalRayError, match=re.escape(message)):
        LocalRay.stop_recorded(path)
    with pytest.raises(LocalRayError, match=re.escape(message)):
        LocalRay(parse_devices("1xcpu:8"), tmp_path / "logs", record_path=path).start()
    assert path.exists() and not (tmp_path / "logs").exists()


@pytest.mark.unit
def test_a_recorded_cluster_is_stopped_session_and_all(
    fake_node: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    path = tmp_path / RECORD
    node = ProcessId.of(fake_node.pid)
    assert node is not None
    record = record_cluster(path, {"1xcpu:8": node})
    assert LocalRay.stop_recorded(path) == (
        f"stopped the local Ray cluster at {record.address} an earlier `shoal up` left"
    )
    assert fake_node.wait(timeout=10) == -signal.SIGKILL
    assert running_in_session(fake_node.pid) == [] and not path.exists()


@pytest.mark.unit
def test_a_pid_another_process_holds_now_is_never_signalled(
    fake_node: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    path = tmp_path / RECORD
    record_cluster(path, {"1xcpu:8": ProcessId(fake_node.pid, "Thu Jan  1 00:00:00 1970")})
    assert LocalRay.stop_recorded(path) is not None
    assert fake_node.poll() is None and len(running_in_session(fake_node.pid)) == 2
    assert not path.exists()


@pytest.mark.integration
@pytest.mark.parametrize("stale", [False, True], ids=["other-devices", "pid-of-another"])
def test_an_unusable_recorded_cluster_is_stopped_before_a_new_one_starts(
    stale: bool, fake_node: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    """Recorded with other device groups, the cluster is stopped (its session and all);
    recorded under a pid another process holds now, it is gone and that process is left
    alone. Either way a new cluster starts (cut short here by its start timeout)."""
    path = tmp_path / RECORD
    node = ProcessId.of(fake_node.pid)
    assert node is not None
    if stale:
        node = ProcessId(node.pid, "Thu Jan  1 00:00:00 1970")
    record = record_cluster(path, {"1xcpu:64" if stale else "1xother:8": node})
    local = LocalRay(
        parse_devices("1xcpu:64"),
        tmp_path / "logs",
        record_path=path,
        start_timeout_s=0.1,
        stop_timeout_s=1.0,
    )
    with pytest.raises(LocalRayError, match="waiting for the Ray head to accept connections"):
        local.start()
    reason = (
        "its node 1xcpu:64 is gone"
        if stale
        else "it runs the device groups 1xother:8, not 1xcpu:64"
    )
    assert local.previous == (
        f"stopped the local Ray cluster at {record.address} an earlier `shoal up` left running:"
        f" {reason}"
    )
    if stale:
        assert fake_node.poll() is None and len(running_in_session(fake_node.pid)) == 2
    else:
        assert fake_node.wait(timeout=10) == -signal.SIGKILL
        assert running_in_session(fake_node.pid) == []
    assert not path.exists()  # the new cluster's record went with it
