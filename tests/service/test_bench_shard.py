"""``shoal bench shard``: its settings, and one tiny real run (not timed)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from shoal.service.bench.shard import ShardSettings, phases, run_shard
from shoal.service.cli import cli


@pytest.mark.unit
@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"steps": 2}, "--steps"),
        ({"replicas": (1,)}, "--replicas 1"),
        ({"replicas": (16,)}, "--replicas 16"),
        ({"batch_size": 10}, "--batch-size"),
    ],
)
def test_bad_settings_name_their_option(fields: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        ShardSettings(**fields)  # type: ignore[arg-type]


@pytest.mark.unit
def test_bad_options_are_cli_errors_naming_them() -> None:
    result = CliRunner().invoke(cli, ["bench", "shard", "--replicas", "9"])
    assert result.exit_code == 2 and "--replicas 9" in result.output, result.output


@pytest.mark.integration
def test_a_tiny_run_measures_each_modes_share_of_the_state_as_predicted(ray_address: str) -> None:
    s = ShardSettings(hidden=32, layers=2, features=16, outputs=4, steps=3, replicas=(2,))
    seen: list[str] = []
    result = run_shard(s, seen.append)
    assert seen == phases(s)
    runs = {r["shard"]: r for r in result["runs"]}
    assert sorted(runs) == ["full", "gradients", "none", "optimizer"]
    for mode, run in runs.items():
        assert run["samples_per_s"] > 0 and run["vs_none"] > 0
        assert abs(run["prediction_error"]) < 0.01, run
        assert run["loss_max_rel_diff"] < 1e-5, run  # every mode trains alike
        # ZeRO-1 and 2 keep half the optimizer state on each of 2 devices (Adam's step
        # counters aside).
        expected = 1.0 if mode == "none" else 0.5
        if mode == "full":  # ZeRO-3: half of everything, the parameters too
            assert run["optimizer_state_share"] is None
            assert run["state_share"] == pytest.approx(0.5, abs=0.01), run
        else:
            assert run["optimizer_state_share"] == pytest.approx(expected, abs=0.01), run
        # A sharded replica's in-memory copy holds half the parameters and optimizer state.
        assert abs(run["copy_prediction_error"]) < 0.01, run
    for mode in ("optimizer", "gradients", "full"):
        ratio = runs[mode]["copy_bytes_per_device"] / runs["none"]["copy_bytes_per_device"]
        assert ratio == pytest.approx(0.5, abs=0.01), (mode, ratio)
    # One block split 2 ways: each device keeps half its state, as predicted, and it
    # trains as the whole block within float rounding.
    split = result["tensor"]
    assert split["tp1_samples_per_s"] > 0 and split["tp2_samples_per_s"] > 0, split
    assert abs(split["prediction_error"]) < 0.01, split
    share = split["tp2_state_bytes_per_device"] / split["whole_state_bytes"]
    assert share == pytest.approx(0.5, abs=0.01), split
    assert split["loss_max_rel_diff"] < 1e-5, split
