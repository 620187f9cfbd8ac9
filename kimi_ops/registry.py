"""Attach the ``kimi`` ops to the dispatcher.

The schemas come from :mod:`kimi_ops.schemas`. If the C++ stub library
(``csrc_stubs/``) was loaded first, its ``TORCH_LIBRARY(kimi, m)`` declared them and we
only attach implementations and fakes (after checking the declared schemas equal the
table); otherwise we define them here. ``Library.define``/``impl`` keep the call path to
the plain reference function on CPU (see ``benchmarks/bench_dispatch.py``).
"""

import torch
from torch.library import Library

from .backend import cuda_impl
from .ops import OPS
from .schemas import NAMESPACE, SCHEMAS

_libraries: list[Library] = []
defined_by: str = ""  # "python" or "c++": who declared the schemas


def declared_schema(name: str) -> str | None:
    """The dispatcher's schema of ``kimi::name``, or None if it is not declared."""
    try:
        return str(getattr(getattr(torch.ops, NAMESPACE), name).default._schema)
    except (AttributeError, RuntimeError):
        return None


def register() -> None:
    """Define (or attach to) every op of the schema table, then its CPU, CUDA and fake kernels."""
    global defined_by
    declared = {name: declared_schema(name) for name in SCHEMAS}
    if all(schema is None for schema in declared.values()):
        definitions = Library(NAMESPACE, "DEF")
        for schema in SCHEMAS.values():
            definitions.define(schema)
        defined_by = "python"
    else:
        for name, schema in declared.items():
            if schema != f"{NAMESPACE}::{SCHEMAS[name]}":
                raise RuntimeError(
                    f"{NAMESPACE}::{name} is declared as {schema!r}, but kimi_ops expects "
                    f"{SCHEMAS[name]!r}: rebuild csrc_stubs (python -m kimi_ops.stubs)"
                )
        definitions = Library(NAMESPACE, "FRAGMENT")
        defined_by = "c++"
    for name, (reference, fake) in OPS.items():
        definitions.impl(name, reference, "CPU")
        definitions.impl(name, cuda_impl(name, reference), "CUDA")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=definitions)
    _libraries.append(definitions)


def load_stub_library(path: str) -> None:
    """Load the C++ stub library after ``kimi_ops`` was imported: drop the Python
    definitions, let the stub declare the schemas, and attach our kernels to them."""
    while _libraries:
        _libraries.pop()._destroy()
    torch.ops.load_library(path)
    register()
