"""The datasets: built-in sources, user data factories, and the loss of each task.

A data source is *addressed by step*: ``batch(step, batch_size)`` is a pure function of the
seed, the config, the step and the batch size. The data cursor of a job is therefore just
its step, so a job resumed at step k, on any partition, sees exactly the batches it would
have seen, and the pipeline engine and the single-process reference read the same batches.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from shoal.workers.factories import FactoryError, load_callable
from shoal.workers.snapshot import DataRef
from shoal.workers.zoo.registry import DataMeta, RegistryError, data_meta


@runtime_checkable
class DataSource(Protocol):
    """What a dataset offers the engine: its meta and its mini-batches by step number."""

    meta: DataMeta

    def batch(self, step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        """Inputs and targets of mini-batch number ``step``."""
        ...


def _generator(seed: int, *keys: int) -> torch.Generator:
    """A CPU generator seeded from ``seed`` and ``keys``, well mixed so nearby keys differ."""
    # SeedSequence wants non-negative entropy; masking keeps negative seeds distinct and valid.
    entropy = [seed & (2**64 - 1), *(k & (2**64 - 1) for k in keys)]
    state = np.random.SeedSequence(entropy).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


# Stream tags, so that the teacher, the chain and the batches never share random numbers.
_TEACHER, _BATCH, _EPOCH = 1, 2, 3


class SyntheticRegression:
    """Inputs ~ N(0, 1); targets from a fixed random two-layer teacher plus Gaussian noise."""

    _TEACHER_HIDDEN = 32

    def __init__(self, meta: DataMeta, *, features: int, outputs: int, noise: float, seed: int):
        self.meta = meta
        self.seed = seed
        self.noise = noise
        g = _generator(seed, _TEACHER)
        self._w1 = torch.randn(features, self._TEACHER_HIDDEN, generator=g) / features**0.5
        self._w2 = (
            torch.randn(self._TEACHER_HIDDEN, outputs, generator=g) / self._TEACHER_HIDDEN**0.5
        )

    def batch(self, step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        g = _generator(self.seed, _BATCH, step)
        x = torch.randn(batch_size, self._w1.shape[0], generator=g)
        clean = torch.tanh(x @ self._w1) @ self._w2
        y = clean + self.noise * torch.randn(clean.shape, generator=g)
        return x, y


class SyntheticLM:
    """Token sequences from a seeded random Markov chain: learnable, with a known floor.

    Every token has a few random successors with random probabilities, so a model that
    learns the bigram table gets far below ``log(vocab_size)``; the table stays
    ``vocab_size x successors`` even for the largest vocabularies.
    """

    _SUCCESSORS = 8
    _PEAK = 1.5

    def __init__(self, meta: DataMeta, *, vocab_size: int, seq_len: int, seed: int):
        self.meta = meta
        self.seed = seed
        self.seq_len = seq_len
        g = _generator(seed, _TEACHER)
        shape = (vocab_size, min(vocab_size, self._SUCCESSORS))
        self._successors = torch.randint(vocab_size, shape, generator=g)
        logits = self._PEAK * torch.randn(shape, generator=g)
        self._cdf = torch.softmax(logits, dim=1).cumsum(dim=1)

    def batch(self, step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        g = _generator(self.seed, _BATCH, step)
        vocab, width = self._cdf.shape
        tokens = torch.empty(batch_size, self.seq_len + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(vocab, (batch_size,), generator=g)
        draws = torch.rand(self.seq_len, batch_size, 1, generator=g)
        for t in range(self.seq_len):
            prev = tokens[:, t]
            # A cumulative sum may end a hair below 1.0; a draw above it takes the last successor.
            pick = torch.searchsorted(self._cdf[prev], draws[t]).clamp_(max=width - 1)
            tokens[:, t + 1] = self._successors[prev].gather(1, pick).squeeze(1)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


@functools.cache
def _digits() -> tuple[Tensor, Tensor]:
    from sklearn.datasets import load_digits  # bundled with scikit-learn: no download

    bunch = load_digits()
    pixels = torch.tensor(bunch.data, dtype=torch.float32) / 16.0
    return pixels, torch.tensor(bunch.target, dtype=torch.int64)


@functools.lru_cache(maxsize=8)
def _epoch_order(seed: int, epoch: int, n: int) -> Tensor:
    return torch.randperm(n, generator=_generator(seed, _EPOCH, epoch))


class Digits:
    """scikit-learn's 1,797 8x8 handwritten digits, pixels scaled to [0, 1].

    Sample number ``p = step * batch_size + r`` is position ``p % N`` of epoch ``p // N``,
    whose order is a permutation seeded by (seed, epoch): batches wrap across epochs.
    """

    def __init__(self, meta: DataMeta, *, images: bool, seed: int):
        self.meta = meta
        self.seed = seed
        self.images = images

    def batch(self, step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        pixels, labels = _digits()
        n = len(labels)
        positions = torch.arange(step * batch_size, (step + 1) * batch_size)
        epochs = positions // n
        index = torch.empty_like(positions)
        for epoch in range(int(epochs[0]), int(epochs[-1]) + 1):
            here = epochs == epoch
            index[here] = _epoch_order(self.seed, epoch, n)[positions[here] % n]
        x = pixels[index]
        return (x.view(-1, 1, 8, 8) if self.images else x), labels[index]


_SKIPPED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


@functools.cache
def _stdlib_sources() -> Tensor:
    """The standard library's sources, in sorted path order, read once: about 12 MiB, all that
    any ``max_bytes`` can take, so one copy serves every size a job asks for."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths: list[Path] = []
    for folder, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        paths.extend(Path(folder, f) for f in filenames if f.endswith(".py"))
    text = b"".join(path.read_bytes() for path in sorted(paths))
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def _pysource_corpus(max_bytes: int) -> Tensor:
    """The first ``max_bytes`` of the standard library's sources: a view of the one copy
    (a cache keyed by the size would hold a corpus per size asked for)."""
    return _stdlib_sources()[:max_bytes]


