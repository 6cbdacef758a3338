"""Tensor parallelism (``parallelism.tensor: N``): one block split over N devices of a node.

Megatron-LM's splits (Shoeybi et al., 2019), driven by one process: a worker holds the
block's pieces on its N devices and runs them in turn (on GPUs each device's kernels are
queued and run at once, the launches asynchronous). The parts every device would compute
alike (layer norms, the biases added after a sum) run once, on the first device (*home*),
and autograd carries the gradients across the copies between devices: the copy of a
replicated input to each device is Megatron's *f* (identity forward, sum of the
gradients backward), the sum of the devices' partial outputs its *g*.

* A linear layer (``nn.Linear``, alone or in an ``nn.Sequential`` with parameterless
  layers around it, as the built-in MLP's and GPT's output blocks are): split by output
  features (*column*); each device applies the layers after it to its columns, and the
  columns are concatenated on the home device.
* A GPT layer (``workers.zoo.models.TransformerLayer``): the attention split by heads (the
  query, key and value projections by rows, the output projection by columns) and the MLP
  by its hidden features (the first linear by rows, the second by columns): *column then
  row*, one sum per pair, each sum in device order on the home device.

* A block of a factory's own that declares its split (``DeclaredSplit``): its
  ``tensor_split(devices)`` returns a ``SplitBlock`` of the user's writing, checked when it
  is made (its pieces must make up the block's state exactly, each on its device).

Each whole parameter is its pieces concatenated (``Piece``), so a split block's state
converts to and from the whole block's exactly (``whole_state``, ``load_whole``):
checkpoints and copies do not depend on the split. The sums over devices change the order
of a row-split matrix product's additions: a split block equals the whole one within float
rounding, and bitwise the same split again.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shoal.workers.blocks import Block
from shoal.workers.pipeline.collective import ordered_sum
from shoal.workers.pipeline.sharding import slice_of
from shoal.workers.zoo.models import TransformerLayer


class TensorSplitError(ValueError):
    """A block cannot be split as asked; the message says why and what to change."""


@dataclass(frozen=True)
class Piece:
    """Where one whole parameter's values are in a split block: the split block's
    parameters ``names`` (state-dict keys) concatenated along ``dim``."""

    names: tuple[str, ...]
    dim: int = 0


def cuts(size: int, parts: int) -> list[tuple[int, int]]:
    """``size`` cut into ``parts`` contiguous ``[lo, hi)`` ranges, as sharded replicas cut
    a block (``workers.pipeline.sharding.slice_of``: the first ones one longer)."""
    return [slice_of(size, p, parts) for p in range(parts)]


def linear_piece(weight: Tensor, bias: Tensor | None, device: torch.device) -> nn.Linear:
    """A linear layer on ``device`` holding copies of ``weight`` and ``bias`` (made without
    drawing from the random generator, as an initialization would): a piece of a split."""
    out_features, in_features = weight.shape
    shape = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    layer = shape.to_empty(device=device)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None and layer.bias is not None:
            layer.bias.copy_(bias)
    return layer


class SplitBlock(nn.Module):
    """A block split over ``devices``: computes what the whole block computes. Each split
    keeps the pieces of a device in ``nn.ModuleList``s indexed by device, and everything
    else on the first device (``device_index`` reads where a parameter is from that)."""

    pieces: dict[str, Piece]
    """Each whole parameter or buffer (by the whole block's state-dict key): its pieces."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        super().__init__()
        if len(devices) < 2:
            raise TensorSplitError(f"a split needs 2 or more devices, got {len(devices)}")
        self.devices = list(devices)
        self.home = self.devices[0]
        self.pieces = {}

    def device_index(self, name: str) -> int:
        """Which of ``devices`` holds parameter ``name``: a piece's index in its module
        list (``columns.1.weight``: 1), else the first device (the whole parts)."""
        parts = name.split(".")
        holder = getattr(self, parts[0], None)
        return int(parts[1]) if isinstance(holder, nn.ModuleList) else 0

    def whole(self, values: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``values`` by the split block's names (its state, or its parameters' gradients)
        as the whole block's: each entry its pieces concatenated (copies, on the home
        device); entries with a piece missing from ``values`` are left out."""
        return {
            name: torch.cat([values[n].detach().to(self.home) for n in piece.names], piece.dim)
            for name, piece in self.pieces.items()
            if all(n in values for n in piece.names)
        }

    def whole_state(self) -> dict[str, Tensor]:
        """The whole block's state dict (``whole`` of this one's)."""
        return self.whole(self.state_dict())

    def load_whole(self, state: Mapping[str, Tensor]) -> None:
        """Set every piece from the whole block's ``state`` (``whole_state``'s layout)."""
        missing = sorted(set(self.pieces) - set(state))
        if missing:
            raise TensorSplitError(f"the state lacks {missing} of the split block")
        mine = self.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, piece in self.pieces.items():
                sizes = [mine[n].shape[piece.dim] for n in piece.names]
                parts = torch.split(state[name], sizes, piece.dim)
                for n, part in zip(piece.names, parts, strict=True):
                    mine[n].copy_(part)


class SplitLinear(SplitBlock):
    """A linear layer split by output features, with the parameterless layers around it
    (``before`` on the home device, ``after`` on each device: element-wise)."""

    def __init__(
        self,
        before: Sequence[nn.Module],
        linear: nn.Linear,
        after: Sequence[nn.Module],
        prefix: str,
        devices: Sequence[torch.device],
    ) -> None:
        super().__init__(devices)
        if any(True for m in after for _ in m.parameters()):
            raise TensorSplitError(
                "only parameterless layers may follow the split linear layer (they run on"
                " each device's columns)"
            )
        if linear.out_features < len(devices):
            raise TensorSplitError(
                f"a linear layer of {linear.out_features} outputs cannot be split"
                f" {len(devices)} ways; use parallelism.tensor <= {linear.out_features}"
            )
        self.before = copy.deepcopy(nn.Sequential(*before)).to(self.home)
        self.after = copy.deepcopy(nn.Sequential(*after))
        for key in self.before.state_dict():
            self.pieces[key] = Piece((f"before.{key}",))
        weight, bias = linear.weight.detach(), linear.bias
        self.columns = nn.ModuleList(
            linear_piece(weight[lo:hi], None if bias is None else bias.detach()[lo:hi], device)
            for (lo, hi), device in zip(
                cuts(linear.out_features, len(devices)), devices, strict=True
            )
        )
        count = len(devices)
        self.pieces[f"{prefix}weight"] = Piece(tuple(f"columns.{d}.weight" for d in range(count)))
        if bias is not None:
            self.pieces[f"{prefix}bias"] = Piece(tuple(f"columns.{d}.bias" for d in range(count)))

    def forward(self, x: Tensor) -> Tensor:
        h = self.before(x)
        parts = [
            self.after(column(h.to(device)))
            for column, device in zip(self.columns, self.devices, strict=True)
        ]
        return torch.cat([p.to(self.home) for p in parts], dim=-1)


class SplitTransformerLayer(SplitBlock):
    """``TransformerLayer`` split by attention heads and MLP hidden features."""

    def __init__(self, layer: TransformerLayer, devices: Sequence[torch.device]) -> None:
        super().__init__(devices)
        count, heads = len(devices), layer.n_heads
        d = layer.proj.in_features
        fc1, fc2 = layer.mlp[0], layer.mlp[2]
        if not (isinstance(fc1, nn.Linear) and isinstance(fc2, nn.Linear)):
            raise TensorSplitError("a GPT layer's MLP is two linear layers around a GELU")
        hidden = fc1.out_features
        if heads < count:
            raise TensorSplitError(
                f"a GPT layer of {heads} heads cannot be split {count} ways by heads;"
                f" use parallelism.tensor <= {heads}"
            )
        self.head_dim = d // heads
        self.ln1 = copy.deepcopy(layer.ln1).to(self.home)
        self.ln2 = copy.deepcopy(layer.ln2).to(self.home)
        self.proj_bias = nn.Parameter(layer.proj.bias.detach().to(self.home).clone())
        self.fc2_bias = nn.Parameter(fc2.bias.detach().to(self.home).clone())
        head_cuts = cuts(heads, count)
        hidden_cuts = cuts(hidden, count)
        qkv = layer.qkv.weight.detach()
        self.heads = [hi - lo for lo, hi in head_cuts]
        self.q, self.k, self.v = nn.ModuleList(), nn.ModuleList(), nn.ModuleList()
        self.proj, self.fc1, self.fc2 = nn.ModuleList(), nn.ModuleList(), nn.ModuleList()
        hd = self.head_dim
        for (lo, hi), (a, b), device in zip(head_cuts, hidden_cuts, devices, strict=True):
            rows = slice(lo * hd, hi * hd)
            for target, offset in ((self.q, 0), (self.k, d), (self.v, 2 * d)):
                target.append(linear_piece(qkv[offset:][rows], None, device))
            self.proj.append(linear_piece(layer.proj.weight.detach()[:, rows], None, device))
            self.fc1.append(linear_piece(fc1.weight.detach()[a:b], fc1.bias.detach()[a:b], device))
            self.fc2.append(linear_piece(fc2.weight.detach()[:, a:b], None, device))
        each = range(count)
        self.pieces = {
            "ln1.weight": Piece(("ln1.weight",)),
            "ln1.bias": Piece(("ln1.bias",)),
            "qkv.weight": Piece(
                tuple(f"{part}.{i}.weight" for part in ("q", "k", "v") for i in each)
            ),
            "proj.weight": Piece(tuple(f"proj.{i}.weight" for i in each), dim=1),
            "proj.bias": Piece(("proj_bias",)),
            "ln2.weight": Piece(("ln2.weight",)),
            "ln2.bias": Piece(("ln2.bias",)),
            "mlp.0.weight": Piece(tuple(f"fc1.{i}.weight" for i in each)),
            "mlp.0.bias": Piece(tuple(f"fc1.{i}.bias" for i in each)),
            "mlp.2.weight": Piece(tuple(f"fc2.{i}.weight" for i in each), dim=1),
            "mlp.2.bias": Piece(("fc2_bias",)),
        }

    def _attention(self, i: int, h: Tensor) -> Tensor:
        """Device ``i``'s heads: their attention through its columns of the projection."""
        b, t, _ = h.shape
        q, k, v = (
            part(h).view(b, t, self.heads[i], self.head_dim).transpose(1, 2)
            for part in (self.q[i], self.k[i], self.v[i])
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: Tensor = self.proj[i](attended.transpose(1, 2).reshape(b, t, -1))
        return out

    def _mlp(self, i: int, h: Tensor) -> Tensor:
        out: Tensor = self.fc2[i](F.gelu(self.fc1[i](h)))
        return out

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln1(x)
        attended = [self._attention(i, h.to(dev)) for i, dev in enumerate(self.devices)]
        x = x + (ordered_sum([a.to(self.home) for a in attended]) + self.proj_bias)
        h = self.ln2(x)
        mixed = [self._mlp(i, h.to(dev)) for i, dev in enumerate(self.devices)]
        out: Tensor = x + (ordered_sum([m.to(self.home) for m in mixed]) + self.fc2_bias)
        return out


class DeclaredSplit(Protocol):
    """A block that declares its own split (a factory's): the most devices it splits over,
    and its split over ``devices`` (2 to ``tensor_ways`` of them), a ``SplitBlock`` that
    computes what the block does, each whole parameter's pieces in ``pieces``."""

    tensor_ways: int

    def tensor_split(self, devices: Sequence[torch.device]) -> SplitBlock: ...


def splittable(module: nn.Module) -> bool:
    """Whether ``split_block`` has a split for ``module`` (GPT layers, linear blocks, blocks
    that declare one)."""
    if _declares(module):
        return _declared_ways(module) >= 2
    return split_size(module).numel > 0


@dataclass(frozen=True)
class SplitSize:
    """What ``split_block`` divides of a block: ``numel`` of its parameters (the rest stays
    whole on the first device) over at most ``ways`` devices (a GPT layer's heads, a linear
    layer's output features); both 0 where the block has no split."""

    numel: int
    ways: int


def split_size(module: nn.Module) -> SplitSize:
    """``module``'s ``SplitSize``. A declared split is counted on meta devices; one that
    cannot be made there (or says no ``tensor_ways``) counts as none, so a model's trace,
    and its jobs without ``parallelism.tensor``, do not depend on it."""
    if _declares(module):
        try:
            ways = _declared_ways(module)
            meta = [torch.device("meta")] * 2
            pieces = dict(cast(DeclaredSplit, module).tensor_split(meta).pieces) if ways > 1 else {}
        except Exception:  # the user's code: checked, with its error, where a stage splits it
            return SplitSize(0, 0)
        params = dict(module.named_parameters())
        spread = [params[k] for k, p in pieces.items() if len(p.names) > 1 and k in params]
        return SplitSize(sum(p.numel() for p in spread), ways) if spread else SplitSize(0, 0)
    if isinstance(module, TransformerLayer):
        fc1, fc2 = module.mlp[0], module.mlp[2]
        split = [*module.qkv.parameters(), *module.proj.parameters(), *fc1.parameters()]
        split += [*fc2.parameters()]
        biases = 2 * module.proj.out_features  # the projection's and fc2's: added after the sums
        numel = sum(p.numel() for p in split) - biases
        hidden = fc1.out_features if isinstance(fc1, nn.Linear) else 0  # else no split
        return SplitSize(numel, min(module.n_heads, hidden))
    found = _split_linear(module)
    if found is None:
        return SplitSize(0, 0)
    linear = found[1]
    return SplitSize(sum(p.numel() for p in linear.parameters()), linear.out_features)


def _split_linear(module: nn.Module) -> tuple[int, nn.Linear] | None:
    """The linear layer split by columns: ``module`` itself, or in an ``nn.Sequential`` its
    last, where only parameterless layers follow it (they run on each device's columns)."""
    if isinstance(module, nn.Linear):
        return 0, module
    if not isinstance(module, nn.Sequential):
        return None
    layers: list[nn.Module] = list(module)
    linears = [(i, m) for i, m in enumerate(layers) if isinstance(m, nn.Linear)]
    if not linears or any(True for m in layers[linears[-1][0] + 1 :] for _ in m.parameters()):
        return None
    return linears[-1]


def split_block(module: nn.Module, devices: Sequence[torch.device]) -> SplitBlock:
    """``module`` split over ``devices`` (its values copied; ``module`` is left as it was),
    or ``TensorSplitError`` saying why it cannot be."""
    if _declares(module):
        return _declared_split(module, devices)
    if isinstance(module, TransformerLayer):
        return SplitTransformerLayer(module, devices)
    if isinstance(module, nn.Linear):
        return SplitLinear([], module, [], "", devices)
    found = _split_linear(module)
    if found is not None:
        at, linear = found
        layers = list(module.children())
        return SplitLinear(layers[:at], linear, layers[at + 1 :], f"{at}.", devices)
    raise TensorSplitError(
        f"a block of type {type(module).__name__} has no tensor-parallel split: splits"
        " exist for GPT layers and for one linear layer with parameterless layers around it"
        " (use parallelism.tensor: 1)"
    )


def _declares(module: nn.Module) -> bool:
    """Whether ``module`` declares its own split (``DeclaredSplit``)."""
    return callable(getattr(module, "tensor_split", None))


def _declared_ways(module: nn.Module) -> int:
    ways = getattr(module, "tensor_ways", None)
    if not isinstance(ways, int) or isinstance(ways, bool):
        raise TensorSplitError(
            f"a block of type {type(module).__name__} has tensor_split but its tensor_ways is"
            f" {ways!r}: give the most devices its split goes over, an int"
        )
    return ways


def _declared_split(module: nn.Module, devices: Sequence[torch.device]) -> SplitBlock:
    """``module``'s own split, checked: a ``SplitBlock`` over ``devices`` whose pieces make
    up the block's state exactly (every entry, nothing else), each on its device."""
    kind = type(module).__name__
    ways = _declared_ways(module)
    if not 2 <= len(devices) <= ways:
        raise TensorSplitError(
            f"a block of type {kind} splits over 2 to {ways} devices, not {len(devices)};"
            f" use parallelism.tensor <= {ways}"
        )
    split = cast(DeclaredSplit, module).tensor_split(devices)
    if not isinstance(split, SplitBlock):
        raise TensorSplitError(
            f"{kind}.tensor_split returned {type(split).__name__}, not a SplitBlock"
        )
    whole = module.state_dict()
    mine = split.state_dict()
    named = [n for piece in split.pieces.values() for n in piece.names]
    wrong = sorted((set(split.pieces) ^ set(whole)) | (set(named) ^ set(mine)))
    if wrong or list(split.devices) != list(devices):
        raise TensorSplitError(
            f"{kind}.tensor_split's pieces must name every entry of the block's state dict,"
            f" each with the split's own entries that hold it, over the devices given"
            f" (wrong: {wrong[:4] or 'its devices'})"
        )
    values = split.whole_state()
    unequal = [
        k for k, v in whole.items() if values[k].shape != v.shape or not torch.equal(values[k], v)
    ]
    misplaced = [
        n for n, p in split.named_parameters() if p.device != split.devices[split.device_index(n)]
    ]
    if unequal or misplaced:
        raise TensorSplitError(
            f"{kind}.tensor_split's pieces of {unequal[:4]} do not concatenate to the block's"
            f" values, or {misplaced[:4]} are not on their device (a device's pieces in module"
            " lists indexed by device, the rest on the first)"
        )
    return split


class TensorBlock(Block):
    """``block`` split over ``devices`` (``split_block``), its optimizer over the pieces:
    a block whose state reads and loads as the whole block's (``state``, ``load``), so
    checkpoints, copies and moves do not depend on the split. Each element-wise optimizer
    entry of a whole parameter is its pieces' concatenated as the parameter is."""

    module: SplitBlock

    def __init__(self, block: Block, devices: Sequence[torch.device]) -> None:
        state = block.state() if block.optimizer.state else None
        self.whole_names = [name for name, _ in block.module.named_parameters()]
        super().__init__(block.index, split_block(block.module, devices), block.conf)
        self._names = [name for name, _ in self.module.named_parameters()]
        if state is not None:
            self.load(state)

    def _pieces(self, whole: str) -> tuple[list[int], Piece]:
        """Whole parameter ``whole``'s pieces: their indices in the optimizer, and how."""
        piece = self.module.pieces[whole]
        return [self._names.index(n) for n in piece.names], piece

    def live_state(self) -> dict[str, Any]:
        saved = self.optimizer.state_dict()
        merged: dict[int, dict[str, Any]] = {}
        for j, whole in enumerate(self.whole_names):
            indices, piece = self._pieces(whole)
            entries = [saved["state"].get(i) for i in indices]
            if any(e is None for e in entries):
                continue  # no step yet
            merged[j] = {
                key: torch.cat([e[key].to(self.module.home) for e in entries], piece.dim)
                if isinstance(first, Tensor) and first.dim() > 0
                else first
                for key, first in entries[0].items()
            }
        groups = [
            {**g, "params": list(range(len(self.whole_names)))} for g in saved["param_groups"]
        ]
        return {
            "module": self.module.whole_state(),
            "optimizer": {"state": merged, "param_groups": groups},
        }

    def _load(self, state: dict[str, Any]) -> None:
        self.module.load_whole(state["module"])
        whole = state["optimizer"]
        mine = self.module.state_dict(keep_vars=True)
        split: dict[int, dict[str, Any]] = {}
        for j, name in enumerate(self.whole_names):
            entry = whole["state"].get(j)
            if entry is None:
                continue
            indices, piece = self._pieces(name)
            sizes = [mine[n].shape[piece.dim] for n in piece.names]
            for p, i in enumerate(indices):
                split[i] = {
                    key: torch.split(value, sizes, piece.dim)[p].clone()
                    if isinstance(value, Tensor) and value.dim() > 0
                    else (value.clone() if isinstance(value, Tensor) else value)
                    for key, value in entry.items()
                }
        groups = [{**g, "params": list(range(len(self._names)))} for g in whole["param_groups"]]
        self.optimizer.load_state_dict({"state": split, "param_groups": groups})

    def to(self, device: torch.device) -> None:
        raise TensorSplitError(
            f"block {self.index} is split over {len(self.module.devices)} devices: it stays on"
            " them (load its state into a block built for the new devices)"
        )
