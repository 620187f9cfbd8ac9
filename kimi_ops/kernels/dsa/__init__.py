"""The DSA indexer on Hopper: the plan (:mod:`.plan`), the kernels (:mod:`.kernels`)
and the ops' adapters (:mod:`.host`)."""

from .host import register

__all__ = ["register"]
