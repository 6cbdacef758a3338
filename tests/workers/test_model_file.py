"""The exported model file: block-keyed names, tied tensors stored apart, metadata."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from shoal.workers.model_file import FORMAT, model_tensors, write_model_file
from shoal.workers.zoo.whole import build_model

MODEL = {"builtin": "mlp", "config": {"hidden": 16, "layers": 2}}
DATA = {"builtin": "synthetic-regression", "config": {"features": 8, "outputs": 2}}


@pytest.mark.unit
def test_names_are_those_of_the_blocks_in_one_sequential(tmp_path: Path) -> None:
    model = build_model(MODEL, DATA, seed=3)
    blocks = {i: {"module": block.state_dict(), "optimizer": {}} for i, block in enumerate(model)}
    path = tmp_path / "m.safetensors"
    write_model_file(path, blocks, job_id="j1", step=5, model=MODEL, data=DATA)
    loaded = load_file(path)
    assert sorted(loaded) == sorted(model.state_dict())
    fresh = build_model(MODEL, DATA, seed=4)
    fresh.load_state_dict(loaded)
    pairs = zip(fresh.parameters(), model.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    with safe_open(str(path), framework="pt") as file:
        meta = file.metadata()
    assert (meta["format"], meta["job_id"], meta["step"]) == (FORMAT, "j1", "5")
    assert json.loads(meta["model"]) == MODEL and json.loads(meta["data"]) == DATA


@pytest.mark.unit
def test_tensors_sharing_memory_are_stored_each_whole(tmp_path: Path) -> None:
    weight = torch.arange(6.0).reshape(2, 3)
    blocks = {0: {"module": {"embed": weight}}, 1: {"module": {"head": weight, "bias": weight[0]}}}
    tensors = model_tensors(blocks)
    assert tensors["0.embed"].data_ptr() != tensors["1.head"].data_ptr()
    path = tmp_path / "tied.safetensors"
    write_model_file(path, blocks, job_id="j", step=0, model=MODEL, data=DATA)
    loaded = load_file(path)
    assert torch.equal(loaded["1.head"], weight) and torch.equal(loaded["1.bias"], weight[0])
