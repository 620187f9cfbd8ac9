"""CuTe DSL kernels (Hopper first). Importing its modules needs ``nvidia-cutlass-dsl``
(this one does not); :func:`register` puts the kernels under the ``kimi`` ops' CUDA
dispatch."""

import os
import pathlib
import tempfile


def cache_root() -> pathlib.Path:
    """Where compiled kernels are cached: ``$KIMI_OPS_CACHE_DIR``, else the temp dir's
    ``kimi_ops_cache`` (one folder below it per kernel-source fingerprint)."""
    return pathlib.Path(os.environ.get("KIMI_OPS_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "kimi_ops_cache"))


def register() -> bool:
    """Register every kernel family's ops in :data:`kimi_ops.backend.KERNELS`; False if
    CuTe DSL is not installed."""
    try:
        from . import attn_res, dsa, experts, gemm, group, route, tail
    except ImportError:
        return False
    attn_res.register()
    dsa.register()
    experts.register()
    gemm.register()
    group.register()
    route.register()
    tail.register()
    return True
