"""``shoal bench step``: its settings and JSON, the plain loop's exactness, its CLI, and one
tiny real run (not timed)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from shoal.scheduler.copies import LONGEST_INTERVAL
from shoal.service.bench.step_settings import (
    DEFAULT_SIZE,
    STEP_KEYS,
    StepSettings,
    step_result,
    step_seconds,
)
from shoal.service.cli import cli

TINY = StepSettings(model="gpt", size="tiny", steps=1, warmup=1, repeats=2)


def _canned(s: StepSettings) -> dict[str, Any]:
    return step_result(
        s,
        plain=100.0,
        shoal=80.0,
        shoal_copies=60.0,
        shoal_over_plain=0.8,
        copies_overhead=0.25,
        stage_busy=[0.9],
        rounds=[{"shoal_over_plain": 0.8, "copies_overhead": 0.25}],
        device="cpu",
        machine={
            "date": "today",
            "cpus": 2,
            "load_average_1m": 0.5,
            "torch": "2",
            "ray": "2",
        },
        notes=["one thread"],
        started=0.0,
        extra={
            "plain_step_s": 0.16,
            "shoal_step_s": 0.2,
            "shoal_copies_step_s": 0.25,
            "copies_tail_share": 0.02,
            "step_flops": 2e9,
            "peak_tflops": 0.05,
            "mfu": {"plain": 0.5, "shoal": 0.4, "shoal_copies": 0.3},
        },
    )


@pytest.mark.unit
def test_defaults_are_the_issue_model_on_cuda_and_a_smaller_one_on_cpu() -> None:
    cuda = StepSettings(device="cuda", size=DEFAULT_SIZE["cuda"])
    assert (cuda.model, cuda.optimizer) == ("gpt", "adamw")
    assert cuda.shape.model == {"d_model": 512, "n_layers": 8, "n_heads": 8}
    assert cuda.shape.data["seq_len"] == 128
    assert (cuda.shape.batch, cuda.shape.micro_batches) == (32, 4)
    cpu = StepSettings(device="cpu", size=DEFAULT_SIZE["cpu"])
    assert 1e6 < cpu.parameters < cuda.parameters
    assert cpu.timed_steps == cpu.warmup + cpu.repeats * cpu.steps


@pytest.mark.unit
def test_settings_refuse_what_cannot_run() -> None:
    with pytest.raises(ValueError, match=r"stages \(4\) must be 1..3"):
        StepSettings(size="tiny", stages=4)
    with pytest.raises(ValueError, match="warmup must be >= 1"):
        StepSettings(warmup=0)
    with pytest.raises(ValueError, match="size 'huge'"):
        StepSettings(size="huge")
    with pytest.raises(ValueError, match="device 'tpu'"):
        StepSettings(device="tpu")


@pytest.mark.unit
def test_step_seconds_are_the_gaps_between_step_boundaries() -> None:
    assert step_seconds(1.0, [3.0, 3.5, 4.5]) == [2.0, 0.5, 1.0]
    assert step_seconds(1.0, [3.0, 4.0, 4.0, 4.0, 4.5]) == [2.0, 1 / 3, 1 / 3, 1 / 3, 0.5]
    assert step_seconds(1.0, []) == []


@pytest.mark.unit
def test_result_has_the_keys_first_and_consistent_ratios() -> None:
    result = _canned(TINY)
    assert list(result)[: len(STEP_KEYS)] == list(STEP_KEYS)
    assert result["shoal_over_plain"] == pytest.approx(0.8)
    assert result["copies_overhead"] == pytest.approx(0.25)
    assert (result["batch"], result["micro_batches"], result["stages"]) == (8, 2, 1)
    assert result["parameters"] == TINY.parameters
    assert json.loads(json.dumps(result)) == result


@pytest.mark.unit
@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_the_plain_loop_trains_exactly_as_the_reference(
    model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shoal.service.bench.plain_loop import refs
    from shoal.service.bench.step import plain_step_times
    from shoal.workers.reference import train_reference

    s = StepSettings(model=model, size="tiny", steps=2, warmup=1, repeats=2)
    threads = torch.get_num_threads()
    during: list[int] = []
    step = torch.nn.utils.clip_grad_norm_

    def clip(*args: Any, **kwargs: Any) -> Any:
        during.append(torch.get_num_threads())
        return step(*args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    times, losses = plain_step_times(s)
    assert during == [1] * s.timed_steps  # one thread on a CPU, as a Shoal virtual device
    assert torch.get_num_threads() == threads  # and undone after
    reference = train_reference(
        *refs(s),
        batch_size=s.shape.batch,
        micro_batches=s.shape.micro_batches,
        steps=s.timed_steps,
        seed=s.seed,
    )
    assert losses == pytest.approx(reference.losses, rel=1e-6)
    assert len(times) == s.timed_steps and all(t > 0 for t in times)


@pytest.mark.integration
@pytest.mark.slow
def test_a_tiny_run_reports_positive_consistent_numbers(ray_address: str) -> None:
    from shoal.service.bench.step import run_step

    s = StepSettings(model="gpt", size="tiny", stages=2, steps=1, warmup=1, repeats=2, rounds=2)
    seen: list[str] = []
    result = run_step(s, seen.append)
    phases = ["plain PyTorch loop", "starting Ray", "shoal", "shoal, keeping copies"]
    assert seen == [f"round {n}/2: {p}" for n in (1, 2) for p in phases]
    for key in STEP_KEYS:
        assert key in result, key
    kinds = ("plain", "shoal", "shoal_copies")
    rates = [result[f"{k}_samples_per_s"] for k in kinds]
    assert all(math.isfinite(r) and r > 0 for r in rates), rates
    # Every figure is the median over the rounds (of two: their mean); a ratio is taken
    # within its round, the copies' overhead over each round's pairs of windows.
    rounds = result["rounds"]
    assert len(rounds) == 2
    for key in (*(f"{k}_samples_per_s" for k in kinds), "shoal_over_plain", "copies_overhead"):
        assert result[key] == pytest.approx((rounds[0][key] + rounds[1][key]) / 2), key
    for r in rounds:
        assert r["shoal_over_plain"] == pytest.approx(
            r["shoal_samples_per_s"] / r["plain_samples_per_s"]
        )
        # The run with copies: windows of whole intervals with copies, then as many steps
        # without; at most ``repeats`` pairs, the overhead what the paused ones saved.
        pairs = r["copy_windows"]
        assert 1 <= len(pairs) <= s.repeats, r
        assert all(p["steps"] >= s.steps for p in pairs), pairs
        copying, paused = (sum(p[k] for p in pairs) for k in ("copying_ms", "paused_ms"))
        assert r["copies_overhead"] == pytest.approx(1 - paused / copying), r
        # Each copying window's last copy, waited for as its paused window started.
        tails = [p["tail_ms"] for p in pairs]
        assert all(0 <= p["tail_ms"] < p["paused_ms"] for p in pairs), pairs
        assert r["copies_tail_share"] == pytest.approx(sum(tails) / paused), r
        steps = sum(p["steps"] for p in pairs)
        assert r["shoal_copies_samples_per_s"] == pytest.approx(
            s.shape.batch * steps / copying * 1000
        )
        # Each step's wall ms, warmup included, and the copy's before it (0 without one).
        assert len(r["step_ms"]) == s.timed_steps, r
        assert len(r["copies_step_ms"]) == len(r["copy_ms"]) > s.timed_steps, r
        assert all(ms > 0 for ms in r["step_ms"] + r["copies_step_ms"]), r
        assert any(ms > 0 for ms in r["copy_ms"]), r  # the copies were taken
    timed = result["timed_s"]
    assert timed["shoal"] > 0 and timed["shoal_copies"] > 0, timed
    assert result["shoal_copies_step_s"] > 0 and result["shoal_paused_step_s"] > 0, result
    # MFU: the traced FLOPs of a step at each rate, over one thread's measured peak.
    assert result["peak_tflops"] == pytest.approx(result["device_gflops"] / 1e3)
    for kind, rate in zip(kinds, rates, strict=True):
        want = result["step_flops"] * rate / s.shape.batch / (result["peak_tflops"] * 1e12)
        assert result["mfu"][kind] == pytest.approx(want), kind
    assert 0 < result["mfu"]["shoal"] < 1, result["mfu"]
    assert 1 <= result["copy_interval_steps"] <= LONGEST_INTERVAL  # the job's own choice
    copy_s = result["copies_engine_copy_s"]  # what the job measured a copy to cost
    assert copy_s is None or 0 < copy_s < result["wall_s"], copy_s
    assert len(result["stage_busy"]) == 2
    assert all(0 < b <= 1 for b in result["stage_busy"]), result["stage_busy"]
    assert result["device"] == "cpu"
    assert result["machine"]["cpus"] >= 1 and result["machine"]["torch"] != "-"
    assert "one thread" in " ".join(result["notes"])
    assert (result["stages"], result["steps"], result["warmup"], result["repeats"]) == (2, 1, 1, 2)
    # Shoal does the plain loop's math: the same losses, step by step.
    assert result["loss_max_abs_diff"] < 1e-5
    assert json.loads(json.dumps(result)) == result


def _no_run(settings: StepSettings, progress: Any) -> dict[str, Any]:
    raise AssertionError("the bench must not run")


@pytest.mark.unit
def test_cuda_without_cuda_is_a_cli_error_not_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal.service.bench import step as step_bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(step_bench, "run_step", _no_run)
    result = CliRunner().invoke(cli, ["bench", "step", "--device", "cuda"])
    assert result.exit_code == 2, result.output
    assert "--device cuda: PyTorch sees no CUDA device" in result.output
    assert "use --device cpu" in result.output
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)


@pytest.mark.unit
def test_bench_step_prints_a_table_or_json(monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal.service.bench import step as step_bench

    asked: list[StepSettings] = []

    def canned(settings: StepSettings, progress: Any) -> dict[str, Any]:
        asked.append(settings)
        return _canned(settings)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(step_bench, "run_step", canned)
    result = CliRunner().invoke(cli, ["bench", "step"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert (asked[0].device, asked[0].size, asked[0].stages) == ("cpu", DEFAULT_SIZE["cpu"], 1)
    assert "plain PyTorch, 1 process, 1 thread" in result.output
    assert "Shoal, 1 stage on cpu, keeping copies" in result.output
    assert "Shoal / plain 0.80; copies cost 25.0% of Shoal's time where it copies" in (
        " ".join(result.output.split())
    )
    assert "ran on into the paused ones for 2.0% of their time" in " ".join(result.output.split())
    assert "40.0%" in result.output  # Shoal's MFU, beside its samples/s
    assert "2.0 GFLOP a step over the device's float32 peak, 0.05 TFLOP/s" in result.output
    args = ["bench", "step", "--json", "--size", "tiny", "--model", "mlp", "--stages", "2"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    answer = json.loads(result.output.strip().splitlines()[-1])
    assert answer["shoal_over_plain"] == pytest.approx(0.8)
    assert (asked[1].model, asked[1].size, asked[1].stages) == ("mlp", "tiny", 2)
    result = CliRunner().invoke(cli, ["bench", "step", "--size", "tiny", "--stages", "5"])
    assert result.exit_code == 2
    assert "stages (5) must be 1..3" in result.output
