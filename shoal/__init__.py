"""Shoal from Python: submit jobs and sweeps, follow them, take the trained model out.

::

    import shoal

    client = shoal.Client()  # SHOAL_URL and SHOAL_TOKEN, else what `shoal up` wrote
    job = client.submit("examples/mlp-digits.yaml")  # a spec file, or the spec as a dict
    job.wait()  # the job once it has ended
    print(job.metrics()[-1]["loss"])
    job.export("model.safetensors")  # docs/user-guide.md loads it in plain PyTorch

    sweep = client.sweep("examples/sweep-digits.yaml")
    print(sweep.wait()["state"], sweep.best_trial())

Every refusal or unreachable server is a ``shoal.ApiError`` with the message the CLI shows
(``status`` is the HTTP status, None when Shoal did not answer); reads and submissions are
retried as the CLI retries them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shoal.client import Client, Job, Sweep
    from shoal.service.client import ApiError

__all__ = ["ApiError", "Client", "Job", "Sweep"]


def __getattr__(name: str) -> object:
    """The client, imported on first use: the parts under ``shoal`` (``shoal.workers`` in a
    Ray worker, ``shoal.service`` in the control plane) load without it."""
    if name == "ApiError":
        from shoal.service.client import ApiError

        return ApiError
    if name in ("Client", "Job", "Sweep"):
        from shoal import client

        return getattr(client, name)
    raise AttributeError(f"module 'shoal' has no attribute {name!r}")
