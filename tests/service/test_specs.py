"""JobSpec validation: defaults, bounds, data-derived dimensions, allowed factories."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shoal.service.db.models import Job
from shoal.service.snapshots import build_snapshot
from shoal.service.spec_errors import SpecError
from shoal.service.specs import AcceptedSpec, check_memory, validate_job_spec
from tests.factories import device, job_spec

pytestmark = pytest.mark.unit

FACTORIES = "tests.workers.test_factories"  # its toy model/data factories


def fields(exc: SpecError) -> list[str]:
    return [f for f, _ in exc.errors]


def test_minimal_spec_gets_defaults_and_data_dimensions() -> None:
    accepted = validate_job_spec(
        {
            "name": "m",
            "model": {"builtin": "mlp", "config": {}},
            "data": {"builtin": "digits"},
            "steps": 5,
        },
        [],
    )
    spec = accepted.spec
    assert spec.model.config["in_features"] == 64
    assert spec.model.config["out_features"] == 10
    assert spec.optimizer.name == "adam"
    assert spec.parallelism.stages == "auto"
    assert accepted.num_blocks == 3


def test_gpt_on_pysource_takes_vocabulary_and_length_from_data() -> None:
    accepted = validate_job_spec(
        job_spec(
            model={"builtin": "gpt", "config": {"n_layers": 3}},
            data={"builtin": "pysource", "config": {"seq_len": 48}},
        ),
        [],
    )
    assert accepted.spec.model.config["vocab_size"] == 256
    assert accepted.spec.model.config["seq_len"] == 48
    assert accepted.num_blocks == 5


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"steps": -1}, "steps"),
        ({"steps": 0}, "steps"),
        ({"batch_size": 8, "micro_batches": 16}, ""),
        ({"batch_size": 10, "micro_batches": 4}, ""),
        ({"model": {"builtin": "mlp", "config": {"layers": 10**12}}}, "model.config.layers"),
        ({"model": {"builtin": "resnet"}}, "model.builtin"),
        ({"data": {"builtin": "imagenet"}}, "data.builtin"),
        ({"model": {"builtin": "gpt"}}, "model.builtin"),
        ({"model": {"builtin": "mlp", "config": {"depth": 3}}}, "model.config.depth"),
        ({"optimizer": {"name": "lamb"}}, "optimizer.name"),
        ({"optimizer": {"name": "sgd", "betas": [0.9, 0.99]}}, "optimizer"),
        ({"name": "../etc"}, "name"),
        ({"unknown": 1}, "unknown"),
        ({"parallelism": {"stages": 0}}, "parallelism.stages"),
        ({"parallelism": {"stages": 5}, "resources": {"max_devices": 8}}, "parallelism.stages"),
        ({"parallelism": {"replicas": 2}}, "parallelism.replicas"),
        ({"resources": {"min_devices": 3, "max_devices": 2}}, "resources"),
        ({"model": {"builtin": "mlp", "factory": "x:y"}}, "model"),
        ({"optimizer": {"clip_grad_norm": 0}}, "optimizer.clip_grad_norm"),
        ({"optimizer": {"clip_grad_norm": -1.0}}, "optimizer.clip_grad_norm"),
        ({"optimizer": {"clip_grad_norm": float("inf")}}, "optimizer.clip_grad_norm"),
        ({"optimizer": {"clip_grad_norm": "small"}}, "optimizer.clip_grad_norm"),
        ({"precision": "fp16"}, "precision"),
        ({"parallelism": {"shard": "zero3"}}, "parallelism.shard"),
        ({"parallelism": {"tensor": 0}}, "parallelism.tensor"),
        ({"parallelism": {"tensor": 2}}, "parallelism.tensor"),  # max_devices 1
        (
            {
                "parallelism": {"tensor": 2, "replicas": 2, "shard": "gradients"},
                "resources": {"max_devices": 4},
            },
            "parallelism.tensor",
        ),
        (
            {
                "parallelism": {"shard": "full", "replicas": 3},
                "micro_batches": 4,
                "resources": {"max_devices": 3},
            },
            "parallelism.replicas",
        ),
    ],
)
def test_bad_specs_name_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(SpecError) as info:
        validate_job_spec(job_spec(**overrides), [])
    assert field in fields(info.value), info.value.errors


def test_a_block_too_large_for_any_device_is_admitted_split_over_a_tensor_group() -> None:
    """Admission counts a device's share of each split block: on the smallest devices a
    GPT split 4 ways is admitted on, the same GPT on 4 whole devices is refused."""
    gpt = {"builtin": "gpt", "config": {"d_model": 512, "n_layers": 2, "n_heads": 8}}
    data = {"builtin": "synthetic-lm"}
    whole = validate_job_spec(job_spec(model=gpt, data=data, resources={"max_devices": 4}), [])
    split = validate_job_spec(
        job_spec(
            model=gpt,
            data=data,
            parallelism={"tensor": 4, "stages": 1},
            resources={"min_devices": 4, "max_devices": 4},
        ),
        [],
    )

    def admitted(accepted: AcceptedSpec, mb: int) -> bool:
        try:
            check_memory(accepted, mb)
        except SpecError as exc:
            assert fields(exc) == ["resources.max_devices"], exc.errors
            return False
        return True

    smallest = next(mb for mb in range(1, 1024) if admitted(split, mb))
    assert not admitted(whole, smallest)
    assert admitted(whole, 4 * smallest)  # the check is a bound, not a refusal of all
    # Refused whole, the job is told the split that fits.
    with pytest.raises(SpecError) as info:
        check_memory(whole, smallest)
    (error,) = info.value.errors
    assert "(parallelism.tensor: " in error[1], error
    told = int(error[1].rsplit("parallelism.tensor: ", 1)[1].rstrip(")"))
    assert 2 <= told <= 4 and admitted(
        validate_job_spec(
            job_spec(
                model=gpt,
                data=data,
                parallelism={"tensor": told, "stages": 1},
                resources={"min_devices": told, "max_devices": 4},
            ),
            [],
        ),
        smallest,
    )


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            {"factory": f"{FACTORIES}:normed_mlp", "config": {}},
            "no block of the model has a split",
        ),
        (
            {"factory": f"{FACTORIES}:data_dependent_mlp", "config": {}},
            "the model did not trace",
        ),
        # digits has 10 classes: the output block splits at most 10 ways.
        ({"builtin": "mlp", "config": {"hidden": 32}}, "at most 10 ways"),
        # A block that declares its split: over at most its 6 hidden features.
        ({"factory": f"{FACTORIES}:residual_mlp", "config": {"hidden": 6}}, "at most 6 ways"),
        (
            {"builtin": "gpt", "config": {"d_model": 64, "n_layers": 1, "n_heads": 4}},
            "at most 4 ways",
        ),
    ],
)
def test_a_tensor_split_the_model_cannot_take_is_refused_at_submission(
    model: dict[str, Any], message: str
) -> None:
    data = {"builtin": "synthetic-lm"} if model.get("builtin") == "gpt" else {"builtin": "digits"}
    spec = job_spec(
        model=model,
        data=data,
        parallelism={"tensor": 16, "stages": 1},
        resources={"min_devices": 16, "max_devices": 16},
    )
    with pytest.raises(SpecError) as info:
        validate_job_spec(spec, [FACTORIES])
    (error,) = info.value.errors
    assert error[0] == "parallelism.tensor" and message in error[1], error
    if "ways" in message:  # the most it names is admitted
        most = int(message.split()[2])
        spec["parallelism"]["tensor"] = most
        assert validate_job_spec(spec, [FACTORIES]).spec.parallelism.tensor == most


@pytest.mark.parametrize("keep_copies", [True, False])
def test_sharded_replicas_are_accepted_with_or_without_in_memory_copies(
    keep_copies: bool,
) -> None:
    spec = job_spec(
        parallelism={"replicas": 2, "shard": "gradients"},
        elastic={"keep_copies": keep_copies},
        resources={"max_devices": 2},
    )
    assert validate_job_spec(spec, []).spec.parallelism.shard == "gradients"
    assert validate_job_spec(job_spec(), []).spec.parallelism.shard == "none"
    auto = job_spec(parallelism={"shard": "auto"})
    assert validate_job_spec(auto, []).spec.parallelism.shard == "auto"
    full = job_spec(
        parallelism={"replicas": 2, "shard": "full"}, micro_batches=4, resources={"max_devices": 2}
    )
    assert validate_job_spec(full, []).spec.parallelism.shard == "full"


@pytest.mark.parametrize("elastic", [None, {}], ids=["no-section", "empty-section"])
def test_in_memory_copies_are_on_by_default_within_five_percent_of_the_training_time(
    elastic: dict[str, Any] | None, tmp_path: Path
) -> None:
    """README: ``elastic.keep_copies`` is on by default and ``elastic.copy_budget`` is 5% of
    the training time, in the accepted spec and in the snapshot its runner is given."""
    spec = job_spec() if elastic is None else job_spec(elastic=elastic)
    accepted = validate_job_spec(spec, [])
    assert (accepted.spec.elastic.keep_copies, accepted.spec.elastic.copy_budget) == (True, 0.05)
    stored = accepted.spec.model_dump(mode="json")
    row = Job(id="j1", name="j", spec=stored, num_blocks=accepted.num_blocks, attempt=1)
    snap = build_snapshot(
        row,
        [device()],
        [(0, accepted.num_blocks)],
        checkpoint_root=str(tmp_path),
        allowed_factories=[],
    )
    assert (snap.keep_copies, snap.copy_budget) == (True, 0.05)


def test_a_snapshot_carries_the_layouts_shard_and_auto_unplaced_is_whole(tmp_path: Path) -> None:
    spec = job_spec(parallelism={"shard": "auto"}, elastic={"keep_copies": False})
    row = Job(id="j1", name="j", spec=spec, num_blocks=3, attempt=1)
    ranges = [(0, 3)]

    def made(**shard: str) -> str:
        snap = build_snapshot(
            row, [device()], ranges, checkpoint_root=str(tmp_path), allowed_factories=[], **shard
        )
        return snap.shard

    assert made(shard="gradients") == "gradients"  # what the layout decided
    assert made() == "none"  # a SHARP trial is laid out by no partitioner: whole


def test_missing_required_fields_are_each_reported() -> None:
    with pytest.raises(SpecError) as info:
        validate_job_spec({}, [])
    assert {"name", "model", "data", "steps"} <= set(fields(info.value))


def test_non_object_payload_is_refused() -> None:
    with pytest.raises(SpecError, match="object"):
        validate_job_spec(["not", "a", "spec"], [])


def test_factory_outside_allowed_modules_is_refused_without_import() -> None:
    spec = job_spec(model={"factory": "os:system", "config": {}})
    with pytest.raises(SpecError) as info:
        validate_job_spec(spec, ["mypkg"])
    assert fields(info.value) == ["model.factory"]
    assert "SHOAL_ALLOWED_FACTORIES" in str(info.value)


def test_allowed_factory_model_is_built_to_count_its_blocks() -> None:
    spec = job_spec(model={"factory": f"{FACTORIES}:tiny_mlp", "config": {"hidden": 8}})
    accepted = validate_job_spec(spec, [FACTORIES])
    assert accepted.num_blocks == 3


def test_a_factory_model_is_traced_for_its_block_costs() -> None:
    spec = job_spec(model={"factory": f"{FACTORIES}:tiny_mlp", "config": {"hidden": 8}})
    accepted = validate_job_spec(spec, [FACTORIES])
    assert accepted.costs is not None and len(accepted.costs) == 3
    assert accepted.costs[0].param_bytes > 0 and accepted.costs[1].param_bytes == 0  # Tanh


def test_a_factory_model_that_does_not_trace_is_counted_and_says_why() -> None:
    spec = job_spec(model={"factory": f"{FACTORIES}:data_dependent_mlp", "config": {}})
    accepted = validate_job_spec(spec, [FACTORIES])
    assert (accepted.num_blocks, accepted.costs) == (4, None)
    assert accepted.untraced is not None and "meta" in accepted.untraced


def test_allowed_factory_that_fails_is_a_spec_error() -> None:
    spec = job_spec(model={"factory": f"{FACTORIES}:not_a_model", "config": {}})
    with pytest.raises(SpecError) as info:
        validate_job_spec(spec, [FACTORIES])
    assert fields(info.value) == ["model.factory"]


def test_replicas_are_accepted_when_the_devices_allow_them() -> None:
    spec = job_spec(
        parallelism={"stages": 2, "replicas": 2}, resources={"min_devices": 4, "max_devices": 4}
    )
    accepted = validate_job_spec(spec, [])
    assert (accepted.spec.parallelism.stages, accepted.spec.parallelism.replicas) == (2, 2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"parallelism": {"stages": 2, "replicas": 2}, "resources": {"max_devices": 3}},
            "2 stages x 2 replicas need 4 devices but resources.max_devices is 3; raise"
            " max_devices or lower replicas",
        ),
        (
            {"parallelism": {"replicas": 3}, "resources": {"max_devices": 2}},
            "3 replicas of at least one stage need 3 devices but resources.max_devices is 2",
        ),
        (
            {"parallelism": {"replicas": 3}, "resources": {"max_devices": 3}},
            "3 replicas need at least one micro-batch each but micro_batches is 2",
        ),
        ({"parallelism": {"replicas": 4097}}, "must be 'auto' or an integer between 1 and"),
    ],
)
def test_replicas_that_cannot_run_are_refused_with_numbers(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(SpecError) as info:
        validate_job_spec(job_spec(**overrides), [])
    assert fields(info.value) == ["parallelism.replicas"]
    assert message in info.value.errors[0][1], info.value.errors


def test_a_model_is_traced_once_whatever_else_the_specs_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import shoal.workers.profiler

    traced = []
    trace_costs = shoal.workers.profiler.trace_costs

    def counting(*args: Any, **kwargs: Any) -> Any:
        traced.append(kwargs["micro_batch_size"])
        return trace_costs(*args, **kwargs)

    monkeypatch.setattr(shoal.workers.profiler, "trace_costs", counting)
    model = {"builtin": "mlp", "config": {"hidden": 37, "layers": 3}}  # no other test's
    first = validate_job_spec(job_spec(model=model, name="a", steps=5), [])
    again = validate_job_spec(job_spec(model=model, name="b", steps=9, seed=3), [])
    assert traced == [16] and again.costs == first.costs and again.spec.name == "b"
    other = validate_job_spec(job_spec(model=model, batch_size=64), [])  # a new micro-batch
    assert traced == [16, 32] and other.costs != first.costs


@pytest.mark.parametrize(
    "name", ["run\n", "run\r", "run\n\n", "\nrun", "run\x00", "ru n", "run\t", "-run", "x" * 101]
)
def test_names_are_letters_digits_and_punctuation_only_no_trailing_newline(name: str) -> None:
    with pytest.raises(SpecError) as info:
        validate_job_spec(job_spec(name=name), [])
    assert fields(info.value) == ["name"], info.value.errors


@pytest.mark.parametrize("name", ["r", "Run_1.v-2", "0" + "x" * 99])
def test_names_within_the_rules_are_accepted(name: str) -> None:
    assert validate_job_spec(job_spec(name=name), []).spec.name == name


def test_a_built_in_model_that_does_not_trace_is_a_spec_error_not_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import shoal.workers.profiler

    def fails(*args: Any, **kwargs: Any) -> Any:
        raise shoal.workers.profiler.TraceError(
            "RuntimeError: mat1 and mat2 shapes cannot be multiplied"
        )

    monkeypatch.setattr(shoal.workers.profiler, "trace_costs", fails)
    model = {"builtin": "mlp", "config": {"hidden": 41}}  # no other test's: not a cached trace
    with pytest.raises(SpecError) as info:
        validate_job_spec(job_spec(model=model), [])
    assert fields(info.value) == ["model.config"]
    assert "cannot run on this data (RuntimeError: mat1" in str(info.value)
