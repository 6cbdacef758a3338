"""The built-in models, and factory models, as chains of blocks.

A model is a list of blocks, each block's output the next one's input, so any contiguous
range of blocks is a pipeline stage (GPipe). Every built-in block is initialized under its
own seed, derived from (job seed, block index): a device that builds blocks 2..3 gets the
same weights as a process that builds them all, whatever the partition. Nothing here uses
dropout or other randomness in ``forward``, so a pipelined run can equal a plain one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shoal.workers.factories import FactoryError, load_callable
from shoal.workers.snapshot import ModelRef
from shoal.workers.zoo.registry import DataMeta, RegistryError, resolve_model

_SEED_STRIDE = 1_000_003
"""Block ``i`` of a job seeded ``s`` is initialized under ``s * _SEED_STRIDE + i``."""

_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "tanh": nn.Tanh,
}


# ----------------------------------------------------------------------------------- mlp


def _mlp_block(c: dict[str, Any], meta: DataMeta, i: int) -> nn.Module:
    if i == c["layers"]:
        return nn.Linear(c["hidden"], c["out_features"])
    act = _ACTIVATIONS[c["activation"]]()
    if i > 0:
        return nn.Sequential(nn.Linear(c["hidden"], c["hidden"]), act)
    first = nn.Linear(c["in_features"], c["hidden"])
    return (
        nn.Sequential(nn.Flatten(), first, act)
        if len(meta.input_shape) > 1
        else nn.Sequential(first, act)
    )


# ------------------------------------------------------------------------------- convnet


def _convnet_block(c: dict[str, Any], meta: DataMeta, i: int) -> nn.Module:
    channels = c["channels"]
    if i == len(channels):
        flat = channels[-1] * c["height"] * c["width"]
        return nn.Sequential(nn.Flatten(), nn.Linear(flat, c["classes"]))
    before = c["in_channels"] if i == 0 else channels[i - 1]
    k = c["kernel_size"]
    return nn.Sequential(nn.Conv2d(before, channels[i], k, padding=k // 2), nn.ReLU())


# ----------------------------------------------------------------------------------- gpt


class Embedding(nn.Module):
    """Token plus learned position embedding: ids [B, T] -> activations [B, T, d_model]."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(seq_len, d_model)

    def forward(self, ids: Tensor) -> Tensor:
        length = ids.shape[1]
        if length > self.positions.num_embeddings:
            raise ValueError(
                f"a sequence of {length} tokens is longer than the model's seq_len"
                f" ({self.positions.num_embeddings}); raise model.config.seq_len"
            )
        embedded: Tensor = self.tokens(ids) + self.positions(
            torch.arange(length, device=ids.device)
        )
        return embedded


class TransformerLayer(nn.Module):
    """A pre-LayerNorm decoder layer: causal self-attention, then a 4x GELU MLP (GPT-2)."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        # No bias: softmax ignores a shift shared by all keys, so a key bias has a zero
        # gradient in exact arithmetic, and Adam blows its rounding noise up to full-size
        # steps that differ with the micro-batching (or the all-reduce order).
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = (
            part.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
            for part in self.qkv(self.ln1(x)).split(d, dim=2)
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        out: Tensor = x + self.mlp(self.ln2(x))
        return out


def _gpt_block(c: dict[str, Any], meta: DataMeta, i: int) -> nn.Module:
    if i == 0:
        return Embedding(c["vocab_size"], c["seq_len"], c["d_model"])
    if i <= c["n_layers"]:
        return TransformerLayer(c["d_model"], c["n_heads"])
    # No bias on the output projection, as in GPT-2 (and as the registry counts it).
    return nn.Sequential(
        nn.LayerNorm(c["d_model"]), nn.Linear(c["d_model"], c["vocab_size"], bias=False)
    )


_BLOCKS: dict[str, Callable[[dict[str, Any], DataMeta, int], nn.Module]] = {
    "mlp": _mlp_block,
    "convnet": _convnet_block,
    "gpt": _gpt_block,
}


# Which built-in blocks are built alike (class, shapes, settings): block i is built as
# block _SAME_AS[name](config, i) is. Repeated hidden or transformer layers are all one.
_SAME_AS: dict[str, Callable[[dict[str, Any], int], int]] = {
    "mlp": lambda c, i: 1 if 1 <= i < c["layers"] else i,
    "convnet": lambda c, i: i,
    "gpt": lambda c, i: 1 if 1 <= i <= c["n_layers"] else i,
}


# ------------------------------------------------------------------------------- building


_LOADED: ContextVar[bool] = ContextVar("blocks_loaded", default=False)


@contextmanager
def states_loaded(loaded: bool = True) -> Iterator[None]:
    """Blocks built inside (``build_blocks``) will have every state loaded before use: the
    built-in ones skip their random initialisation (built on the meta device, then given
    memory), which took half of a 3-block shard's hand-over. Factories' blocks are built
    as ever (their modules may hold tensors no state restores)."""
    token = _LOADED.set(loaded)
    try:
        yield
    finally:
        _LOADED.reset(token)


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Run the body under ``seed`` without disturbing the caller's RNG state."""
    with torch.random.fork_rng(devices=[]):
        # manual_seed takes at most 64 bits; masking keeps huge or negative seeds valid.
        torch.manual_seed(seed & (2**64 - 1))
        yield


