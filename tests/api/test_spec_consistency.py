"""Every built-in model on every built-in dataset, through ``POST /api/v1/jobs``: a model
setting that contradicts the data is a 422 naming the field and the fix, never a 5xx, and a
spec the API accepts trains a step.

The survey is derived from the registry: each model's data-derived settings (the config
fields left ``None`` to be filled from the data) are set to the data's value and around it,
on every dataset the model accepts, so a new model, dataset or derived field is covered
without editing this file. Validation does not depend on the database: one SQLite
database serves the whole module.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Iterator
from typing import Any, cast

import httpx
import pytest
from annotated_types import Ge

from shoal.service.db.session import make_engine, make_session_factory, migrate
from shoal.service.settings import Settings
from shoal.workers.reference import train_reference
from shoal.workers.snapshot import DataRef, ModelRef, OptimizerConf
from shoal.workers.zoo.registry import DATASETS, MODELS, RegistryError, data_meta, resolve_model
from tests.api.conftest import Api, _serve
from tests.factories import job_spec

pytestmark = pytest.mark.integration

JOBS = "/api/v1/jobs"
# Small instances of each, so that a step trains in milliseconds.
DATA: list[tuple[str, dict[str, Any]]] = [
    ("synthetic-regression", {"features": 6, "outputs": 2}),
    ("synthetic-lm", {"vocab_size": 16, "seq_len": 8}),
    ("digits", {"images": True}),
    ("digits", {"images": False}),
    ("pysource", {"seq_len": 8, "max_bytes": 10_000}),
]
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "mlp": {"hidden": 8, "layers": 1},
    "convnet": {"channels": [4]},
    "gpt": {"d_model": 8, "n_heads": 2, "n_layers": 1},
}


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    """One migrated SQLite database and app for the whole survey (submissions only add rows)."""
    home = tmp_path_factory.mktemp("survey")
    url = f"sqlite:///{home / 'shoal.db'}"
    migrate(url)
    engine = make_engine(url)
    settings = Settings(home=home, database_url="unused://", rate_limit_per_s=None)
    try:
        yield from _serve(make_session_factory(engine), settings)
    finally:
        engine.dispose()


def derived_fields(model: str) -> list[str]:
    """The settings a model takes from the data when they are left out."""
    fields = MODELS[model].config_model.model_fields
    return [name for name, info in fields.items() if info.default is None]


def lowest(model: str, field: str) -> int:
    info = MODELS[model].config_model.model_fields[field]
    return max(cast(int, m.ge) for m in info.metadata if isinstance(m, Ge))


def pairs() -> list[tuple[str, str, dict[str, Any]]]:
    """Every (model, dataset, data config) the registry accepts together."""
    accepted = []
    for model, (data, config) in itertools.product(MODELS, DATA):
        try:
            resolve_model(model, MODEL_CONFIGS[model], data_meta(data, config)[1])
        except RegistryError:
            continue
        accepted.append((model, data, config))
    return accepted


def cases() -> list[Any]:
    """Each data-derived setting of each accepted pair at the data's value, one off either
    side, and its lowest allowed value."""
    out = []
    for model, data, config in pairs():
        filled = resolve_model(model, MODEL_CONFIGS[model], data_meta(data, config)[1]).config
        for field in derived_fields(model):
            value = filled[field]
            low = lowest(model, field)
            for given in sorted({value, max(value - 1, low), value + 1, low}):
                name = f"{model}-{data}-{config}-{field}={given}"
                out.append(pytest.param(model, data, config, field, given, id=name))
    return out


def submit(
    api: Api, model: str, config: dict[str, Any], data: str, data_config: dict[str, Any]
) -> httpx.Response:
    body = job_spec(
        model={"builtin": model, "config": {**MODEL_CONFIGS[model], **config}},
        data={"builtin": data, "config": data_config},
    )
    r: httpx.Response = api.client.post(JOBS, json=body, headers=api.token("alice"))
    assert r.status_code in (201, 422), r.text  # never a 5xx
    assert "Traceback" not in r.text
    return r


def train_one_step(spec: dict[str, Any]) -> float:
    """One step of the accepted spec, as the API completed it, in one plain process; a
    warning is an error (torch only warns when a regression target broadcasts)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = train_reference(
            ModelRef(spec["model"]["builtin"], None, spec["model"]["config"]),
            DataRef(spec["data"]["builtin"], None, spec["data"]["config"]),
            OptimizerConf(spec["optimizer"]["name"], spec["optimizer"]["lr"]),
            batch_size=spec["batch_size"],
            micro_batches=spec["micro_batches"],
            steps=1,
            seed=spec["seed"],
        )
    return result.losses[0]


