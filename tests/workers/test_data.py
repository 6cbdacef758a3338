"""Datasets: shapes and types per meta, batches a pure function of (seed, config, step, size)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from shoal.workers.factories import FactoryError
from shoal.workers.snapshot import DataRef
from shoal.workers.zoo import data as data_module
from shoal.workers.zoo.data import DataSource, loss_fn, make_data
from shoal.workers.zoo.registry import DATASETS, RegistryError
from tests.factories import BUILTIN_DATA as BUILTINS

pytestmark = pytest.mark.unit

FACTORY_ALLOWED = ["tests.workers.test_factories"]


def builtin(name: str, config: dict[str, Any] | None = None, seed: int = 0) -> DataSource:
    return make_data(DataRef(name, None, config or {}), seed)


def test_every_registered_dataset_is_built() -> None:
    assert {name for name, _ in BUILTINS} == set(DATASETS)


@pytest.mark.parametrize(("name", "config"), BUILTINS)
def test_batches_match_the_meta(name: str, config: dict[str, Any]) -> None:
    source = builtin(name, config)
    x, y = source.batch(3, 6)
    meta = source.meta
    assert x.shape == (6, *meta.input_shape)
    if meta.task == "regression":
        assert x.dtype == y.dtype == torch.float32
        assert y.shape == (6, meta.targets)
    elif meta.task == "classification":
        assert x.dtype == torch.float32 and y.dtype == torch.int64
        assert y.shape == (6,)
        assert int(y.min()) >= 0 and int(y.max()) < meta.targets
    else:
        assert x.dtype == y.dtype == torch.int64
        assert y.shape == x.shape
        assert int(x.min()) >= 0 and int(x.max()) < meta.vocab_size
        # The target of position t is the input at t + 1: next-token prediction.
        assert torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize(("name", "config"), BUILTINS)
def test_a_batch_is_a_pure_function_of_seed_step_and_size(
    name: str, config: dict[str, Any]
) -> None:
    first = builtin(name, config, seed=5).batch(7, 4)
    again = builtin(name, config, seed=5)
    again.batch(0, 4)  # reading other batches first changes nothing (no hidden cursor)
    second = again.batch(7, 4)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    other_step = again.batch(8, 4)
    other_seed = builtin(name, config, seed=6).batch(7, 4)
    assert not torch.equal(first[0], other_step[0])
    assert not torch.equal(first[0], other_seed[0])


def test_batches_do_not_depend_on_the_global_rng() -> None:
    source = builtin("synthetic-regression")
    torch.manual_seed(1)
    a = source.batch(2, 4)[0]
    torch.manual_seed(2)
    assert torch.equal(a, source.batch(2, 4)[0])


def test_digits_pixels_are_scaled_to_unit_range() -> None:
    x, _ = builtin("digits").batch(0, 256)
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0


def test_digits_epochs_are_permutations_that_wrap_across_batches() -> None:
    source = builtin("digits", {"images": False}, seed=3)
    n = 1797
    # 7 batches of 300 = 2100 samples: one whole epoch, then 303 samples of the next.
    xs = torch.cat([source.batch(step, 300)[0] for step in range(7)])
    first, second = (data_module._epoch_order(3, epoch, n) for epoch in (0, 1))
    assert sorted(first.tolist()) == list(range(n))
    assert not torch.equal(first, second)  # every epoch is reshuffled
    pixels = data_module._digits()[0]
    assert torch.equal(xs, pixels[torch.cat([first, second[:303]])])


def test_synthetic_lm_is_learnable() -> None:
    # The chain's successors are few and peaked: its entropy is far below a uniform guess.
    source = builtin("synthetic-lm", {"vocab_size": 64, "seq_len": 16})
    x, y = source.batch(0, 512)
    counts = torch.zeros(64, 64)
    counts.index_put_((x.flatten(), y.flatten()), torch.ones(x.numel()), accumulate=True)
    probs = counts / counts.sum(dim=1, keepdim=True).clamp(min=1)
    bigram_entropy = float(-(counts * probs.clamp(min=1e-12).log()).sum() / counts.sum())
    assert bigram_entropy < 0.6 * math.log(64)


def test_synthetic_regression_teacher_is_fixed_by_the_seed() -> None:
    quiet = {"noise": 0.0}
    a, b = builtin("synthetic-regression", quiet, seed=1), builtin("synthetic-regression", quiet, 1)
    y = a.batch(0, 8)[1]
    assert torch.equal(y, b.batch(0, 8)[1])
    assert y.std() > 0


def test_pysource_is_python_source_and_capped() -> None:
    source = builtin("pysource", {"seq_len": 200, "max_bytes": 10_000})
    assert isinstance(source, data_module.PySource)
    assert len(source.corpus) == 10_000
    x, _ = source.batch(0, 4)
    text = bytes(x.flatten().tolist()).decode("utf-8", errors="replace")
    assert any(word in text for word in ("def ", "import ", "class ", "return", "self"))


def test_pysource_refuses_a_window_longer_than_the_corpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Only a stripped-down Python (no sources) has fewer bytes than the largest window.
    monkeypatch.setattr(
        data_module, "_pysource_corpus", lambda _: torch.zeros(100, dtype=torch.uint8)
    )
    with pytest.raises(RegistryError, match="seq_len"):
        builtin("pysource", {"seq_len": 8_192, "max_bytes": 10_000})


def test_invalid_builtin_configs_name_the_field() -> None:
    with pytest.raises(RegistryError, match=r"data\.config\.features"):
        builtin("synthetic-regression", {"features": 0})
    with pytest.raises(RegistryError, match=r"data\.builtin"):
        builtin("imagenet")


@pytest.mark.parametrize(
    "ref",
    [DataRef(None, None, {}), DataRef("digits", "tests.workers.test_factories:sum_data", {})],
)
def test_a_ref_names_exactly_one_source(ref: DataRef) -> None:
    with pytest.raises(RegistryError, match="exactly one"):
        make_data(ref, 0, FACTORY_ALLOWED)


def test_a_data_factory_gets_its_config_and_seed() -> None:
    ref = DataRef(None, "tests.workers.test_factories:sum_data", {"width": 3})
    source = make_data(ref, 9, FACTORY_ALLOWED)
    x = source.batch(0, 5)[0]
    assert x.shape == (5, 3) and source.meta.input_shape == (3,)
    assert torch.equal(x, make_data(ref, 9, FACTORY_ALLOWED).batch(0, 5)[0])


def test_a_data_factory_must_be_allowed_and_return_a_source() -> None:
    with pytest.raises(FactoryError, match="not allowed"):
        make_data(DataRef(None, "tests.workers.test_factories:sum_data", {}), 0)
    with pytest.raises(FactoryError, match="DataMeta 'meta' attribute"):
        make_data(
            DataRef(None, "tests.workers.test_factories:not_a_source", {}), 0, FACTORY_ALLOWED
        )


def test_losses_per_task() -> None:
    out, target = torch.tensor([[1.0], [3.0]]), torch.tensor([[0.0], [0.0]])
    assert float(loss_fn("regression")(out, target)) == pytest.approx(5.0)
    logits = torch.zeros(4, 10)
    assert float(loss_fn("classification")(logits, torch.arange(4))) == pytest.approx(math.log(10))
    lm_logits, tokens = torch.randn(2, 3, 7), torch.randint(7, (2, 3))
    expected = torch.nn.functional.cross_entropy(lm_logits.reshape(6, 7), tokens.reshape(6))
    assert torch.equal(loss_fn("lm")(lm_logits, tokens), expected)
    with pytest.raises(ValueError, match="unknown task"):
        loss_fn("ranking")