def _factory_blocks(
    factory: str, config: dict[str, Any], meta: DataMeta, seed: int, allowed: Sequence[str]
) -> list[nn.Module]:
    fn = load_callable(factory, allowed)
    with _seeded(seed):
        model = fn(dict(config), meta)
    blocks = list(model) if isinstance(model, (nn.Sequential, list)) else []
    if not blocks or not all(isinstance(b, nn.Module) for b in blocks):
        raise FactoryError(
            f"model factory {factory!r} returned {type(model).__name__}; it must return a"
            " non-empty nn.Sequential or list of nn.Module (the model's blocks, in order)"
        )
    return blocks


def _check_indices(indices: Sequence[int], count: int) -> None:
    bad = [i for i in indices if not 0 <= i < count]
    if bad:
        raise ValueError(f"block indices {bad} are out of range; the model has {count} blocks")


def _neither_or_both() -> RegistryError:
    return RegistryError("model", "name exactly one of builtin or factory")


def build_blocks(
    ref: ModelRef,
    meta: DataMeta,
    seed: int,
    indices: Sequence[int],
    allowed: Sequence[str] = (),
) -> list[nn.Module]:
    """The blocks with the given indices, in that order, freshly initialized on the CPU.

    A built-in model builds only those blocks, block ``i`` under seed ``(seed, i)``. A factory
    model can only be built whole (under ``seed``), and the requested blocks are returned.
    """
    if ref.builtin is not None and ref.factory is None:
        resolved = resolve_model(ref.builtin, ref.config, meta)
        _check_indices(indices, resolved.num_blocks)
        build = _BLOCKS[ref.builtin]
        blocks = []
        for i in indices:
            if _LOADED.get():
                with torch.device("meta"):
                    blocks.append(build(resolved.config, meta, i).to_empty(device="cpu"))
                continue
            with _seeded(seed * _SEED_STRIDE + i):
                blocks.append(build(resolved.config, meta, i))
        return blocks
    if ref.factory is not None and ref.builtin is None:
        everything = _factory_blocks(ref.factory, ref.config, meta, seed, allowed)
        _check_indices(indices, len(everything))
        return [everything[i] for i in indices]
    raise _neither_or_both()


def count_blocks(ref: ModelRef, meta: DataMeta, allowed: Sequence[str] = ()) -> int:
    """How many blocks the model has (a factory model is built once, on the CPU, to see)."""
    if ref.builtin is not None and ref.factory is None:
        return resolve_model(ref.builtin, ref.config, meta).num_blocks
    if ref.factory is not None and ref.builtin is None:
        return len(_factory_blocks(ref.factory, ref.config, meta, 0, allowed))
    raise _neither_or_both()


def built_alike(ref: ModelRef, meta: DataMeta, count: int) -> list[int]:
    """For each of the model's ``count`` blocks, the first block built alike (the same class,
    shapes and settings), so that a tracer builds and measures each distinct block once: a
    built-in's repeated layers are one block; a factory's blocks are each their own."""
    if ref.builtin is None:
        return list(range(count))
    config = resolve_model(ref.builtin, ref.config, meta).config
    return [_SAME_AS[ref.builtin](config, i) for i in range(count)]
