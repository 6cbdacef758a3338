"""Actor lifecycles: the one module that creates and kills Shoal's Ray actors.

Three kinds of actors exist. A **JobRunner** per job is detached and named
``shoal-job-<id>`` in the ``shoal`` namespace, so it outlives the control plane that
started it and is found again by name after a restart. **StageWorkers** are created by
their runner (inside the runner actor), which makes the runner their owner: they die with
it, and nothing else needs to clean them up. **ShardWorkers** (one per device of the SHARP
executor, ``workers.shard_host``) are owned the same way by the runner that trains their
models.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from scheduler.devices import DEVICE_RESOURCE, Device
from scheduler.types import JobId
from workers.shard_host import ShardWorker
from workers.snapshot import JobSnapshot, StagePlan
from workers.stage import StageSetup
from workers.stage_worker import StageWorker

RUNNER_NAMESPACE = "shoal"
COPIES_GROUP = "copies"
"""The StageWorker's concurrency group for ``workers.stage_worker.COPIES`` calls."""
RUNNER_CONCURRENCY = 4
"""Threads of a runner actor: ``run`` holds one for the whole job; ``poll``/``cancel`` use the
others, so they answer while it trains."""

# Ray's typing of remote classes is partial; the actor classes are used untyped.
_remote: Any = ray.remote
_StageWorkerActor: Any = _remote(concurrency_groups={COPIES_GROUP: 1})(StageWorker)
_ShardWorkerActor: Any = ray.remote(ShardWorker)


def runner_name(job_id: JobId) -> str:
    return f"shoal-job-{job_id}"


def find_runner(job_id: JobId) -> ActorHandle[Any] | None:
    """The job's live runner actor, or None if there is none (never started, or dead)."""
    try:
        return ray.get_actor(runner_name(job_id), namespace=RUNNER_NAMESPACE)
    except ValueError:  # Ray's answer for "no live actor of that name"
        return None


def start_runner(snapshot: JobSnapshot) -> ActorHandle[Any]:
    """The job's runner, started and set training unless it already exists.

    ``get_if_exists`` makes two racing starts share one actor; ``JobRunner.run`` ignores a
    second call, so the race at worst sends one no-op.
    """
    existing = find_runner(snapshot.job_id)
    if existing is not None:
        return existing
    # Imported here: runner -> group -> launch would otherwise be an import cycle.
    from workers.runner import JobRunner

    runner_actor: Any = ray.remote(JobRunner)
    runner: ActorHandle[Any] = runner_actor.options(
        name=runner_name(snapshot.job_id),
        namespace=RUNNER_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_concurrency=RUNNER_CONCURRENCY,
        max_restarts=0,
        # On the head (on-demand, beside the control plane, in a cluster of spot workers):
        # losing a stage's node must not take the runner that recovers it along. Hard: with
        # soft=True, Ray 2.60 placed it on another node of a 2-node local cluster (measured).
        scheduling_strategy=NodeAffinitySchedulingStrategy(_head_node_id(), soft=False),
    ).remote(snapshot)
    # Not awaited: ``run`` returns when training ends; progress is read with ``poll``.
    runner.run.remote()
    return runner


def pool_name(sweep_id: str) -> str:
    return f"shoal-sweep-{sweep_id}"


def find_pool(sweep_id: str) -> ActorHandle[Any] | None:
    """The sweep's live SHARP executor actor, or None."""
    try:
        return ray.get_actor(pool_name(sweep_id), namespace=RUNNER_NAMESPACE)
    except ValueError:
        return None


