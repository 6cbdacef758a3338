"""The sweep contract: what a search space may say, and the errors that name the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shoal.service.spec_errors import SpecError
from shoal.service.specs import parse_job_spec, validate_job_spec
from shoal.service.sweepspec import (
    MAX_SWEEP_NAME,
    MAX_TRIALS,
    parse_sweep_spec,
    trial_name,
    trial_spec,
    validate_sweep_spec,
)
from tests.factories import job_spec, sweep_spec

pytestmark = pytest.mark.unit


def refusal(**overrides: Any) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as caught:
        validate_sweep_spec(sweep_spec(**overrides), [])
    return caught.value.errors


def test_a_valid_sweep_is_accepted_with_its_completed_base_job() -> None:
    accepted = validate_sweep_spec(sweep_spec(), [])
    assert accepted.trials == 8 and accepted.grid_size is None
    assert accepted.base.spec.model.config["in_features"] == 64  # filled in from the data


def test_a_grid_runs_each_point_once_at_most_max_trials() -> None:
    space = {
        "optimizer.lr": {"type": "categorical", "choices": [0.01, 0.1]},
        "model.config.hidden": {"type": "int", "low": 16, "high": 48, "step": 16},
    }
    accepted = validate_sweep_spec(sweep_spec(algorithm="grid", space=space, max_trials=100), [])
    assert (accepted.grid_size, accepted.trials) == (6, 6)
    small = validate_sweep_spec(sweep_spec(algorithm="grid", space=space, max_trials=4), [])
    assert small.trials == 4


@pytest.mark.parametrize(
    ("space", "field", "message"),
    [
        (
            {"optimizer.lrr": {"type": "uniform", "low": 0.1, "high": 0.2}},
            "space.optimizer.lrr",
            "optimizer has no field 'lrr' (its fields: betas, clip_grad_norm, eps, lr,",
        ),
        (
            {"model.conf.hidden": {"type": "int", "low": 1, "high": 4}},
            "space.model.conf.hidden",
            "model has no section 'conf'",
        ),
        (
            {"optimizer": {"type": "categorical", "choices": [1]}},
            "space.optimizer",
            "names a section, not a field",
        ),
        (
            {"batch_size": {"type": "categorical", "choices": [32, 33]}},
            "space.batch_size",
            "the value 33 makes an invalid job (batch_size (33) must be divisible by",
        ),
        (
            {"optimizer.lr": {"type": "uniform", "low": 0.1, "high": 20.0}},
            "space.optimizer.lr",
            "the value 20.0 makes an invalid job (optimizer.lr: Input should be less than",
        ),
    ],
)
def test_a_space_that_could_make_an_invalid_trial_is_refused_naming_the_path(
    space: dict[str, Any], field: str, message: str
) -> None:
    ((where, text),) = refusal(space=space)
    assert where == field and text.startswith(message), text


@pytest.mark.parametrize(
    ("param", "message"),
    [
        ({"type": "log_uniform", "low": 0.0, "high": 1.0}, "log_uniform needs low > 0"),
        ({"type": "uniform", "low": 0.2, "high": 0.1}, "low (0.2) must be below high (0.1)"),
        ({"type": "uniform", "choices": [1, 2]}, "a uniform parameter takes 'low' and 'high'"),
        ({"type": "categorical", "low": 1.0}, "a categorical parameter takes 'choices'"),
        ({"type": "int", "low": 1.5, "high": 4}, "an int parameter needs whole numbers"),
        ({"type": "uniform", "low": 0.1, "high": 0.2, "step": 2}, "step applies to int"),
    ],
)
def test_bad_distributions_are_refused(param: dict[str, Any], message: str) -> None:
    ((where, text),) = refusal(space={"optimizer.lr": param})
    assert where == "space.optimizer.lr" and message in text, (where, text)


def test_grid_search_needs_finite_dimensions() -> None:
    ((where, text),) = refusal(algorithm="grid")
    assert where == "space.optimizer.lr"
    assert text.startswith("grid search needs finite values; log_uniform has none")


def test_the_base_job_is_validated_like_any_job() -> None:
    ((where, text),) = refusal(base=job_spec(batch_size=30, micro_batches=4))
    assert where == "base" and "batch_size (30) must be divisible" in text


def test_space_keys_must_be_field_paths_other_than_the_name() -> None:
    ((where, text),) = refusal(space={"name": {"type": "categorical", "choices": ["a"]}})
    assert where == "space" and "is not a field path of the base job" in text


def test_the_space_cannot_search_the_code_all_trials_share() -> None:
    digest = "sha256:" + "0" * 64
    errors = refusal(space={"code": {"type": "categorical", "choices": [digest]}})
    assert errors == [
        ("space.code", "the sweep's code is one for all its trials; search other fields")
    ]


def test_a_trial_spec_is_the_base_with_the_values_set_and_its_own_name() -> None:
    base = job_spec()
    spec = trial_spec(base, {"optimizer.lr": 0.3, "model.config.hidden": 8}, "s-3")
    assert spec["optimizer"]["lr"] == 0.3 and spec["model"]["config"]["hidden"] == 8
    assert spec["name"] == "s-3" and base["optimizer"]["lr"] == 0.01  # the base is untouched


def test_the_example_sweep_is_valid() -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "sweep-digits.yaml"
    accepted = validate_sweep_spec(yaml.safe_load(example.read_text()), [])
    assert accepted.trials == 8 and set(accepted.spec.space) == {
        "optimizer.lr",
        "optimizer.momentum",
        "model.config.hidden",
    }


def test_a_sweep_that_names_no_executor_shares_two_devices_under_sharp() -> None:
    """The README: by default a sweep's running trials share two devices under SHARP; so
    too for the README's example sweep, which names neither."""
    example = Path(__file__).resolve().parents[2] / "examples" / "sweep-digits.yaml"
    for payload in (sweep_spec(), yaml.safe_load(example.read_text())):
        assert "executor" not in payload and "devices" not in payload, payload
        spec = validate_sweep_spec(payload, []).spec
        assert (spec.executor, spec.devices) == ("sharp", 2), spec


