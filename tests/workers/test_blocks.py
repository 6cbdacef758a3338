"""Blocks: one optimizer each, exact against one optimizer overall; state that round-trips."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from shoal.workers.blocks import Block, make_optimizer
from shoal.workers.snapshot import OptimizerConf

pytestmark = pytest.mark.unit

OPTIMIZERS = [
    OptimizerConf("sgd", 0.1, {"momentum": 0.9, "weight_decay": 1e-3}),
    OptimizerConf("adam", 0.01),
    OptimizerConf("adamw", 0.01, {"betas": (0.8, 0.95), "weight_decay": 0.1}),
]


def chain() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(4, 8), nn.Sequential(nn.Tanh(), nn.Linear(8, 8)), nn.Tanh(), nn.Linear(8, 1)]


def train(blocks: list[Block], steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 4, generator=g)
        for block in blocks:
            x = block.module(x)
        x.pow(2).mean().backward()
        for block in blocks:
            block.step()


def weights(blocks: list[Block]) -> list[torch.Tensor]:
    return [p.detach() for block in blocks for p in block.module.parameters()]


@pytest.mark.parametrize("conf", OPTIMIZERS, ids=lambda c: c.name)
def test_one_optimizer_per_block_equals_one_optimizer_overall(conf: OptimizerConf) -> None:
    blocks = [Block(i, m, conf) for i, m in enumerate(chain())]
    train(blocks, steps=5)

    modules = chain()
    whole = make_optimizer(conf, [p for m in modules for p in m.parameters()])
    for step in range(5):
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
        for module in modules:
            x = module(x)
        x.pow(2).mean().backward()
        whole.step()
        whole.zero_grad()
    expected = [p.detach() for m in modules for p in m.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(weights(blocks), expected, strict=True))


def test_step_applies_then_drops_the_gradients() -> None:
    block = Block(0, nn.Linear(2, 1), OptimizerConf("sgd", 1.0))
    before = block.module.weight.detach().clone()
    block.module(torch.ones(1, 2)).sum().backward()
    block.step()
    assert torch.equal(block.module.weight.detach(), before - 1.0)
    assert all(p.grad is None for p in block.module.parameters())


def test_a_block_without_parameters_steps_as_a_no_op() -> None:
    block = Block(2, nn.Tanh(), OptimizerConf("adam", 0.1))
    block.step()
    assert block.nbytes() == 0
    assert block.state()["module"] == {}


@pytest.mark.parametrize("conf", OPTIMIZERS, ids=lambda c: c.name)
def test_state_round_trip_resumes_exactly(conf: OptimizerConf) -> None:
    uninterrupted = [Block(i, m, conf) for i, m in enumerate(chain())]
    train(uninterrupted, steps=6)

    first = [Block(i, m, conf) for i, m in enumerate(chain())]
    train(first, steps=3)
    shipped = pickle.loads(pickle.dumps([b.state() for b in first]))
    resumed = [Block(i, m, conf) for i, m in enumerate(chain())]
    for block, state in zip(resumed, shipped, strict=True):
        block.load(state)
    train(resumed, steps=3, start=3)
    assert all(
        torch.equal(a, b) for a, b in zip(weights(resumed), weights(uninterrupted), strict=True)
    )


def test_state_is_a_detached_copy() -> None:
    block = Block(0, nn.Linear(3, 3), OptimizerConf("adam", 0.1))
    block.module(torch.ones(1, 3)).sum().backward()
    block.step()
    state = block.state()
    saved = copy.deepcopy(state)
    block.module(torch.ones(1, 3)).sum().backward()
    block.step()  # later training must not reach into a shipped state
    assert torch.equal(state["module"]["weight"], saved["module"]["weight"])
    assert torch.equal(
        state["optimizer"]["state"][0]["exp_avg"], saved["optimizer"]["state"][0]["exp_avg"]
    )
    assert not state["module"]["weight"].requires_grad


def test_loading_does_not_share_tensors_with_the_caller() -> None:
    source = Block(0, nn.Linear(3, 3), OptimizerConf("adam", 0.1))
    source.module(torch.ones(1, 3)).sum().backward()
    source.step()
    state = source.state()
    saved = copy.deepcopy(state)
    target = Block(0, nn.Linear(3, 3), OptimizerConf("adam", 0.1))
    target.load(state)
    target.module(torch.ones(1, 3)).sum().backward()
    target.step()
    assert torch.equal(
        state["optimizer"]["state"][0]["exp_avg"], saved["optimizer"]["state"][0]["exp_avg"]
    )
    assert torch.equal(state["module"]["bias"], saved["module"]["bias"])


def test_a_state_from_another_block_is_refused_with_its_index() -> None:
    block = Block(5, nn.Linear(3, 3), OptimizerConf("sgd", 0.1))
    wrong = Block(5, nn.Linear(3, 4), OptimizerConf("sgd", 0.1)).state()
    with pytest.raises(ValueError, match="block 5: the state does not fit"):
        block.load(wrong)
    with pytest.raises(ValueError, match="block 5"):
        block.load({"module": block.state()["module"]})


def test_nbytes_counts_parameters_and_optimizer_state() -> None:
    block = Block(0, nn.Linear(10, 10), OptimizerConf("adam", 0.1))
    params = 110 * 4
    assert block.nbytes() == params
    block.module(torch.ones(1, 10)).sum().backward()
    block.step()
    # Adam keeps two moments per parameter and one step counter per tensor.
    step_counters = sum(
        t.element_size() for s in block.optimizer.state.values() for t in [s["step"]]
    )
    assert block.nbytes() == 3 * params + step_counters


def test_to_moves_parameters_and_optimizer_state() -> None:
    block = Block(0, nn.Linear(3, 3), OptimizerConf("sgd", 0.1, {"momentum": 0.9}))
    block.module(torch.ones(1, 3)).sum().backward()
    block.step()
    block.to(torch.device("meta"))  # a move that gives the module new parameter objects
    assert block.module.weight.device.type == "meta"
    buffers = [s["momentum_buffer"] for s in block.optimizer.state.values()]
    assert len(buffers) == 2 and all(b.device.type == "meta" for b in buffers)


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("conf", OPTIMIZERS, ids=lambda c: c.name)
def test_training_continues_after_a_move(conf: OptimizerConf, device: str) -> None:
    stay = [Block(i, m, conf) for i, m in enumerate(chain())]
    train(stay, steps=4)
    travel = [Block(i, m, conf) for i, m in enumerate(chain())]
    train(travel, steps=2)
    for block in travel:
        block.to(torch.device(device))
        block.to(torch.device("cpu"))
    train(travel, steps=2, start=2)
    assert all(torch.equal(a, b) for a, b in zip(weights(travel), weights(stay), strict=True))


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        (OptimizerConf("lion", 0.1), r"optimizer\.name: unknown optimizer 'lion'"),
        (OptimizerConf("sgd", 0.1, {"lr": 0.2}), r"optimizer\.params\.lr: set the learning"),
        (OptimizerConf("adam", 0.1, {"momentum": 0.9}), r"optimizer\.params: adam does not"),
        (OptimizerConf("adam", -1.0), r"optimizer\.lr: Invalid learning rate"),
        (OptimizerConf("adam", 0.1, {"betas": (2.0, 0.9)}), r"optimizer\.params: Invalid beta"),
    ],
)
def test_bad_optimizer_confs_name_the_field(conf: OptimizerConf, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_optimizer(conf, nn.Linear(2, 2).parameters())