def start_pool(sweep_id: str, devices: Sequence[Device], policy: str) -> ActorHandle[Any]:
    """The sweep's SHARP executor (``workers.sweep_executor.SweepExecutor``) on ``devices``,
    started and running unless it exists: detached and named, on the head node, like a
    job's runner, so it outlives the control plane and is found again."""
    existing = find_pool(sweep_id)
    if existing is not None:
        return existing
    from workers.sweep_executor import SweepExecutor

    pool_actor: Any = ray.remote(SweepExecutor)
    pool: ActorHandle[Any] = pool_actor.options(
        name=pool_name(sweep_id),
        namespace=RUNNER_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_concurrency=RUNNER_CONCURRENCY,
        max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(_head_node_id(), soft=False),
    ).remote(list(devices), None, policy)
    pool.run.remote()
    return pool


def kill_pool(sweep_id: str) -> bool:
    """Kill the sweep's executor (and so its shard workers); False if there was none."""
    return _kill_named(lambda: find_pool(sweep_id))


def _head_node_id() -> str:
    """The head node's id (Ray marks it with the ``node:__internal_head__`` resource); this
    process's node if none is marked."""
    for node in ray.nodes():  # type: ignore[no-untyped-call]
        if node.get("Alive") and HEAD_RESOURCE in (node.get("Resources") or {}):
            return str(node["NodeID"])
    return str(ray.get_runtime_context().get_node_id())


def node_alive(node_id: str) -> bool:
    """Whether Ray's cluster table has node ``node_id`` alive."""
    nodes = ray.nodes()  # type: ignore[no-untyped-call]
    return any(n.get("Alive") and n["NodeID"] == node_id for n in nodes)


HEAD_RESOURCE = "node:__internal_head__"
"""The resource Ray gives only the head node."""


def kill_runner(job_id: JobId) -> bool:
    """Kill the job's runner (and so its stage workers); False if there was none."""
    return _kill_named(lambda: find_runner(job_id))


def _kill_named(find: Callable[[], ActorHandle[Any] | None], wait_s: float = 30.0) -> bool:
    """Kill the named actor ``find`` returns; False if there is none.

    ``ray.kill`` is asynchronous: this waits (up to ``wait_s``) until the name is free, so
    an actor started under it next (a job's next attempt, a sweep's executor on new
    devices) is a new actor, not the dying one.
    """
    actor = find()
    if actor is None:
        return False
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + wait_s
    while find() is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    return True


def start_stage_worker(plan: StagePlan, setup: StageSetup) -> ActorHandle[Any]:
    """A StageWorker actor holding ``plan``'s blocks, pinned to its device's node.

    A GPU device takes one ``GPU`` (Ray sets CUDA_VISIBLE_DEVICES for it); a virtual device
    takes one ``shoal_device``. One thread for its training calls, never restarted and
    never retried, so Ray runs those calls from the runner in submission order (see
    ``workers.group``) and a lost worker is reported, not silently replaced without its
    state; a second thread runs the in-memory copies' calls beside them (``COPIES_GROUP``).
    """
    worker: ActorHandle[Any] = _StageWorkerActor.options(**_on_device(plan.device)).remote(
        plan, setup
    )
    return worker


def _on_device(device: Device) -> dict[str, Any]:
    """Actor options that take ``device``: one ``GPU`` (Ray sets CUDA_VISIBLE_DEVICES) or
    one ``shoal_device``, on its node; single-threaded, never restarted or retried."""
    accelerator: dict[str, Any] = (
        {"num_gpus": 1} if device.gpu else {"resources": {DEVICE_RESOURCE: 1}}
    )
    return {
        "num_cpus": 0,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(device.node_id, soft=False),
        "max_restarts": 0,
        "max_task_retries": 0,
        "max_concurrency": 1,
        **accelerator,
    }


def start_shard_worker(device: Device, budget_bytes: int) -> ActorHandle[Any]:
    """A ShardWorker actor on ``device``, holding up to ``budget_bytes`` of shards there."""
    worker: ActorHandle[Any] = _ShardWorkerActor.options(**_on_device(device)).remote(
        device, budget_bytes
    )
    return worker


def kill_worker(worker: ActorHandle[Any]) -> None:
    ray.kill(worker, no_restart=True)
