"""Routing and situ on Hopper: the kernels (:mod:`.kernels`) and the ops' adapters
(:mod:`.host`)."""

from .host import register

__all__ = ["register"]
