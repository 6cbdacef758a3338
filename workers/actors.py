"""The detached, named actors the control plane starts: a job's runner and a sweep's
SHARP executor.

A **JobRunner** per job is detached and named ``shoal-job-<id>`` in the ``shoal`` namespace,
so it outlives the control plane that started it and is found again by name after a
restart; a sweep's **SweepExecutor** likewise as ``shoal-sweep-<id>``. Both run on the
head node. Nothing inside ``workers/`` imports this module: it sits above the engines it
starts (their own workers are started by ``workers.launch``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from shoal.scheduler.devices import Device
from shoal.scheduler.types import JobId
from shoal.workers.pipeline.job_runner import JobRunner
from shoal.workers.sharp.sweep_executor import SweepExecutor
from shoal.workers.snapshot import JobSnapshot
from shoal.workers.uploaded_code import JobCode, code_options

RUNNER_NAMESPACE = "shoal"
RUNNER_CONCURRENCY = 3
"""Threads of a runner actor for ``poll``, ``cancel`` and the like (it trains on a thread of
its own): they answer while it trains."""


def runner_name(job_id: JobId) -> str:
    return f"shoal-job-{job_id}"


def find_runner(job_id: JobId) -> ActorHandle[Any] | None:
    """The job's live runner actor, or None if there is none (never started, or dead)."""
    try:
        return ray.get_actor(runner_name(job_id), namespace=RUNNER_NAMESPACE)
    except ValueError:  # Ray's answer for "no live actor of that name"
        return None


def start_runner(snapshot: JobSnapshot) -> ActorHandle[Any]:
    """The job's runner, started (it trains from its creation) unless it already exists:
    ``get_if_exists`` makes two racing starts share one actor."""
    existing = find_runner(snapshot.job_id)
    if existing is not None:
        return existing
    runner_actor: Any = ray.remote(JobRunner)
    runner: ActorHandle[Any] = runner_actor.options(
        **_detached_on_head(runner_name(snapshot.job_id)), **code_options(snapshot.code)
    ).remote(snapshot)
    return runner


def _detached_on_head(name: str) -> dict[str, Any]:
    """Actor options of a runner or sweep executor: detached and named (found again by a
    restarted control plane; two racing starts share one actor), threaded, never restarted,
    on the head node (on-demand, beside the control plane, in a cluster of spot workers:
    losing a stage's node must not take the runner that recovers it along). Hard: with
    soft=True, Ray 2.60 placed it on another node of a 2-node local cluster (measured)."""
    return {
        "name": name,
        "namespace": RUNNER_NAMESPACE,
        "lifetime": "detached",
        "get_if_exists": True,
        "num_cpus": 0,
        "max_concurrency": RUNNER_CONCURRENCY,
        "max_restarts": 0,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(_head_node_id(), soft=False),
    }


def pool_name(sweep_id: str) -> str:
    return f"shoal-sweep-{sweep_id}"


def find_pool(sweep_id: str) -> ActorHandle[Any] | None:
    """The sweep's live SHARP executor actor, or None."""
    try:
        return ray.get_actor(pool_name(sweep_id), namespace=RUNNER_NAMESPACE)
    except ValueError:
        return None


def start_pool(
    sweep_id: str, devices: Sequence[Device], policy: str, code: JobCode | None = None
) -> ActorHandle[Any]:
    """The sweep's SHARP executor (``workers.sharp.sweep_executor.SweepExecutor``) on ``devices``,
    started and running unless it exists: detached and named, on the head node, like a
    job's runner, so it outlives the control plane and is found again. With the sweep's
    uploaded ``code``, which its trials' factories name."""
    existing = find_pool(sweep_id)
    if existing is not None:
        return existing
    pool_actor: Any = ray.remote(SweepExecutor)
    pool: ActorHandle[Any] = pool_actor.options(
        **_detached_on_head(pool_name(sweep_id)), **code_options(code)
    ).remote(list(devices), None, policy)
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
