"""``shoal bench copier``: its settings, a tiny real run (not timed) and its CLI."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from shoal.service.bench.copier import CopierSettings, run_copier
from shoal.service.cli import cli


@pytest.mark.unit
def test_settings_refuse_a_window_whose_last_copy_would_be_waited_for_in_the_next() -> None:
    with pytest.raises(ValueError, match=r"steps \(5\) must be a multiple of every \(3\)"):
        CopierSettings(steps=5, every=3)
    with pytest.raises(ValueError, match="size 'huge'"):
        CopierSettings(size="huge")
    with pytest.raises(ValueError, match="copier 'fast' is none of tensors, staged"):
        CopierSettings(copier="fast")
    result = CliRunner().invoke(cli, ["bench", "copier", "--steps", "5", "--every", "3"])
    assert result.exit_code == 2 and "must be a multiple of every" in result.output, result.output


@pytest.mark.unit
def test_a_tiny_run_times_each_window_and_each_copys_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each round one window without copies and one with a copy every ``every`` steps, in
    turn first; each copy's start timed (what a copy is, the copier's own tests check)."""
    from shoal.service.bench import copier

    started: list[int] = []
    real = copier.Copier.start

    def counted(self: copier.Copier, step: int, number: int, blocks: object) -> None:
        started.append(step)
        real(self, step, number, blocks)  # type: ignore[arg-type]

    monkeypatch.setattr(copier.Copier, "start", counted)
    s = CopierSettings(model="gpt", size="tiny", every=2, steps=4, rounds=2, warmup=1)
    result = run_copier(s)
    assert len(result["rounds"]) == 2
    for r in result["rounds"]:
        assert len(r["step_ms"]) == len(r["copies_step_ms"]) == 4
        assert len(r["start_ms"]) == 2 and all(ms > 0 for ms in r["start_ms"])
    # round 1: steps 1-4 without, 5-8 with (copies before 5 and 7); round 2 the other way
    assert started == [5, 7, 9, 11], started
    assert result["state_bytes"] > 0 and result["state_tensors"] > 0
    assert result["copy_every"] == 2 and result["device"] == "cpu"
    assert json.loads(json.dumps(result)) == result


@pytest.mark.unit
def test_the_copier_cli_prints_a_table_or_json() -> None:
    args = ["bench", "copier", "--size", "tiny", "--steps", "2", "--every", "1", "--rounds", "1"]
    table = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert table.exit_code == 0 and "a copy every 1 steps costs" in table.output, table.output
    as_json = CliRunner().invoke(cli, [*args, "--json"], catch_exceptions=False)
    assert as_json.exit_code == 0, as_json.output
    answer = json.loads(as_json.output.strip().splitlines()[-1])
    assert (answer["copy_every"], answer["copier"]) == (1, "tensors")
    # The staged candidate takes the copies instead, in the same windows.
    staged = CliRunner().invoke(
        cli, [*args, "--json", "--copier", "staged"], catch_exceptions=False
    )
    assert staged.exit_code == 0, staged.output
    answer = json.loads(staged.output.strip().splitlines()[-1])
    assert answer["copier"] == "staged" and len(answer["rounds"][0]["start_ms"]) == 2, answer
