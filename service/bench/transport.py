"""``shoal bench transport``: how activations could move between stages, measured here.

Three questions, the first two for issue 3's "Transport" choice, each on a 2-actor chain
like two stages:

1. Ray object refs (what ``workers.pipeline.group`` does where it relays: the driver passes
   stage 0's result ref to stage 1) against a Ray Compiled Graph of the same chain (``InputNode`` ->
   ``a.relay.bind`` -> ``b.relay.bind``, ``experimental_compile``), one call at a time and
   with several in flight, for a small and an activation-sized tensor.
2. A torch tensor against the same data as a numpy array through one actor call (Ray
   stores numpy arrays zero-copy; torch tensors are pickled).
3. A pipeline link's round trip between two processes, on the socket CPU links use against
   a gloo pair (``service.bench.links``).

Compiled Graphs hang on teardown after a value larger than their channel buffer passed
(DESIGN, "Performance model"); measured here, it still hangs with a 4 MB tensor and the
buffer sized well above it. So the buffer is sized above the value, the teardown runs under
a deadline, and each graph gets fresh actors that are killed after it.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import ray
import torch
from ray.dag import InputNode

from shoal.service.bench.links import LINK_WIRES, round_trip_ms
from shoal.service.bench.pipeline import ray_session
from shoal.service.bench.report import BenchError, Progress, machine

TRANSPORT_KEYS = (
    "object_ref_chain_ms",
    "compiled_graph_chain_ms",
    "object_ref_chain_inflight_ms",
    "compiled_graph_chain_inflight_ms",
    "compiled_graph_speedup",
    "torch_tensor_call_ms",
    "numpy_array_call_ms",
    "numpy_speedup",
    "link_round_trip_ms",
    "socket_link_speedup",
    "faster_chain",
)

_TEARDOWN_S = 15.0
_CALL_S = 60.0
"""The longest a relay's answer is waited for (a stuck actor fails the bench, not hangs it)."""


@dataclass(frozen=True)
class TransportSettings:
    """Floats per value: a small one (latency) and an activation-sized one (bandwidth)."""

    sizes: tuple[int, ...] = (1_024, 1_048_576)
    calls: int = 40
    """Timed calls per repeat (fewer for the large value: see ``_calls``)."""
    inflight: int = 8
    repeats: int = 3
    warmup: int = 3


class Relay:
    """A stage stand-in: hands on what it is given (the transport is what is measured)."""

    def relay(self, value: Any) -> Any:
        return value


_RelayActor: Any = ray.remote(Relay)


