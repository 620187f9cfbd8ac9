"""A call's variant, chosen once: every kernel adapter's ``prepare``, ``unsupported`` and
call derive from one function of the call's shape that returns a :class:`Variant` (its
plan, its compiled kernels in launch order and their arguments), or raises
:class:`Unsupported` with the reason no kernel takes the shape."""

import functools
from collections.abc import Callable
from typing import NamedTuple


class Unsupported(ValueError):
    """No kernel of the family takes this call shape; the message says why (the op then
    runs the reference, with the backend's one-time warning)."""


class Variant(NamedTuple):
    """``plan``: the family's plan of the shape (None where it has none); ``kernels()``: the
    compiled kernels in launch order (compiled or loaded on first use: ``prepare`` calls
    it, a capture only finds them); ``arguments(*call)``: each kernel's arguments from the
    call's."""

    plan: object
    kernels: Callable[[], tuple]
    arguments: Callable[..., tuple]

    def launches(self, *call) -> list:
        """The kernels as calls on ``call``'s arguments."""
        return [functools.partial(kernel, *args) for kernel, args in zip(self.kernels(), self.arguments(*call))]

    def run(self, *call) -> None:
        for launch in self.launches(*call):
            launch()


def single(kernel: Callable[[], object], plan: object = None) -> Variant:
    """The variant of one kernel (``kernel()`` compiles or loads it) that takes the
    adapter's arguments as they come."""
    return Variant(plan, lambda: (kernel(),), lambda *call: (call,))


def reason(choose: Callable[[], Variant]) -> str | None:
    """Why ``choose()`` finds no variant, or None: an adapter's ``unsupported``."""
    try:
        choose()
    except Unsupported as why:
        return str(why)
    return None


def prepare_all(choices) -> None:
    """Compile every variant of ``choices`` (callables returning a Variant) that a kernel
    takes; the unsupported ones run the reference, nothing to compile."""
    for choose in choices:
        try:
            variant = choose()
        except Unsupported:
            continue
        variant.kernels()
