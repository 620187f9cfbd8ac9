"""CuTe DSL kernels (Hopper first). Importing this package needs ``nvidia-cutlass-dsl``;
:func:`register` puts the kernels under the ``kimi`` ops' CUDA dispatch."""


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
