"""The block: the unit of state (DESIGN invariant 2).

A block is one link of a model's chain together with its own optimizer: moving, spilling,
checkpointing and restoring a model are all "move these blocks". One optimizer per block
gives the same updates as one optimizer over the whole model because SGD, Adam and AdamW
are element-wise; a global operation (gradient-norm clipping) is an explicit reduction
across stages, which is the engine's business, not the block's (``workers.pipeline.clipping``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from shoal.workers.snapshot import OptimizerConf

_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}
_RESERVED = frozenset({"lr", "params"})


def make_optimizer(conf: OptimizerConf, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer ``conf`` names over ``params``; a bad conf is a ValueError naming its field."""
    kind = _OPTIMIZERS.get(conf.name)
    if kind is None:
        raise ValueError(
            f"optimizer.name: unknown optimizer {conf.name!r}; choose one of {sorted(_OPTIMIZERS)}"
        )
    reserved = sorted(_RESERVED & set(conf.params))
    if reserved:
        raise ValueError(
            f"optimizer.params.{reserved[0]}: set the learning rate as optimizer.lr, and"
            " leave the parameters to Shoal"
        )
    # torch refuses an empty parameter list, but a block may have none (an activation alone):
    # an empty group gives it an optimizer whose step does nothing.
    groups: list[Any] = list(params) or [{"params": []}]
    try:
        return kind(groups, lr=conf.lr, **conf.params)
    except TypeError as exc:
        raise ValueError(
            f"optimizer.params: {conf.name} does not accept these arguments ({exc});"
            f" see torch.optim.{kind.__name__}"
        ) from None
    except ValueError as exc:
        field = "optimizer.lr" if "learning rate" in str(exc) else "optimizer.params"
        raise ValueError(f"{field}: {exc}") from None


def map_tensors(value: Any, each: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` (nested dicts, lists and tuples, such as a block's state) with ``each``
    applied to every tensor, containers rebuilt."""
    if isinstance(value, torch.Tensor):
        return each(value)
    if isinstance(value, dict):
        return {k: map_tensors(v, each) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(map_tensors(v, each) for v in value)
    return value


def _detached_copy(value: Any) -> Any:
    """``value`` with every tensor detached and copied to the CPU, containers rebuilt."""
    return map_tensors(value, lambda t: t.detach().to("cpu", copy=True))


def tensors_in(value: Any) -> Iterable[torch.Tensor]:
    """Every tensor in ``value`` (nested dicts, lists and tuples, such as a block's state)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from tensors_in(v)


class Block:
    """Block ``index`` of a model: its module, and ``optimizer`` (built from ``conf``) over it."""

    def __init__(self, index: int, module: nn.Module, optimizer: OptimizerConf):
        self.index = index
        self.module = module
        self.conf = optimizer
        self.optimizer = make_optimizer(optimizer, module.parameters())

    def step(self) -> None:
        """Apply the accumulated gradients once, then drop them."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state(self) -> dict[str, Any]:
        """Parameters, buffers and optimizer state: detached CPU copies, safe to pickle and ship."""
        state: dict[str, Any] = _detached_copy(self.live_state())
        return state

    def live_state(self) -> dict[str, Any]:
        """``state``'s layout holding the live tensors themselves (detached), not copies:
        what a copy made later reads (``workers.pipeline.copier``)."""
        return {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load(self, state: dict[str, Any]) -> None:
        """Restore a ``state()`` onto the module's current device."""
        try:
            self._load(state)
        except (KeyError, RuntimeError, ValueError) as exc:
            raise ValueError(
                f"block {self.index}: the state does not fit this block ({exc}); was it saved"
                " from the same model config and optimizer?"
            ) from exc

    def _load(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        # load_state_dict keeps the caller's tensors when they are already on the right
        # device; a private copy keeps in-place updates out of the caller's state.
        self.optimizer.load_state_dict(_detached_copy(state["optimizer"]))

    def to(self, device: torch.device) -> None:
        """Move the parameters, buffers and optimizer state to ``device``.

        The optimizer is rebuilt: a move may give the module new parameter objects (it does
        for some device pairs), which the old optimizer would not know.
        """
        saved = self.optimizer.state_dict()
        self.module.to(device)
        self.optimizer = make_optimizer(self.conf, self.module.parameters())
        # Loading re-places every optimizer tensor by torch's own rules: next to its
        # parameter, except Adam's step counter, which stays on the CPU unless capturable.
        self.optimizer.load_state_dict(saved)

    def nbytes(self) -> int:
        """Bytes of the parameters, buffers and optimizer state."""
        tensors = [*self.module.parameters(), *self.module.buffers()]
        tensors.extend(tensors_in(self.optimizer.state))
        return sum(t.numel() * t.element_size() for t in tensors)
