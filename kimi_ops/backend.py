"""Which implementation serves a ``kimi`` op on CUDA (DESIGN §5).

``cute`` kernels register themselves in :data:`KERNELS`; an op without a kernel for the
device or shape falls back to the reference with a one-time warning, never silently.
``KIMI_OPS_BACKEND=reference`` forces the reference; ``KIMI_OPS_BACKEND=cute`` turns every
fallback into an error.
"""

import contextlib
import os
import warnings
from collections.abc import Callable
from typing import Protocol

import torch

BACKENDS = ("auto", "reference", "cute")


class Kernel(Protocol):
    def check(self, *args):
        """The op's argument checks (a clear error on bad input); run before the others."""

    def unsupported(self, *args) -> str | None:
        """Why this kernel cannot serve these (checked) arguments, or None."""

    def prepare(self, *key) -> None:
        """Compile (or load) every variant the op's shapes ``key`` need."""

    def __call__(self, *args): ...

    # optional, for an op that fuses others': ``prefers(*key) -> bool`` (:func:`prefers`);
    # for a caller that relies on the kernel's own behaviour: ``serves(*key) -> bool`` (:func:`serves`)


KERNELS: dict[str, Kernel] = {}
_warned: set[str] = set()


def selected() -> str:
    backend = os.environ.get("KIMI_OPS_BACKEND", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"KIMI_OPS_BACKEND must be one of {BACKENDS}, got {backend!r}")
    return backend


@contextlib.contextmanager
def forced(backend: str):
    """``KIMI_OPS_BACKEND=backend`` within the block (eager calls: the choice is made per call)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    before = os.environ.get("KIMI_OPS_BACKEND")
    os.environ["KIMI_OPS_BACKEND"] = backend
    try:
        yield
    finally:
        if before is None:
            del os.environ["KIMI_OPS_BACKEND"]
        else:
            os.environ["KIMI_OPS_BACKEND"] = before


def prepare(name: str, *key) -> None:
    """Compile op ``name``'s kernel for shapes ``key`` now (wrapper construction), never
    during capture; nothing to do without a kernel or under the reference backend."""
    kernel = KERNELS.get(name)
    if kernel is not None and selected() != "reference":
        kernel.prepare(*key)


def prefers(name: str, device: torch.device, *key) -> bool:
    """Whether op ``name``'s kernel is the faster form of its computation at shapes ``key``
    for tensors on ``device`` (its ``prefers``: an op that fuses others'); False without
    one, under the reference backend or off CUDA, where the ops it fuses serve alike."""
    return kernel_says(name, "prefers", device, key)


def serves(name: str, device: torch.device, *key) -> bool:
    """Whether op ``name``'s CuTe kernel serves every call of shapes ``key`` on ``device``
    (its ``serves``), for a caller whose launch order relies on how that kernel reads (a
    poll, not a plain load); False without one, under the reference backend or off CUDA."""
    return kernel_says(name, "serves", device, key)


def kernel_says(name: str, question: str, device: torch.device, key: tuple) -> bool:
    """Op ``name``'s kernel's answer to ``question`` (its method of that name) at ``key``,
    where calls on ``device`` may reach it; False where they cannot or it has no answer."""
    answer = getattr(KERNELS.get(name), question, None)
    return answer is not None and runs_kernels(device) and answer(*key)


def runs_kernels(device: torch.device) -> bool:
    """Calls on ``device`` may reach a CuTe kernel: a CUDA device, the reference backend not
    forced (a CPU decoder in a process with CUDA dispatches to the references alone)."""
    return torch.device(device).type == "cuda" and selected() != "reference"


def cuda_impl(name: str, reference: Callable) -> Callable:
    """The CUDA kernel of op ``name``: its CuTe kernel where it applies, else ``reference``."""

    def impl(*args):
        backend = selected()
        if backend == "reference":
            return reference(*args)
        kernel = KERNELS.get(name)
        if kernel is None:
            reason = "no CuTe kernel is registered"
        else:
            kernel.check(*args)  # bad input fails here, before a kernel inspects its shapes
            reason = kernel.unsupported(*args)
            if reason is None:
                return kernel(*args)
        if backend == "cute":
            raise NotImplementedError(f"kimi::{name}: KIMI_OPS_BACKEND=cute but {reason}")
        if backend == "auto" and name not in _warned:
            _warned.add(name)
            warnings.warn(f"kimi::{name}: using the reference backend on CUDA ({reason})")
        return reference(*args)

    impl.__name__ = f"{name}_cuda"
    return impl