def test_the_sharp_executor_refuses_gradient_clipping_and_names_the_way_out() -> None:
    base = job_spec(optimizer={"name": "sgd", "lr": 0.1, "clip_grad_norm": 1.0})
    ((where, text),) = refusal(base=base)
    assert where == "base.optimizer.clip_grad_norm" and text.endswith("use executor: jobs")
    assert validate_sweep_spec(sweep_spec(base=base, executor="jobs"), []).trials == 8


@pytest.mark.parametrize("name", ["lr\n", "lr\r\n", "\nlr", "lr sweep", "x" * (MAX_SWEEP_NAME + 1)])
def test_sweep_names_follow_the_job_name_rules_and_leave_room_for_trials(name: str) -> None:
    assert [f for f, _ in refusal(name=name)] == ["name"]


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    name=st.integers(1, 110).flatmap(  # every length up to past the limit
        lambda n: st.from_regex(rf"[A-Za-z0-9][A-Za-z0-9_.\-]{{{n - 1}}}", fullmatch=True)
    ),
    number=st.integers(0, MAX_TRIALS - 1),
)
def test_every_valid_sweep_name_gives_valid_trial_names(name: str, number: int) -> None:
    try:
        parse_sweep_spec(sweep_spec(name=name))
    except SpecError:
        assume(False)  # only names a sweep accepts
    trial = trial_spec(job_spec(), {}, trial_name(name, number))
    assert parse_job_spec(trial).name == f"{name}-{number}"


def test_the_longest_sweep_name_and_the_last_trial_number_make_a_valid_job() -> None:
    name = "s" * MAX_SWEEP_NAME
    spec = parse_sweep_spec(sweep_spec(name=name, max_trials=MAX_TRIALS))
    last = trial_name(spec.name, spec.max_trials - 1)
    assert parse_job_spec(trial_spec(job_spec(), {}, last)).name == last


TINY_GPT = {"builtin": "gpt", "config": {"d_model": 8, "n_heads": 2, "n_layers": 1}}


@pytest.mark.parametrize(
    ("base", "path", "derived"),
    [
        (job_spec(data={"builtin": "synthetic-regression"}), "data.config.features", "in_features"),
        (job_spec(data={"builtin": "synthetic-regression"}), "data.config.outputs", "out_features"),
        (
            job_spec(model=TINY_GPT, data={"builtin": "synthetic-lm"}),
            "data.config.seq_len",
            "seq_len",
        ),
        (
            job_spec(model=TINY_GPT, data={"builtin": "synthetic-lm"}),
            "data.config.vocab_size",
            "vocab_size",
        ),
    ],
)
def test_a_space_over_the_data_moves_the_model_dimensions_the_base_leaves_to_it(
    base: dict[str, Any], path: str, derived: str
) -> None:
    space = {path: {"type": "int", "low": 4, "high": 100}}  # around the data's defaults
    accepted = validate_sweep_spec(sweep_spec(base=base, space=space), [])
    for value in (4, 100):  # each trial as the sweeper makes it, from the base as submitted
        payload = trial_spec(accepted.spec.base.model_dump(mode="json"), {path: value}, "t-0")
        assert validate_job_spec(payload, []).spec.model.config[derived] == value


def test_a_space_over_the_data_contradicting_a_dimension_the_base_sets_is_refused() -> None:
    base = job_spec(
        model={"builtin": "mlp", "config": {"in_features": 8}},
        data={"builtin": "synthetic-regression", "config": {"features": 8}},
    )
    space = {"data.config.features": {"type": "int", "low": 4, "high": 8}}
    ((where, text),) = refusal(base=base, space=space)
    assert where == "space.data.config.features" and "model.config.in_features: is 8" in text
