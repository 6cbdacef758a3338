"""Built-in and factory models as chains of blocks, initialized independently of the partition."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shoal.workers.factories import FactoryError
from shoal.workers.snapshot import DataRef, ModelRef
from shoal.workers.zoo.data import make_data
from shoal.workers.zoo.models import build_blocks, count_blocks, states_loaded
from shoal.workers.zoo.registry import MODELS, DataMeta, RegistryError, resolve_model

pytestmark = pytest.mark.unit

REGRESSION = DataMeta("regression", (5,), 2)
DIGITS = DataMeta("classification", (1, 8, 8), 10)
LM = DataMeta("lm", (12,), 17, 17)

CASES: list[tuple[str, dict[str, Any], DataMeta]] = [
    ("mlp", {"hidden": 6, "layers": 3}, REGRESSION),
    ("mlp", {"hidden": 6, "layers": 1, "activation": "gelu"}, DIGITS),
    ("convnet", {"channels": [3, 4, 2], "kernel_size": 3}, DIGITS),
    ("gpt", {"d_model": 16, "n_layers": 3, "n_heads": 2}, LM),
]
FACTORY = ["tests.workers.test_factories"]


def sample(meta: DataMeta, batch: int = 3) -> torch.Tensor:
    if meta.task == "lm":
        return torch.randint(meta.vocab_size, (batch, *meta.input_shape))
    return torch.randn(batch, *meta.input_shape)


def run(blocks: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


def all_blocks(ref: ModelRef, meta: DataMeta, seed: int = 0) -> list[nn.Module]:
    return build_blocks(ref, meta, seed, range(count_blocks(ref, meta, FACTORY)), FACTORY)


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_every_registered_model_is_covered() -> None:
    assert {name for name, _, _ in CASES} == set(MODELS)


@pytest.mark.parametrize(("name", "config", "meta"), CASES)
def test_the_chain_maps_inputs_to_outputs_of_the_task(
    name: str, config: dict[str, Any], meta: DataMeta
) -> None:
    ref = ModelRef(name, None, config)
    blocks = all_blocks(ref, meta)
    assert len(blocks) == resolve_model(name, config, meta).num_blocks
    out = run(blocks, sample(meta))
    expected = (3, *meta.input_shape, meta.targets) if meta.task == "lm" else (3, meta.targets)
    assert out.shape == expected


@pytest.mark.parametrize(
    ("name", "config", "meta", "blocks"),
    [
        ("mlp", {"hidden": 6, "layers": 3}, REGRESSION, 4),  # a block a hidden layer, the output
        ("convnet", {"channels": [3, 4, 2], "kernel_size": 3}, DIGITS, 4),  # conv layers, head
        ("gpt", {"d_model": 16, "n_layers": 3, "n_heads": 2}, LM, 5),  # embedding, layers, head
    ],
)
def test_the_blocks_are_the_layers_the_reference_says(
    name: str, config: dict[str, Any], meta: DataMeta, blocks: int
) -> None:
    assert len(all_blocks(ModelRef(name, None, config), meta)) == blocks


@pytest.mark.parametrize(("name", "config", "meta"), CASES)
def test_parameter_count_matches_the_registry(
    name: str, config: dict[str, Any], meta: DataMeta
) -> None:
    blocks = all_blocks(ModelRef(name, None, config), meta)
    counted = sum(p.numel() for block in blocks for p in block.parameters())
    assert counted == resolve_model(name, config, meta).param_count


@pytest.mark.parametrize(("name", "config", "meta"), CASES)
def test_initialization_does_not_depend_on_the_partition(
    name: str, config: dict[str, Any], meta: DataMeta
) -> None:
    ref = ModelRef(name, None, config)
    whole = all_blocks(ref, meta, seed=11)
    tail = build_blocks(ref, meta, 11, [len(whole) - 1, 1])
    assert same_weights(tail[0], whole[-1]) and same_weights(tail[1], whole[1])
    other_seed = build_blocks(ref, meta, 12, [1])[0]
    assert not same_weights(other_seed, whole[1])


def test_blocks_get_different_weights() -> None:
    # Seeds per block must not repeat: two identical hidden layers would be a silent bug.
    ref = ModelRef("mlp", None, {"hidden": 6, "layers": 3})
    first, second = build_blocks(ref, REGRESSION, 0, [1, 2])
    assert not same_weights(first, second)


def test_building_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    all_blocks(ModelRef("gpt", None, {"d_model": 16, "n_layers": 1, "n_heads": 2}), LM)
    assert torch.equal(torch.rand(4), expected)


def test_huge_and_negative_seeds_are_accepted() -> None:
    ref = ModelRef("mlp", None, {"hidden": 4})
    for seed in (-1, 2**70):
        assert len(build_blocks(ref, REGRESSION, seed, [0])) == 1


def test_gpt_is_causal() -> None:
    blocks = all_blocks(ModelRef("gpt", None, {"d_model": 16, "n_layers": 2, "n_heads": 4}), LM)
    tokens = sample(LM, batch=1)
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % LM.vocab_size
    a, b = run(blocks, tokens), run(blocks, changed)
    assert torch.allclose(a[:, :-1], b[:, :-1], atol=1e-6)
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_gpt_takes_shorter_sequences_but_refuses_longer_ones() -> None:
    blocks = all_blocks(ModelRef("gpt", None, {"d_model": 16, "n_layers": 1, "n_heads": 2}), LM)
    assert run(blocks, torch.randint(17, (2, 5))).shape == (2, 5, 17)
    with pytest.raises(ValueError, match=r"longer than the model's seq_len \(12\)"):
        blocks[0](torch.randint(17, (2, 13)))


@pytest.mark.parametrize(("name", "config", "meta"), CASES)
def test_forward_is_deterministic_in_training_mode(
    name: str, config: dict[str, Any], meta: DataMeta
) -> None:
    # No dropout anywhere: a pipelined run can only equal a plain one if forward is pure.
    blocks = all_blocks(ModelRef(name, None, config), meta)
    x = sample(meta)
    assert torch.equal(run(blocks, x), run(blocks, x))


def test_registry_checks_model_against_data() -> None:
    with pytest.raises(RegistryError, match="gpt needs token-sequence data"):
        count_blocks(ModelRef("gpt", None, {}), DIGITS)
    with pytest.raises(RegistryError, match=r"model\.config\.hidden"):
        build_blocks(ModelRef("mlp", None, {"hidden": 0}), DIGITS, 0, [0])


def test_builtins_fit_their_registered_datasets() -> None:
    source = make_data(DataRef("pysource", None, {"seq_len": 8, "max_bytes": 10_000}), 0)
    blocks = all_blocks(
        ModelRef("gpt", None, {"d_model": 8, "n_layers": 1, "n_heads": 1}), source.meta
    )
    x, y = source.batch(0, 2)
    assert run(blocks, x).shape == (*y.shape, 256)


@pytest.mark.parametrize("indices", [[3], [-1], [0, 5]])
def test_out_of_range_indices_are_refused(indices: list[int]) -> None:
    with pytest.raises(ValueError, match="out of range; the model has 3 blocks"):
        build_blocks(ModelRef("mlp", None, {"layers": 2}), REGRESSION, 0, indices)


@pytest.mark.parametrize(
    "ref",
    [ModelRef(None, None, {}), ModelRef("mlp", "tests.workers.test_factories:tiny_mlp", {})],
)
def test_a_ref_names_exactly_one_model(ref: ModelRef) -> None:
    with pytest.raises(RegistryError, match="exactly one"):
        count_blocks(ref, REGRESSION, FACTORY)
    with pytest.raises(RegistryError, match="exactly one"):
        build_blocks(ref, REGRESSION, 0, [0], FACTORY)


@pytest.mark.parametrize("fn", ["tiny_mlp", "tiny_mlp_list"])
def test_factory_models_are_built_whole_under_the_seed(fn: str) -> None:
    ref = ModelRef(None, f"tests.workers.test_factories:{fn}", {"hidden": 5})
    assert count_blocks(ref, DIGITS, FACTORY) == 3
    whole = all_blocks(ref, DIGITS, seed=4)
    assert run(whole, sample(DIGITS)).shape == (3, 10)
    (last,) = build_blocks(ref, DIGITS, 4, [2], FACTORY)
    assert same_weights(last, whole[2])
    assert not same_weights(build_blocks(ref, DIGITS, 5, [2], FACTORY)[0], whole[2])


def test_a_factory_must_be_allowed_and_return_blocks() -> None:
    with pytest.raises(FactoryError, match="not allowed"):
        count_blocks(ModelRef(None, "tests.workers.test_factories:tiny_mlp", {}), DIGITS)
    bad = ModelRef(None, "tests.workers.test_factories:not_a_model", {})
    with pytest.raises(FactoryError, match="returned str; it must return a non-empty"):
        build_blocks(bad, DIGITS, 0, [0], FACTORY)


@pytest.mark.parametrize(("name", "config", "meta"), CASES)
def test_blocks_built_for_a_state_to_load_compute_as_the_blocks_it_came_from(
    name: str, config: dict[str, Any], meta: DataMeta
) -> None:
    """Built for a state to load (``states_loaded``: no random initialisation), a block
    holds on the CPU just what the state gives it: loaded, it computes as the block the
    state came from, and the global RNG is as it was."""
    ref = ModelRef(name, None, config)
    first = all_blocks(ref, meta, seed=3)
    rng = torch.random.get_rng_state()
    with states_loaded():
        empty = all_blocks(ref, meta, seed=3)
    assert torch.equal(torch.random.get_rng_state(), rng)
    for block, source in zip(empty, first, strict=True):
        assert all(p.device.type == "cpu" for p in block.parameters())
        block.load_state_dict(source.state_dict())
        assert same_weights(block, source)
    x = sample(meta)
    assert torch.equal(run(empty, x), run(first, x))
    assert same_weights(all_blocks(ref, meta, seed=3)[0], first[0])  # outside: as ever


def test_blocks_built_for_a_state_to_load_skip_their_seeded_initialisation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import shoal.workers.zoo.models as models

    def seeded(seed: int) -> None:
        raise AssertionError(f"initialised under seed {seed}")

    monkeypatch.setattr(models, "_seeded", seeded)
    with states_loaded():
        assert len(all_blocks(ModelRef("mlp", None, {"hidden": 6, "layers": 3}), REGRESSION)) == 4
    with pytest.raises(AssertionError, match="initialised under seed"):
        all_blocks(ModelRef("mlp", None, {"hidden": 6, "layers": 3}), REGRESSION)
