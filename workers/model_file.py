"""A job's model as one file in single-process layout, for use outside Shoal.

The file holds the parameters and buffers of every block of a checkpoint, named
``{block}.{name}`` as the state dict of an ``nn.Sequential`` of the blocks names them
(``workers.zoo.models.build_model`` builds that model), in safetensors format: plain
tensors, no pickled code, loadable with ``safetensors.torch.load_file``. The optimizer's
state stays in the checkpoint. The file's metadata says what it is: the format, the job,
the step, and the model and data sections the job was submitted with.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from torch import Tensor

FORMAT = "shoal-model/1"
"""The metadata's ``format``: block-keyed names, a job's spec sections alongside."""


def model_tensors(blocks: Mapping[int, Mapping[str, Any]]) -> dict[str, Tensor]:
    """The modules' tensors of checkpoint block states (index -> ``Block.state()``), keyed
    ``{block}.{name}``, each with memory of its own (safetensors stores no shared tensors)."""
    tensors: dict[str, Tensor] = {}
    seen: set[int] = set()
    for index in sorted(blocks):
        for name, tensor in blocks[index]["module"].items():
            storage = tensor.untyped_storage().data_ptr()
            own = tensor.clone() if storage in seen else tensor
            seen.add(storage)
            tensors[f"{index}.{name}"] = own.contiguous()
    return tensors


def write_model_file(
    path: str | os.PathLike[str],
    blocks: Mapping[int, Mapping[str, Any]],
    *,
    job_id: str,
    step: int,
    model: Mapping[str, Any],
    data: Mapping[str, Any],
) -> None:
    """Write the model of ``blocks`` (a checkpoint of ``job_id`` at ``step``) to ``path``;
    ``model`` and ``data`` are the job's spec sections, kept in the metadata as JSON."""
    from safetensors.torch import save_file  # only where models are exported

    metadata = {
        "format": FORMAT,
        "job_id": job_id,
        "step": str(step),
        "model": json.dumps(dict(model), sort_keys=True),
        "data": json.dumps(dict(data), sort_keys=True),
    }
    save_file(model_tensors(blocks), os.fspath(path), metadata=metadata)
