"""A shard's saved tensors while its graph waits for the backward (``workers.sharp.saved``)."""

from __future__ import annotations

import torch
from torch import nn

from shoal.workers.sharp.saved import MovableSaves


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _moved_between(model: nn.Module, saves: MovableSaves | None) -> list[torch.Tensor]:
    """Forward, then every parameter 'moves' (new storage; the old one is wiped, as a
    demotion frees it), then backward: the gradients."""
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    if saves is None:
        loss = model(x).square().sum()
    else:
        with saves.hooks():
            loss = model(x).square().sum()
    for param in model.parameters():
        old = param.data
        param.data = old.clone()
        old.zero_()
    loss.backward()
    return _grads(model)


def test_saved_parameters_are_read_back_from_where_the_parameter_is_now() -> None:
    reference = _model()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    reference(x).square().sum().backward()
    expected = _grads(reference)

    model = _model()
    got = _moved_between(model, MovableSaves(model.parameters))
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))

    # Plain autograd keeps the old storage: the same move gives other gradients.
    plain = _moved_between(_model(), None)
    assert not all(torch.equal(g, e) for g, e in zip(plain, expected, strict=True))


def test_saved_activations_are_held_until_their_backward_and_move_with_the_shard() -> None:
    model = _model()
    saves = MovableSaves(model.parameters)
    x = torch.randn(4, 6)
    with saves.hooks():
        loss = model(x).square().sum()
    held = saves.held()
    assert held >= x.numel() * x.element_size()  # at least the first layer's input
    saves.to(torch.device("cpu"))
    assert saves.held() == held
    loss.backward()
    del loss
    assert saves.held() == 0
