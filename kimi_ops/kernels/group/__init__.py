"""Multi-process groups' barrier on Hopper: the kernel (:mod:`.kernels`) and the op's
adapter (:mod:`.host`)."""

from .host import register

__all__ = ["register"]
