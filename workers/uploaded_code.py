"""A job's uploaded code on the workers: shipped by Ray, imported only there, under limits.

The control plane keeps a job's code as a zip archive (``service.code_store``) and never
imports it. Ray ships it: an actor or task started with ``code_options(code)`` runs in a
worker process whose working directory is the archive unpacked on its node (Ray's
``runtime_env`` ``working_dir``, first on its import path), and the actors it starts inherit
that. There ``code:module:function`` factories import the code's modules
(``workers.factories``); ``is_uploaded`` tells them a module came from the code, not from
an installed package.

Before a job with code is accepted, its model is built and traced by ``call_with_code``: a
fresh Ray worker process (one call, then it exits) with the code, a memory limit on what the
call allocates and a time limit on the whole, so a spec's check can neither run code in the
API's process nor hold it.
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

T = TypeVar("T")

CODE_ENV_VAR = "SHOAL_CODE_DIGEST"
"""Set in the processes Ray starts with a job's code: the code's digest."""
CODE_ROOT_VAR = "SHOAL_CODE_ROOT"
"""Where the code is, if not the working directory (``local_code``)."""


class CodeRunFailed(RuntimeError):
    """A call with uploaded code failed outside the call itself (its worker crashed or ran out
    of time or memory, or Ray could not ship the code); the message says which."""


@dataclass(frozen=True)
class JobCode:
    """A job's uploaded code: its digest and its archive on the control plane's host."""

    digest: str
    archive: str

    def ship(self) -> dict[str, Any]:
        """Upload the archive to the Ray cluster's store (GCS) and return the ``runtime_env``
        that makes it the working directory of the processes it starts (and theirs), marked
        with the digest. Call it in the process that starts them (a Ray driver).

        Ray takes a local archive only for a whole Ray job (``ray.init``); per actor or
        task it takes a URI, so the archive is put where Ray's own ``ray.init`` puts one,
        through the same (private, Ray 2.60-pinned) call. Uploaded at every start: Ray
        drops a package no live process refers to, and putting it again is cheap.
        """
        from ray._private.runtime_env.packaging import upload_package_to_gcs

        uri = f"gcs://_ray_pkg_shoal_{self.digest.removeprefix('sha256:')}.zip"
        upload_package_to_gcs(uri, Path(self.archive).read_bytes())
        return {"working_dir": uri, "env_vars": {CODE_ENV_VAR: self.digest}}


def code_options(code: JobCode | None) -> dict[str, Any]:
    """Ray actor options that give an actor (and what it starts) the job's code, if any
    (shipping it: ``JobCode.ship``)."""
    return {} if code is None else {"runtime_env": code.ship()}


def is_uploaded(module: ModuleType) -> bool:
    """Whether ``module`` was imported from the job's uploaded code: this process was
    started with code and the module's file lies in its working directory."""
    origin = getattr(module, "__file__", None)
    if not os.environ.get(CODE_ENV_VAR) or origin is None:
        return False
    root = os.environ.get(CODE_ROOT_VAR) or os.getcwd()
    return Path(origin).resolve().is_relative_to(Path(root).resolve())


@contextmanager
def local_code(folder: str | Path) -> Iterator[None]:
    """The code in ``folder`` importable by ``code:`` factories in this process, as on the
    workers: to build a model of uploaded code where it was written
    (``workers.zoo.whole.build_model``). Its modules are forgotten after, so that another
    folder's modules of the same names can be loaded next."""
    root = str(Path(folder).resolve())
    saved = {name: os.environ.get(name) for name in (CODE_ENV_VAR, CODE_ROOT_VAR)}
    os.environ.update({CODE_ENV_VAR: "local", CODE_ROOT_VAR: root})
    sys.path.insert(0, root)
    try:
        yield
    finally:
        sys.path.remove(root)
        for name, module in list(sys.modules.items()):
            if is_uploaded(module):
                del sys.modules[name]
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def call_with_code(
    check: Callable[..., T],
    args: tuple[Any, ...],
    code: JobCode,
    *,
    timeout_s: float,
    memory_bytes: int,
) -> T:
    """``check(*args)`` in a fresh Ray worker process with the code importable, allowed
    ``memory_bytes`` more than the process holds when the call starts and ``timeout_s`` in
    all (shipping the code and starting the process included). What ``check`` raises is
    raised here if it can be; ``CodeRunFailed`` otherwise."""
    import ray
    from ray.exceptions import GetTimeoutError, RayError, RayTaskError

    remote: Any = ray.remote(max_calls=1, max_retries=0, num_cpus=1)(_limited)
    try:
        options = code_options(code)
    except (OSError, RuntimeError, ValueError) as exc:  # the archive gone; Ray: size, GCS
        raise CodeRunFailed(f"the code could not be shipped to the Ray cluster: {exc}") from None
    try:
        ref = remote.options(**options).remote(check, args, memory_bytes)
        return ray.get(ref, timeout=timeout_s)  # type: ignore[no-any-return]
    except GetTimeoutError:
        ray.cancel(ref, force=True)
        raise CodeRunFailed(
            f"checking the code took over {timeout_s:g} s (SHOAL_CODE_CHECK_TIMEOUT_S): does"
            " building the model or its data do more than build them?"
        ) from None
    except RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, Exception) and not isinstance(cause, RayError):
            raise cause from None
        raise CodeRunFailed(f"checking the code failed: {_last_line(exc)}") from None
    except RayError as exc:
        raise CodeRunFailed(
            f"checking the code failed in its Ray worker: {_last_line(exc)}"
        ) from None


def _limited(check: Callable[..., T], args: tuple[Any, ...], memory_bytes: int) -> T:
    """Run in the Ray worker: cap the address space, then call. A process that allocates
    past the cap gets MemoryError (torch: an allocation error) instead of taking the node's
    memory; the process ends after this one call (``max_calls=1``), cap and all."""
    # The libraries every worker maps are not the call's: torch is loaded before the cap.
    import torch  # noqa: F401

    page = os.sysconf("SC_PAGE_SIZE")
    held = int(Path("/proc/self/statm").read_text().split()[0]) * page
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = held + memory_bytes
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    return check(*args)


def _last_line(exc: BaseException) -> str:
    """A Ray error's last line: what the exception at the end of its traceback said."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
