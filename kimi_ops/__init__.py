"""kimi_ops: Kimi-K3 decode kernels as ``torch.ops.kimi.*`` custom ops.

Importing the package registers the ops. If the optional C++ stub library was built
(``KIMI_OPS_BUILD_STUBS=1 pip install -e .``), it is loaded first and declares the
schemas; the Python side then attaches its kernels to those declarations.
"""

import glob
import os

import torch

from . import registry
from .checks import KimiArgumentError
from .registry import load_stub_library
from .schemas import SCHEMAS

for _stub in glob.glob(os.path.join(os.path.dirname(__file__), "_stubs*.so")):
    torch.ops.load_library(_stub)
registry.register()
if torch.cuda.is_available():  # CuTe kernels under the CUDA dispatch, where CuTe DSL is installed
    from . import kernels

    kernels.register()

from .config import KimiConfig  # noqa: E402  (after registration: they call the ops)
from .mailbox import KimiMailboxError  # noqa: E402
from .runtime.decoder import KimiDecoder  # noqa: E402

__all__ = [
    "SCHEMAS", "KimiArgumentError", "KimiConfig", "KimiDecoder", "KimiMailboxError",
    "load_stub_library", "registry",
]
