"""kimi_ops: Kimi-K3 decode kernels as torch.ops.kimi.* custom ops.

``pip install --no-build-isolation -e .`` needs nothing beyond torch. Set
``KIMI_OPS_BUILD_STUBS=1`` to also build the C++ schema stubs of csrc_stubs/ (loaded
first on import, when present).
"""

import os

from setuptools import find_packages, setup

ext_modules, cmdclass = [], {}
if os.environ.get("KIMI_OPS_BUILD_STUBS") == "1":
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    ext_modules = [CppExtension("kimi_ops._stubs", ["csrc_stubs/kimi_ops_stubs.cpp"])]
    cmdclass = {"build_ext": BuildExtension.with_options(no_python_abi_suffix=True)}

setup(
    name="kimi_ops",
    version="0.1.0",
    description="Kimi-K3 decode kernels (CuTe DSL) as torch.ops.kimi custom ops",
    packages=find_packages(include=["kimi_ops", "kimi_ops.*"]),
    python_requires=">=3.11",
    # numpy: torch warns "Failed to initialize NumPy" on its first tensor from Python data without it
    install_requires=["torch>=2.11,<2.15", "numpy"],
    extras_require={
        "test": ["pytest", "expecttest", "numpy", "hypothesis", "pyelftools"],
        "cute": ["nvidia-cutlass-dsl==4.8.1", "cuda-python", "apache-tvm-ffi>=0.1.15"],
        # bench_projection's peer column (--quack); ncu_hotspots --cubins' line tables
        "bench": ["quack-kernels==0.6.5", "pyelftools"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