def test_the_survey_covers_every_model_and_dataset() -> None:
    assert {d for d, _ in DATA} == set(DATASETS) and set(MODEL_CONFIGS) == set(MODELS)
    assert {m for m, _, _ in pairs()} == set(MODELS)  # every model trains on some dataset
    assert all(derived_fields(m) for m in MODELS)


@pytest.mark.parametrize(("data", "data_config"), DATA, ids=[f"{d}-{c}" for d, c in DATA])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_each_pair_trains_or_is_refused_on_the_model(
    api: Api, model: str, data: str, data_config: dict[str, Any]
) -> None:
    r = submit(api, model, {}, data, data_config)
    if r.status_code == 422:
        assert [e["field"] for e in r.json()["errors"]] == ["model.builtin"], r.text
        return
    assert math.isfinite(train_one_step(r.json()["spec"]))


@pytest.mark.parametrize(("model", "data", "data_config", "field", "given"), cases())
def test_a_data_derived_setting_trains_or_is_a_422_naming_it(
    api: Api, model: str, data: str, data_config: dict[str, Any], field: str, given: int
) -> None:
    r = submit(api, model, {field: given}, data, data_config)
    if r.status_code == 422:
        (error,) = r.json()["errors"]
        assert error["field"] == f"model.config.{field}", error
        assert f"leave model.config.{field} out to take it from the data" in error["message"]
        return
    spec = r.json()["spec"]
    assert spec["model"]["config"][field] == given
    assert math.isfinite(train_one_step(spec))


@pytest.mark.parametrize(
    ("model", "config", "data", "data_config", "field", "message"),
    [
        ("mlp", {"in_features": 63}, "digits", {}, "in_features", "data has 64 features"),
        ("mlp", {"in_features": 7}, *DATA[0], "in_features", "set it to 6"),
        ("mlp", {"out_features": 9}, "digits", {}, "out_features", "at least 10"),
        ("mlp", {"out_features": 3}, *DATA[0], "out_features", "2 regression targets"),
        ("mlp", {"out_features": 1}, *DATA[0], "out_features", "set it to 2"),
        ("convnet", {"in_channels": 3}, "digits", {}, "in_channels", "1 image channels"),
        ("convnet", {"height": 28}, "digits", {}, "height", "set it to 8"),
        ("convnet", {"width": 7}, "digits", {}, "width", "set it to 8"),
        ("convnet", {"classes": 2}, "digits", {}, "classes", "at least 10"),
        ("gpt", {"vocab_size": 255}, *DATA[4], "vocab_size", "256 token values"),
        ("gpt", {"vocab_size": 15}, *DATA[1], "vocab_size", "at least 16"),
        ("gpt", {"seq_len": 7}, *DATA[1], "seq_len", "8 tokens per sequence"),
        ("gpt", {"seq_len": 2}, *DATA[4], "seq_len", "at least 8"),
    ],
)
def test_contradictions_are_refused_with_the_fix(
    api: Api,
    model: str,
    config: dict[str, Any],
    data: str,
    data_config: dict[str, Any],
    field: str,
    message: str,
) -> None:
    r = submit(api, model, config, data, data_config)
    assert r.status_code == 422, r.text
    (error,) = r.json()["errors"]
    assert error["field"] == f"model.config.{field}" and message in error["message"], error


@pytest.mark.parametrize(
    ("model", "config", "data", "data_config"),
    [
        ("mlp", {"out_features": 12}, "digits", {}),  # spare classes are never a target
        ("convnet", {"classes": 11}, "digits", {}),
        ("gpt", {"vocab_size": 300, "seq_len": 20}, *DATA[4]),  # longer than the data's
    ],
)
def test_settings_beyond_the_data_are_accepted_and_train(
    api: Api, model: str, config: dict[str, Any], data: str, data_config: dict[str, Any]
) -> None:
    r = submit(api, model, config, data, data_config)
    assert r.status_code == 201, r.text
    assert math.isfinite(train_one_step(r.json()["spec"]))
