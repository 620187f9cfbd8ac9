"""Argument validation shared by every op: metadata only, so fakes run it too.

Each check raises :class:`KimiArgumentError` naming the op, the argument and what was
expected, before anything is written.
"""

from collections.abc import Sequence

import torch


class KimiArgumentError(ValueError):
    """An op argument has the wrong dtype, shape, device, layout or value."""


def fail(op: str, name: str, expected: str, got: object) -> None:
    raise KimiArgumentError(f"kimi::{op}: argument '{name}' must be {expected}, got {got}")


def check_tensor(
    op: str,
    name: str,
    tensor: torch.Tensor,
    dtype: torch.dtype | Sequence[torch.dtype],
    shape: Sequence[int | None],
) -> None:
    """dtype (one or a choice), exact rank, sizes (``None``: any) and a contiguous layout."""
    if not isinstance(tensor, torch.Tensor):
        fail(op, name, "a Tensor", type(tensor).__name__)
    dtypes = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
    if tensor.dtype not in dtypes:
        fail(op, name, " or ".join(str(d) for d in dtypes), tensor.dtype)
    if tensor.dim() != len(shape) or any(
        want is not None and got != want for got, want in zip(tensor.shape, shape)
    ):
        wanted = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        fail(op, name, f"of shape {wanted}", list(tensor.shape))
    if not tensor.is_contiguous():
        fail(op, name, "contiguous", f"strides {tensor.stride()}")


def check_same_device(op: str, **tensors: torch.Tensor | None) -> None:
    """Every given tensor on the device of the first one."""
    named = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = named[0]
    for name, tensor in named[1:]:
        if tensor.device != first.device:
            fail(op, name, f"on {first.device} (the device of '{first_name}')", tensor.device)


def check_range(op: str, name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        fail(op, name, f"in [{low}, {high}]", value)