def _calls(s: TransportSettings, size: int) -> int:
    return max(4, s.calls // 4) if size >= 262_144 else s.calls


def _median_ms(run: Callable[[], None], count: int, s: TransportSettings) -> float:
    """Median over repeats of the milliseconds per call of ``count`` calls of ``run``."""
    for _ in range(s.warmup):
        run()
    per_call = []
    for _ in range(s.repeats):
        started = time.perf_counter()
        for _ in range(count):
            run()
        per_call.append(1000 * (time.perf_counter() - started) / count)
    return statistics.median(per_call)


def _ref_chain(a: Any, b: Any, value: Any, inflight: int) -> Callable[[], None]:
    def run() -> None:
        ray.get([b.relay.remote(a.relay.remote(value)) for _ in range(inflight)], timeout=_CALL_S)

    return run


def _teardown(dag: Any) -> bool:
    """Tear ``dag`` down; False if that did not finish within the deadline (left behind)."""
    worker = threading.Thread(target=dag.teardown, daemon=True)
    worker.start()
    worker.join(_TEARDOWN_S)
    return not worker.is_alive()


def _graph_chain_ms(
    value: Any, inflight: int, s: TransportSettings, count: int
) -> tuple[float, bool]:
    """ms per value through a compiled 2-actor chain, and whether its teardown finished.

    Fresh actors each time, killed after: an actor whose compiled loop did not stop on
    teardown would block every later call on it.
    """
    a, b = _relays()
    with InputNode() as inp:
        chain = b.relay.bind(a.relay.bind(inp))
    nbytes = value.numel() * value.element_size()
    dag = chain.experimental_compile(
        _buffer_size_bytes=2 * nbytes + (1 << 20), _max_inflight_executions=inflight
    )

    def run() -> None:
        for ref in [dag.execute(value) for _ in range(inflight)]:
            ray.get(ref, timeout=_CALL_S)

    try:
        ms = _median_ms(run, count, s) / inflight
    finally:
        clean = _teardown(dag)
        for actor in (a, b):
            ray.kill(actor)
    return ms, clean


def _relays() -> tuple[Any, Any]:
    a, b = (_RelayActor.options(num_cpus=0).remote() for _ in range(2))
    ray.get([a.relay.remote(None), b.relay.remote(None)], timeout=_CALL_S)
    return a, b


def _echo_ms(actor: Any, value: Any, s: TransportSettings, count: int) -> float:
    return _median_ms(lambda: ray.get(actor.relay.remote(value), timeout=_CALL_S), count, s)


def run_transport(s: TransportSettings, progress: Progress = lambda _: None) -> dict[str, Any]:
    """Measure both questions; milliseconds per value, keyed by floats per value."""
    started = time.perf_counter()
    result: dict[str, Any] = {k: {} for k in TRANSPORT_KEYS[:4]}
    clean = True
    with ray_session(0):
        a, b = _relays()
        for size in s.sizes:
            value = torch.randn(size)
            count = _calls(s, size)
            progress(f"object refs, {size} floats")
            result["object_ref_chain_ms"][size] = _median_ms(_ref_chain(a, b, value, 1), count, s)
            result["object_ref_chain_inflight_ms"][size] = (
                _median_ms(_ref_chain(a, b, value, s.inflight), count, s) / s.inflight
            )
            progress(f"compiled graph, {size} floats")
            for key, inflight in (
                ("compiled_graph_chain_ms", 1),
                ("compiled_graph_chain_inflight_ms", s.inflight),
            ):
                ms, ok = _graph_chain_ms(value, inflight, s, count)
                result[key][size] = ms
                clean = clean and ok
        progress("torch tensor vs numpy array")
        big = max(s.sizes)
        tensor = torch.randn(big)
        count = _calls(s, big)
        result["torch_tensor_call_ms"] = _echo_ms(a, tensor, s, count)
        result["numpy_array_call_ms"] = _echo_ms(a, tensor.numpy(), s, count)
        for actor in (a, b):
            ray.kill(actor)
    progress("pipeline links: socket vs gloo")
    result["link_round_trip_ms"] = {
        kind: {
            size: round_trip_ms(kind, size, _calls(s, size), s.repeats, s.warmup)
            for size in s.sizes
        }
        for kind in LINK_WIRES
    }
    return transport_result(result, s, clean=clean, started=started)


def transport_result(
    measured: dict[str, Any], s: TransportSettings, *, clean: bool, started: float
) -> dict[str, Any]:
    """Add the comparisons: speedups (> 1: the second option is faster) and the winner."""
    big = max(s.sizes)
    refs_ms = measured["object_ref_chain_ms"][big]
    graph_ms = measured["compiled_graph_chain_ms"][big]
    links = measured["link_round_trip_ms"]
    if min(refs_ms, graph_ms, measured["numpy_array_call_ms"], *links["socket"].values()) <= 0:
        raise BenchError("a transport measurement came out as zero; raise --calls")
    return {
        **measured,
        "compiled_graph_speedup": {
            size: measured["object_ref_chain_ms"][size] / measured["compiled_graph_chain_ms"][size]
            for size in s.sizes
        },
        "numpy_speedup": measured["torch_tensor_call_ms"] / measured["numpy_array_call_ms"],
        "socket_link_speedup": {
            size: links["gloo"][size] / links["socket"][size] for size in s.sizes
        },
        "faster_chain": "compiled_graph" if graph_ms < refs_ms else "object_refs",
        "compiled_graph_teardown_clean": clean,
        "settings": asdict(s),
        "machine": machine(),
        "wall_s": round(time.perf_counter() - started, 1),
    }
