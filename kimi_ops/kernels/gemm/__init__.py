"""The decode-GEMM engine on Hopper: its plan (:mod:`.plan`), the kernel under its
epilogues (:mod:`.engine`) and the ops' adapters (:mod:`.host`): ``kimi::oproj``,
``kimi::moe_front``, ``kimi::oproj_publish`` and ``kimi::moe_front_publish``; the DSA
front (:mod:`kimi_ops.kernels.dsa`) runs the same engine under its own epilogue."""

from .host import register

__all__ = ["register"]
