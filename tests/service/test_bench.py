"""The benchmarks: their arithmetic and JSON shape, and one tiny run of each (not timed)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from shoal.service.bench.report import (
    PIPELINE_KEYS,
    BenchError,
    PipelineRound,
    PipelineSettings,
    efficiency,
    ideal_samples_per_s,
    machine,
    median_throughput,
    pipeline_result,
    round_samples_per_s,
    stage_bounds,
    windows,
)
from shoal.service.bench.transport import TRANSPORT_KEYS, TransportSettings, transport_result
from shoal.service.cli import cli


@pytest.mark.unit
def test_ideal_is_one_device_times_devices_less_the_bubble() -> None:
    # 2 stages, 8 micro-batches: bubble 1/9, so 2 devices give 16/9 of one.
    assert ideal_samples_per_s(90.0, 2, 8, 2) == pytest.approx(160.0)
    assert ideal_samples_per_s(50.0, 1, 4, 1) == 50.0
    assert ideal_samples_per_s(10.0, 4, 1, 4) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="must be >= 1"):
        ideal_samples_per_s(10.0, 0, 1, 1)


@pytest.mark.unit
def test_efficiency_is_measured_over_ideal() -> None:
    assert efficiency(136.0, 160.0) == pytest.approx(0.85)
    assert efficiency(5.0, 0.0) == 0.0


@pytest.mark.unit
def test_repeats_are_windows_after_the_warmup_and_the_median_is_taken() -> None:
    times = [9.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert windows(times, warmup=1, repeats=3) == [2.0, 4.0, 8.0]
    # 10 samples a step, 2 steps a window: 20/2, 20/4, 20/8 -> median 5.
    assert median_throughput(times, 10, warmup=1, repeats=3) == pytest.approx(5.0)
    with pytest.raises(BenchError, match="cannot make 3 repeats"):
        windows([1.0, 1.0], warmup=1, repeats=3)


@pytest.mark.unit
def test_stage_bounds_cover_the_blocks_evenly() -> None:
    assert stage_bounds(8, 2) == [(0, 4), (4, 8)]
    assert stage_bounds(5, 2) == [(0, 3), (3, 5)]
    assert stage_bounds(3, 3) == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.unit
def test_settings_count_parameters_and_refuse_bad_shapes() -> None:
    s = PipelineSettings()
    assert 20e6 <= s.parameters <= 50e6  # the issue's "compute dominates" size
    assert s.timed_steps == s.warmup + s.steps  # per contender and round
    with pytest.raises(ValueError, match="multiple of micro_batches"):
        PipelineSettings(batch_size=10, micro_batches=4)
    with pytest.raises(ValueError, match="stages"):
        PipelineSettings(layers=1, stages=3)


def _round(single_thread: float, shoal: float, torch_pipelining: float = 120.0) -> PipelineRound:
    return PipelineRound(
        single_process=150.0,
        single_thread=single_thread,
        side_by_side_thread=0.8 * single_thread,
        shoal=shoal,
        torch_pipelining=torch_pipelining,
        overhead_ms=1.5,
    )


@pytest.mark.unit
def test_pipeline_result_has_the_issue_keys_and_is_json() -> None:
    s = PipelineSettings(micro_batches=8, stages=2)
    result = pipeline_result(s, [_round(90.0, 144.0)], started=0.0)
    assert list(result)[: len(PIPELINE_KEYS)] == list(PIPELINE_KEYS)
    assert result["ideal_samples_per_s"] == pytest.approx(160.0)
    assert result["efficiency"] == pytest.approx(0.9)
    assert result["shoal_vs_torch_pipelining"] == pytest.approx(1.2)
    # One thread beside the other: 72/s, so the reachable ideal is 128/s, Shoal 144/128.
    assert result["side_by_side_ideal_samples_per_s"] == pytest.approx(128.0)
    assert result["side_by_side_efficiency"] == pytest.approx(1.125)
    assert {"cpus", "torch", "ray", "date", "load_average_1m"} <= set(result["machine"])
    assert json.loads(json.dumps(result))["settings"]["micro_batches"] == 8
    with pytest.raises(BenchError, match="at least one round"):
        pipeline_result(s, [], started=0.0)


@pytest.mark.unit
def test_pipeline_ratios_are_taken_within_each_round_then_the_median() -> None:
    # The machine drifts: round 2 is slow for everyone, round 3 between. Within each round
    # Shoal is 0.9 of the ideal and 1.2x the peer.
    s = PipelineSettings(micro_batches=8, stages=2)
    rounds = [_round(90.0, 144.0), _round(60.0, 96.0, 80.0), _round(75.0, 150.0 * 0.8, 100.0)]
    result = pipeline_result(s, rounds, started=0.0)
    assert result["efficiency"] == pytest.approx(0.9)
    assert result["shoal_vs_torch_pipelining"] == pytest.approx(1.2)
    assert result["shoal_samples_per_s"] == pytest.approx(120.0)  # each column's median
    assert result["single_thread_samples_per_s"] == pytest.approx(75.0)
    assert [r["efficiency"] for r in result["rounds"]] == pytest.approx([0.9, 0.9, 0.9])
    # One round in which Shoal alone was slow: the median ratio is still 0.9, where the
    # columns' medians (Shoal 96, one thread 75) would pair two rounds and say 0.72.
    worse = pipeline_result(s, [*rounds[:2], _round(75.0, 60.0, 100.0)], started=0.0)
    assert worse["efficiency"] == pytest.approx(0.9)
    assert sorted(r["efficiency"] for r in worse["rounds"])[0] == pytest.approx(0.45)
    two_worse = pipeline_result(s, [rounds[0], *[_round(75.0, 60.0, 100.0)] * 2], started=0.0)
    assert two_worse["efficiency"] == pytest.approx(0.45)


@pytest.mark.unit
def test_a_round_rate_is_its_timed_steps_samples_over_their_time() -> None:
    assert round_samples_per_s([9.0, 1.0, 1.0, 2.0], 10, warmup=1) == pytest.approx(7.5)
    with pytest.raises(BenchError, match="none to time"):
        round_samples_per_s([1.0, 1.0], 10, warmup=2)


@pytest.mark.unit
def test_transport_result_names_the_faster_option() -> None:
    s = TransportSettings(sizes=(16, 1024))
    measured = {
        "object_ref_chain_ms": {16: 2.0, 1024: 6.0},
        "compiled_graph_chain_ms": {16: 0.5, 1024: 2.0},
        "object_ref_chain_inflight_ms": {16: 1.0, 1024: 3.0},
        "compiled_graph_chain_inflight_ms": {16: 0.3, 1024: 1.0},
        "torch_tensor_call_ms": 20.0,
        "numpy_array_call_ms": 5.0,
        "link_round_trip_ms": {"socket": {16: 0.25, 1024: 0.5}, "gloo": {16: 2.0, 1024: 2.0}},
    }
    result = transport_result(measured, s, clean=True, started=0.0)
    assert result["faster_chain"] == "compiled_graph"
    assert result["compiled_graph_speedup"] == {16: 4.0, 1024: 3.0}
    assert result["numpy_speedup"] == 4.0
    assert result["socket_link_speedup"] == {16: 8.0, 1024: 4.0}
    assert set(TRANSPORT_KEYS) <= set(result)


def _last_json(output: str) -> dict[str, object]:
    last = output.strip().splitlines()[-1]
    value: dict[str, object] = json.loads(last)
    return value


def _positive(value: object) -> bool:
    if isinstance(value, dict):
        return all(_positive(v) for v in value.values())
    return isinstance(value, float | int) and math.isfinite(value) and value > 0


@pytest.mark.integration
@pytest.mark.slow
def test_bench_pipeline_tiny_run_prints_positive_numbers() -> None:
    args = ["bench", "pipeline", "--json", "--repeats", "1", "--steps", "1"]
    args += ["--hidden", "16", "--layers", "2", "--batch-size", "8", "--micro-batches", "4"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    answer = _last_json(result.output)
    for key in (*PIPELINE_KEYS, "side_by_side_thread_samples_per_s"):
        # The overhead is a difference of two timings: positive, though not by construction.
        if key != "overhead_ms_per_microbatch":
            assert _positive(answer[key]), (key, answer[key])
    assert isinstance(answer["overhead_ms_per_microbatch"], float)


@pytest.mark.integration
@pytest.mark.slow
def test_bench_transport_tiny_run_prints_positive_numbers() -> None:
    args = ["bench", "transport", "--json", "--repeats", "1", "--calls", "4", "--size", "64"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    answer = _last_json(result.output)
    for key in TRANSPORT_KEYS[:-1]:
        assert _positive(answer[key]), (key, answer[key])
    assert answer["faster_chain"] in {"compiled_graph", "object_refs"}


@pytest.mark.unit
def test_bench_pipeline_refuses_a_bad_shape_with_exit_code_2() -> None:
    args = ["bench", "pipeline", "--batch-size", "10", "--micro-batches", "4"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2
    assert "multiple of micro_batches" in result.output


@pytest.mark.unit
def test_bench_tables_render_without_json(monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal.service.bench import pipeline as pipeline_bench
    from shoal.service.bench import transport as transport_bench

    s = PipelineSettings()
    canned = pipeline_result(
        s, [_round(90.0, 144.0)], started=0.0, extra={"single_process_threads": 2}
    )
    monkeypatch.setattr(pipeline_bench, "run_pipeline", lambda settings, progress: canned)
    result = CliRunner().invoke(cli, ["bench", "pipeline"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "Shoal, 2 stages on 2 devices" in result.output
    assert "efficiency 0.90 of ideal" in result.output
    assert "1.12 of the side-by-side ideal" in result.output

    t = TransportSettings(sizes=(16,))
    measured = {
        "object_ref_chain_ms": {16: 2.0},
        "compiled_graph_chain_ms": {16: 0.5},
        "object_ref_chain_inflight_ms": {16: 1.0},
        "compiled_graph_chain_inflight_ms": {16: 0.3},
        "torch_tensor_call_ms": 20.0,
        "numpy_array_call_ms": 5.0,
        "link_round_trip_ms": {"socket": {16: 0.025}, "gloo": {16: 0.15}},
    }
    answer = transport_result(measured, t, clean=True, started=0.0)
    monkeypatch.setattr(transport_bench, "run_transport", lambda settings, progress: answer)
    result = CliRunner().invoke(cli, ["bench", "transport", "--size", "16"])
    assert result.exit_code == 0, result.output
    assert "4.00x" in result.output
    assert "faster chain: compiled_graph" in result.output
    assert "socket 0.025 ms, gloo 0.150 ms (6.00x)" in result.output


@pytest.mark.unit
def test_busy_fractions_are_median_compute_shares_per_stage() -> None:
    from shoal.service.bench.pipeline import busy_fractions
    from shoal.workers.snapshot import StageTiming, StepMetrics

    def step(total: float, a: float, b: float) -> StepMetrics:
        timings = (StageTiming(0, "d0", a, total - a), StageTiming(1, "d1", b, total - b))
        return StepMetrics(1, 0.0, 1.0, total, timings)

    metrics = [step(9.0, 9.0, 9.0), step(1.0, 0.5, 0.25), step(2.0, 1.0, 0.5), step(4.0, 2.0, 1.0)]
    assert busy_fractions(metrics, warmup=1) == [0.5, 0.25]


@pytest.mark.unit
def test_elastic_best_cut_is_the_exhaustive_optimum() -> None:
    from shoal.scheduler.profile import uniform_costs
    from shoal.service.bench.elastic import best_cut

    # 6 equal blocks; "slow" runs at a third of the speed: it gets 1 block, the others
    # 2.5 on average: a 3-2-1 or 2-3-1 cut, (8 + 2) x 3 block-times per step.
    order, bounds, step = best_cut(uniform_costs(6), {"a": 1.0, "b": 1.0, "slow": 1 / 3}, 8)
    sizes = {d: b[1] - b[0] for d, b in zip(order, bounds, strict=True)}
    assert sizes["slow"] == 1 and sorted(sizes.values()) == [1, 2, 3]
    assert step == pytest.approx(10 * 3.0)


@pytest.mark.unit
def test_elastic_settings_refuse_what_cannot_run() -> None:
    from shoal.service.bench.report import ElasticSettings

    assert ElasticSettings().devices.endswith("slowdown=3")
    with pytest.raises(ValueError, match="at least 3 blocks"):
        ElasticSettings(layers=1)
    with pytest.raises(ValueError, match="3 x window"):
        ElasticSettings(steps=5, window=3)


def _sharp_canned() -> tuple[dict[str, Any], dict[str, Any]]:
    """A real half and a simulated half of ``shoal bench sharp``, as the bench makes them."""
    real = {
        "sharp_seconds": 20.0,
        "sequential_seconds": 38.0,
        "no_prefetch_seconds": 21.0,
        "sharp_train_seconds": 10.0,
        "sequential_train_seconds": 15.0,
        "no_prefetch_train_seconds": 12.0,
        "sharp_device_busy": [0.5, 0.25],
        "sharp_worker_busy": [0.75, 0.5],
        "sim_two_devices": {
            "lrtf_mean_utilization": 0.99,
            "speedup_vs_model_parallel": 2.0,
            "latency_s": 0.001,
        },
        "model": "4 x mlp",
        "shards_per_model": [4, 4, 4, 4],
        "device": "cpu",
        "machine": {**machine(), "memory_gib": 24.0},
    }
    row = {"ratio": 1.0, "makespan_s": 1.0, "lower_bound_s": 1.0, "mean_utilization": 1.0}
    settings = [
        {"name": "a", "devices": 8, "models": 12, "results": {"sharp-lrtf": row}},
        {"name": "b", "devices": 512, "models": 300, "results": {"sharp-lrtf": row}},
    ]
    sim = {
        "sim_lrtf_over_lower_bound": 1.05,
        "sim_fifo_over_lower_bound": 1.4,
        "sim_1024_devices_seconds": 7.5,
        "sim_settings": settings,
        "sim_scale": {"name": "c", "devices": 1024, "models": 1000, "lrtf_ratio": 1.2},
    }
    return real, sim


@pytest.mark.unit
def test_sharp_result_has_the_issue_keys_first_and_is_json() -> None:
    from shoal.service.bench.report import SHARP_KEYS, SharpSettings, sharp_result

    real, sim = _sharp_canned()
    result = sharp_result(SharpSettings(), real, sim, started=0.0)
    assert list(result)[: len(SHARP_KEYS)] == list(SHARP_KEYS)
    assert result["speedup_vs_sequential"] == pytest.approx(1.9)
    assert result["shards_per_model"] == [4, 4, 4, 4]
    assert result["sim_settings"][1]["devices"] == 512
    answer = json.loads(json.dumps(result))
    assert answer["settings"]["models"] == 4 and "cpus" in answer["machine"]


@pytest.mark.unit
def test_sharp_settings_refuse_a_budget_that_fits_a_model_or_not_half() -> None:
    from shoal.service.bench.report import SharpSettings

    assert SharpSettings().devices.count("1xcpu-") == 2
    assert SharpSettings(device="cuda").devices.count("1xgpu-") == 2
    with pytest.raises(ValueError, match="device 'tpu' is none of cpu, cuda"):
        SharpSettings(device="tpu")
    with pytest.raises(ValueError, match="a whole model would fit one device"):
        SharpSettings(budget_fraction=1.0)
    with pytest.raises(ValueError, match="must fit"):
        SharpSettings(budget_fraction=0.5)
    with pytest.raises(ValueError, match=">= 1"):
        SharpSettings(steps=0)


@pytest.mark.unit
def test_same_losses_names_the_first_model_and_step_that_differ() -> None:
    from shoal.service.bench.report import same_losses

    same_losses({"a": [[1.0, 0.5], [2.0]], "b": [[1.0, 0.5], [2.0]]})
    with pytest.raises(BenchError, match="model 1: b differs from a at step 2"):
        same_losses({"a": [[1.0], [2.0, 1.0]], "b": [[1.0], [2.0, 1.5]]})
    with pytest.raises(BenchError, match=r"at step 2 \(no such step"):
        same_losses({"a": [[1.0, 0.5]], "b": [[1.0]]})
    with pytest.raises(BenchError, match="trained 1 models"):
        same_losses({"a": [[1.0], [1.0]], "b": [[1.0]]})


@pytest.mark.unit
def test_simulated_half_runs_every_strategy_and_takes_the_worst_setting() -> None:
    from shoal.scheduler.simulate import Strategy
    from shoal.service.bench.report import SHARP_PHASES, SharpSettings
    from shoal.service.bench.simulation import AT_STEPS, NO_PREFETCH, run_simulated

    s = SharpSettings(spot_devices=8, spot_models=3, scale_devices=8, scale_models=3)
    phases: list[str] = []
    result = run_simulated(s, phases.append)
    assert phases == list(SHARP_PHASES[:3])
    hydra, spot = result["sim_settings"]
    assert (hydra["devices"], hydra["models"]) == (8, 12)
    assert (spot["devices"], spot["models"]) == (8, 3)
    engines = {NO_PREFETCH, AT_STEPS}
    assert set(hydra["results"]) == {*(x.value for x in Strategy), *engines}
    for row in (hydra, spot):
        for strategy in row["results"].values():
            assert strategy["ratio"] >= 1.0 - 1e-9  # no schedule beats the lower bound
    lrtf = [row["results"]["sharp-lrtf"]["ratio"] for row in (hydra, spot)]
    assert result["sim_lrtf_over_lower_bound"] == max(lrtf)
    worst = max(row["results"][AT_STEPS]["ratio"] for row in (hydra, spot))
    assert result["sim_at_steps_over_lower_bound"] == worst
    # Shoal's executor on Hydra's setting: each model's shards on one device, models
    # trading places before a task, its copies beside the compute (measured 1.010); moving
    # at step boundaries where that ends two devices' work sooner instead, 1.041.
    assert hydra["results"]["sharp-lrtf"]["ratio"] <= 1.02
    assert hydra["results"][AT_STEPS]["ratio"] <= 1.06
    assert result["sim_1024_devices_seconds"] > 0 and result["sim_scale"]["models"] == 3


@pytest.mark.unit
def test_sharp_bench_in_process_trains_every_variant_to_the_same_losses(tmp_path: Path) -> None:
    from shoal.scheduler.devices import Device
    from shoal.service.bench.report import SharpSettings
    from shoal.service.bench.sharp import measure
    from shoal.workers.pipeline.local_group import LocalGroup
    from shoal.workers.sharp.shard_pool import LocalPool

    # In-process the threads take turns: the plumbing and the exactness check, not timing.
    s = SharpSettings(models=2, hidden=16, layers=6, features=8, outputs=2, batch_size=8, steps=3)
    devices = [Device(f"n0000000a-cpu-{i}", "n0000000a", i, "cpu", 2048, False) for i in range(2)]
    result = measure(s, devices, tmp_path, LocalPool, LocalGroup)
    assert result["model_bytes"] > result["budget_bytes"]  # no model fits one device
    assert len(result["shards_per_model"]) == 2 and min(result["shards_per_model"]) >= 2
    intervals = result["sharp_copy_intervals"]  # the trials keep copies, as a sweep's do
    assert len(intervals) == 2 and min(intervals) >= 1
    for key in ("sharp_seconds", "sequential_seconds", "no_prefetch_seconds"):
        assert result[key] > 0
    assert result["promoted_bytes"] > 0 and len(result["final_losses"]) == 2
    # The simulator runs the two models at their measured task times and half the measured
    # round trip as the latency (sub-millisecond tasks here: the speedup is the machine's
    # load's, 1.92-1.94 on a quiet one, 1.50 under a test run's load).
    local = result["sim_two_devices"]
    assert local["latency_s"] == pytest.approx(result["sharp_round_trip_seconds"] / 2)
    assert local["speedup_vs_model_parallel"] > 0 and local["lrtf_ratio"] >= 1.0 - 1e-9
    assert set(result["sharp_task_seconds"]) == {
        f"{op} {i}"
        for op in ("forward", "backward")
        for i in range(min(result["shards_per_model"]))
    }
    assert result["sharp_round_trip_seconds"] > 0
    # Each task's wall time in its worker holds its compute; a worker busy with tasks at
    # least as long as its device computed, never longer than training took.
    hosted = result["sharp_task_host_seconds"]
    assert set(hosted) == set(result["sharp_task_seconds"])
    for key, seconds in result["sharp_task_seconds"].items():
        assert hosted[key] >= seconds > 0, (key, hosted[key], seconds)
    busy = list(zip(result["sharp_worker_busy"], result["sharp_device_busy"], strict=True))
    assert len(busy) == 2 and all(device <= worker <= 1.0 for worker, device in busy), busy
    assert result["sharp_task_idle_seconds"] >= 0
    assert result["device"] == "cpu" and result["host_to_device_gbps"] is None
    assert result["machine"]["memory_gib"] > 0
    with pytest.raises(BenchError, match="needs 2 devices"):
        measure(s, devices[:1], tmp_path, LocalPool, LocalGroup)
    # Asked for cuda, given CPU devices: refused before anything trains.
    with pytest.raises(BenchError, match=r"runs on cuda devices, the cluster shows .*\(cpu\)"):
        measure(replace(s, device="cuda"), devices, tmp_path, LocalPool, LocalGroup)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sharp_bench_on_the_gpu_trains_every_variant_to_the_same_losses(tmp_path: Path) -> None:
    """``shoal bench sharp --device cuda``'s real half in-process: two devices on the GPU,
    each under one model, so every shard comes in from pinned host memory."""
    from shoal.scheduler.devices import Device
    from shoal.service.bench.report import SharpSettings
    from shoal.service.bench.sharp import measure
    from shoal.workers.pipeline.local_group import LocalGroup
    from shoal.workers.sharp.shard_pool import LocalPool

    s = SharpSettings(
        device="cuda",
        models=2,
        hidden=256,
        layers=6,
        features=64,
        outputs=4,
        batch_size=512,
        steps=3,
    )
    devices = [Device(f"n0000000a-gpu-{i}", "n0000000a", i, "gpu", 4096, True) for i in range(2)]
    result = measure(s, devices, tmp_path, LocalPool, LocalGroup)
    assert result["device"] == torch.cuda.get_device_name(0)
    assert result["machine"]["gpu"] == result["device"]
    assert result["model_bytes"] > result["budget_bytes"] and result["promoted_bytes"] > 0
    assert result["host_to_device_gbps"] > 1.0  # pinned copies, measured


@pytest.mark.unit
def test_bench_sharp_prints_a_table_or_json(monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal.service.bench import local
    from shoal.service.bench import sharp as sharp_bench
    from shoal.service.bench.report import SharpSettings, sharp_result

    class NoCluster:
        """Stands in for the local Ray cluster the command starts."""

        client_env: dict[str, str] = {}
        nodes: list[Any] = []

        def __init__(self, nodes: list[Any], *args: Any) -> None:
            NoCluster.nodes = nodes

        def start(self) -> None: ...

        def stop(self) -> None: ...

    real, sim = _sharp_canned()
    monkeypatch.setattr(local, "LocalRay", NoCluster)
    monkeypatch.setattr(local, "run_simulated", lambda s, progress: sim)
    monkeypatch.setattr(
        sharp_bench,
        "run_sharp",
        lambda s, simulated, *args: sharp_result(SharpSettings(), real, simulated, 0.0),
    )
    result = CliRunner().invoke(cli, ["bench", "sharp", "--device", "cpu"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    # CPU devices even on a GPU machine: the nodes offer no GPU.
    assert [n.gpus for n in NoCluster.nodes] == [0, 0]
    assert "SHARP, Sharded-LRTF" in result.output and "1.90x" in result.output
    assert "on 2 devices (cpu)" in result.output
    assert "1.50x" in result.output  # training only: 15 s against 10 s
    assert "devices computing 0.50 and 0.25 of the time" in result.output
    assert "their workers in tasks 0.75 and 0.50" in " ".join(result.output.split())
    assert "simulated with Sharded-LRTF in 7.50 s" in result.output
    result = CliRunner().invoke(cli, ["bench", "sharp", "--json"], catch_exceptions=False)
    assert _last_json(result.output)["speedup_vs_sequential"] == pytest.approx(1.9)
    result = CliRunner().invoke(cli, ["bench", "sharp", "--budget-fraction", "1.5"])
    assert result.exit_code == 2 and "budget_fraction" in result.output
    if not torch.cuda.is_available():
        result = CliRunner().invoke(cli, ["bench", "sharp", "--device", "cuda"])
        assert result.exit_code == 2 and "--device cuda: PyTorch sees no CUDA" in result.output


@pytest.mark.unit
def test_sharp_rounds_rotate_the_variants_so_each_runs_in_every_place() -> None:
    from shoal.service.bench.sharp import VARIANTS, round_orders

    assert round_orders(1) == [VARIANTS]
    three = round_orders(3)
    assert [sorted(order) for order in three] == [sorted(VARIANTS)] * 3
    for place in range(3):
        assert sorted(order[place] for order in three) == sorted(VARIANTS)
    assert round_orders(4)[3] == VARIANTS


@pytest.mark.unit
def test_the_sharp_bench_reports_the_round_of_the_median_training_speedup() -> None:
    from shoal.service.bench.sharp import NO_PREFETCH, SEQUENTIAL, SHARP, median_round

    def ran(sequential: float, sharp: float) -> dict[str, dict[str, float]]:
        return {
            SEQUENTIAL: {"train_seconds": sequential},
            SHARP: {"train_seconds": sharp},
            NO_PREFETCH: {"train_seconds": sharp},
        }

    # Speedups 2.0, 1.5, 1.8: the median is the third round's, not the middle one's.
    assert median_round([ran(20, 10), ran(15, 10), ran(18, 10)]) == 2
    assert median_round([ran(20, 10), ran(15, 10)]) == 1  # of two, the lower
    assert median_round([ran(20, 10)]) == 0


@pytest.mark.unit
def test_sharp_bench_rounds_in_process_report_each_round_and_the_median_ones_figures(
    tmp_path: Path,
) -> None:
    from shoal.scheduler.devices import Device
    from shoal.service.bench.report import SharpSettings
    from shoal.service.bench.sharp import measure, round_orders
    from shoal.workers.pipeline.local_group import LocalGroup
    from shoal.workers.sharp.shard_pool import LocalPool

    s = SharpSettings(
        models=2, hidden=16, layers=6, features=8, outputs=2, batch_size=8, steps=2, rounds=3
    )
    devices = [Device(f"n0000000a-cpu-{i}", "n0000000a", i, "cpu", 2048, False) for i in range(2)]
    seen: list[str] = []
    result = measure(s, devices, tmp_path, LocalPool, LocalGroup, seen.append)
    assert [r["order"] for r in result["rounds"]] == [list(o) for o in round_orders(3)]
    assert seen[0] == "round 1/3: one after another, model parallel" and len(seen) == 9
    chosen = result["rounds"][result["median_round"] - 1]
    for key in ("sharp_seconds", "sequential_train_seconds", "no_prefetch_seconds"):
        assert result[key] == chosen[key]
    speedups = sorted(r["train_speedup"] for r in result["rounds"])
    assert chosen["train_speedup"] == speedups[1]
