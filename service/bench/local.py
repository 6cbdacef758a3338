"""The benches that run on a local multi-node Ray cluster of their own (``elastic`` and
``sharp``): start it on free ports, run the bench against it, stop it.

Nothing here imports Ray: Ray reads the cluster's token when it is first imported, so each
bench's Ray-using module is imported only once the token is in this process's environment.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from shoal.service.bench.report import (
    ELASTIC_PHASES,
    SHARP_PHASES,
    BenchError,
    ElasticSettings,
    Progress,
    SharpSettings,
)
from shoal.service.bench.simulation import run_simulated
from shoal.service.devicespec import VirtualNode, parse_devices
from shoal.service.localray import LocalRay, LocalRayError


@contextmanager
def local_ray(nodes: Sequence[VirtualNode], prefix: str) -> Iterator[tuple[LocalRay, Path]]:
    """A local Ray cluster of ``nodes`` and a temporary directory for its logs and the
    bench's files (``prefix`` names it); the cluster's token in this process's environment;
    stopped (and the directory removed) after."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        cluster = LocalRay(nodes, Path(tmp) / "logs")
        try:
            cluster.start()
        except LocalRayError as exc:
            raise BenchError(str(exc)) from None
        try:
            os.environ.update(cluster.client_env)
            yield cluster, Path(tmp)
        finally:
            cluster.stop()


def bench_elastic(settings: ElasticSettings, progress: Progress) -> dict[str, Any]:
    """``shoal bench elastic`` on a local cluster of ``settings.devices``."""
    progress(ELASTIC_PHASES[0])
    with local_ray(parse_devices(settings.devices), "shoal-bench-elastic-") as (cluster, root):
        from shoal.service.bench.elastic import run_elastic

        return run_elastic(settings, cluster, root, progress)


def bench_sharp(settings: SharpSettings, progress: Progress) -> dict[str, Any]:
    """``shoal bench sharp``: the simulated half first (no Ray processes beside it to slow
    the timed simulation), then the real half on a local cluster of two nodes. On ``cpu``
    the nodes offer no GPU, so their devices are virtual CPU ones on any machine."""
    started = time.perf_counter()
    simulated = run_simulated(settings, progress)
    progress(SHARP_PHASES[3])
    gpus = None if settings.device == "cuda" else 0
    nodes = [replace(node, gpus=gpus) for node in parse_devices(settings.devices)]
    with local_ray(nodes, "shoal-bench-sharp-") as (cluster, root):
        from shoal.service.bench.sharp import run_sharp

        return run_sharp(settings, simulated, cluster, root, progress, started)
