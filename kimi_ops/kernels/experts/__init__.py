"""The routed experts (the stand-in) on Hopper: the plan (:mod:`.plan`), the kernel
(:mod:`.kernels`) and the op's adapter (:mod:`.host`)."""

from .host import register

__all__ = ["register"]
