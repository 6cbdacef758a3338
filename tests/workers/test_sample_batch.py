"""What a submission's trace sees of the data: shapes and dtypes on the meta device, never a
real batch, corpus or table; and a corpus read once whatever sizes jobs ask for."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shoal.workers.snapshot import DataRef, ModelRef
from shoal.workers.zoo import data as data_module
from shoal.workers.zoo.data import make_data, sample_batch
from shoal.workers.zoo.models import build_blocks, built_alike, count_blocks
from shoal.workers.zoo.registry import DATASETS, data_meta
from tests.factories import BUILTIN_DATA as BUILTINS

pytestmark = pytest.mark.unit


def test_every_registered_dataset_is_sampled() -> None:
    assert {name for name, _ in BUILTINS} == set(DATASETS)


@pytest.mark.parametrize(("name", "config"), BUILTINS)
def test_a_sample_batch_is_shaped_as_a_real_one_without_storage(
    name: str, config: dict[str, Any]
) -> None:
    ref = DataRef(name, None, config)
    meta, x, y = sample_batch(ref, 6)
    real_x, real_y = make_data(ref, 0).batch(0, 6)
    assert meta == make_data(ref, 0).meta
    for sample, real in ((x, real_x), (y, real_y)):
        assert sample.device.type == "meta"
        assert (sample.shape, sample.dtype) == (real.shape, real.dtype)


def test_a_built_in_sample_builds_no_data(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("a sample batch built a data source")

    monkeypatch.setattr(data_module, "make_data", refuse)
    monkeypatch.setattr(data_module, "_stdlib_sources", refuse)
    _, x, _ = sample_batch(DataRef("pysource", None, {"max_bytes": 200_000_000}), 1_048_576)
    assert x.shape == (1_048_576, 64) and x.device.type == "meta"


def test_a_factory_sample_asks_its_source_for_one_sample() -> None:
    ref = DataRef(None, "tests.workers.test_factories:sum_data", {"width": 3})
    asked = []
    real = make_data(ref, 0, ["tests.workers.test_factories"])
    source_type = type(real)
    batch = source_type.batch

    def counted(self: Any, step: int, batch_size: int) -> Any:
        asked.append(batch_size)
        return batch(self, step, batch_size)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(source_type, "batch", counted)
        meta, x, y = sample_batch(ref, 100_000, ["tests.workers.test_factories"])
    assert asked == [1]
    assert (x.shape, y.shape, x.device.type) == ((100_000, 3), (100_000, 1), "meta")
    assert meta.input_shape == (3,)


def test_corpora_of_any_sizes_share_one_read() -> None:
    """The corpus cache is keyed by a spec value: one prefix is held, not one per size."""
    sizes = [10_000 + 7_919 * i for i in range(20)]
    corpora = [data_module._pysource_corpus(size) for size in sizes]
    assert [len(c) for c in corpora] == sizes
    assert len({c.untyped_storage().data_ptr() for c in corpora}) == 1
    longest = corpora[-1]
    assert all(torch.equal(c, longest[: len(c)]) for c in corpora)


@pytest.mark.parametrize(
    ("model", "data", "distinct"),
    [
        (ModelRef("mlp", None, {"layers": 6}), DataRef("digits", None, {}), [0, 1, 6]),
        (ModelRef("gpt", None, {"n_layers": 5}), DataRef("synthetic-lm", None, {}), [0, 1, 6]),
        (
            ModelRef("convnet", None, {"channels": [4, 4, 8]}),
            DataRef("digits", None, {}),
            [0, 1, 2, 3],
        ),
    ],
)
def test_blocks_said_alike_are_built_alike(
    model: ModelRef, data: DataRef, distinct: list[int]
) -> None:
    """A trace measures one block of each kind: those said alike must be the same module."""
    _, meta = data_meta(str(data.builtin), data.config)
    count = count_blocks(model, meta)
    alike = built_alike(model, meta, count)
    assert sorted(set(alike)) == distinct
    with torch.device("meta"):
        blocks = build_blocks(model, meta, 0, range(count))
    for i, first in enumerate(alike):
        assert repr(blocks[i]) == repr(blocks[first])
        shapes = [p.shape for p in blocks[i].parameters()]
        assert shapes == [p.shape for p in blocks[first].parameters()]
