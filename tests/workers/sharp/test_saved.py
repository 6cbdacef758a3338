"""A shard's saved tensors while its graph waits for the backward (``workers.sharp.saved``)."""

from __future__ import annotations

import pytest
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


def test_a_storage_saved_twice_is_held_once() -> None:
    """``b * b`` saves ``b`` twice: the device holds it once, and so does the count."""
    a = torch.randn(256, 256, requires_grad=True)
    saves = MovableSaves(list)
    with saves.hooks():
        b = a.exp()  # saves its result, b
        loss = (b * b).sum()  # saves b twice more
    assert saves.held() == b.untyped_storage().nbytes()
    loss.backward()  # type: ignore[no-untyped-call]
    assert a.grad is not None and torch.allclose(a.grad, 2 * b.detach() * b.detach())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_saved_tensors_sharing_a_storage_move_once_and_a_kept_input_stays() -> None:
    """``b`` is saved three times (by ``exp`` and twice by ``b * b``), ``c`` once and the
    input ``a``, which the micro-batch keeps on the device anyway, once: a demotion frees
    ``b`` and ``c`` once each and leaves ``a``, a promotion brings back one copy of each,
    and the backward is the same (moved one saved tensor at a time, ``b`` came back three
    times and ``a`` a second time: 5 storages for 3)."""
    device = torch.device("cuda", 0)
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    one = 1024 * 1024 * 4  # bytes of each 1024 x 1024 float32 tensor
    a = torch.randn(1024, 1024, device=device, requires_grad=True)
    saves = MovableSaves(list, lambda: [a])
    with saves.hooks():
        b = a.exp()
        c = b * b
        d = (c * a).sum()
    del b, c
    assert saves.held() == 3 * one

    def allocated() -> int:
        torch.cuda.synchronize(device)
        torch.empty(1, device=device)  # frees what waited for the side stream's copies
        return int(torch.cuda.memory_allocated(device))

    before = allocated()
    saves.to(torch.device("cpu"), stream=side)
    assert before - allocated() == 2 * one
    saves.to(device, stream=side)
    torch.cuda.current_stream(device).wait_stream(side)
    assert allocated() - before == 0
    d.backward()  # type: ignore[no-untyped-call]
    expected = a.detach().clone().requires_grad_()
    (expected.exp() * expected.exp() * expected).sum().backward()  # type: ignore[no-untyped-call]
    assert a.grad is not None and expected.grad is not None
    assert torch.allclose(a.grad, expected.grad, rtol=1e-5)