class PySource:
    """Byte-level language modelling on the Python standard library's own source code.

    The corpus is read once per process. It is the same on machines with the same Python
    build, which a cluster's workers share (one image).
    """

    def __init__(self, meta: DataMeta, *, seq_len: int, max_bytes: int, seed: int):
        self.meta = meta
        self.seed = seed
        self.seq_len = seq_len
        self.corpus = _pysource_corpus(max_bytes)
        if len(self.corpus) <= seq_len:
            raise RegistryError(
                "data.config.seq_len",
                f"the corpus has only {len(self.corpus)} bytes; lower seq_len below that",
            )

    def batch(self, step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        g = _generator(self.seed, _BATCH, step)
        starts = torch.randint(len(self.corpus) - self.seq_len, (batch_size, 1), generator=g)
        windows = self.corpus[starts + torch.arange(self.seq_len + 1)].long()
        return windows[:, :-1], windows[:, 1:]


_BUILTINS: dict[str, Callable[..., DataSource]] = {
    "synthetic-regression": SyntheticRegression,
    "synthetic-lm": SyntheticLM,
    "digits": Digits,
    "pysource": PySource,
}


def make_data(ref: DataRef, seed: int, allowed: Sequence[str] = ()) -> DataSource:
    """The data source a job names: a built-in (config validated, defaults filled) or a factory."""
    if ref.builtin is not None and ref.factory is None:
        config, meta = data_meta(ref.builtin, ref.config)
        return _BUILTINS[ref.builtin](meta, seed=seed, **config)
    if ref.factory is not None and ref.builtin is None:
        source = load_callable(ref.factory, allowed)(dict(ref.config), seed)
        if not isinstance(source, DataSource) or not isinstance(source.meta, DataMeta):
            raise FactoryError(
                f"data factory {ref.factory!r} returned a {type(source).__name__}; it must"
                " return an object with a DataMeta 'meta' attribute and a"
                " batch(step, batch_size) method"
            )
        return source
    raise RegistryError("data", "name exactly one of builtin or factory")


def _meta_rows(shape: Sequence[int], dtype: torch.dtype, rows: int) -> Tensor:
    return torch.empty((rows, *shape), dtype=dtype, device="meta")


def sample_batch(
    ref: DataRef, rows: int, allowed: Sequence[str] = ()
) -> tuple[DataMeta, Tensor, Tensor]:
    """The meta of a job's data and a mini-batch of ``rows`` samples as its source yields one,
    on the ``meta`` device: shapes and dtypes without storage, for tracing. A built-in's comes
    from its ``DataMeta`` alone, so no corpus, table or sample is built however large the
    config; a factory's source is built and asked for one sample, whose shape is repeated."""
    if ref.builtin is not None and ref.factory is None:
        _, meta = data_meta(ref.builtin, ref.config)
        if meta.task == "lm":  # token ids in, the next token ids out
            ids = _meta_rows(meta.input_shape, torch.int64, rows)
            return meta, ids, torch.empty_like(ids)
        inputs = _meta_rows(meta.input_shape, torch.float32, rows)
        if meta.task == "classification":  # one class index per sample
            return meta, inputs, _meta_rows((), torch.int64, rows)
        return meta, inputs, _meta_rows((meta.targets,), torch.float32, rows)
    source = make_data(ref, 0, allowed)
    x, y = source.batch(0, 1)
    return (
        source.meta,
        _meta_rows(x.shape[1:], x.dtype, rows),
        _meta_rows(y.shape[1:], y.dtype, rows),
    )


def _lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def loss_fn(task: str) -> Callable[[Tensor, Tensor], Tensor]:
    """The mean-reduced loss of a task: outputs and targets in, a scalar out."""
    losses: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
        "regression": F.mse_loss,
        "classification": F.cross_entropy,
        "lm": _lm_loss,
    }
    if task not in losses:
        raise ValueError(f"unknown task {task!r}; choose one of {sorted(losses)}")
    return losses[task]
