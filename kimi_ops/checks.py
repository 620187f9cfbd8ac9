"""Argument validation shared by every op: metadata only, so fakes run it too.

Each check raises :class:`KimiArgumentError` naming the op, the argument and what was
expected, before anything is written.
"""

import math
from collections.abc import Sequence

import torch


class KimiArgumentError(ValueError):
    """An op argument (or a model setting) has the wrong type, dtype, shape, device,
    layout or value."""


def fail(op: str, name: str, expected: str, got: object) -> None:
    raise KimiArgumentError(f"kimi::{op}: argument '{name}' must be {expected}, got {got}")


def check_tensor(
    op: str,
    name: str,
    tensor: torch.Tensor,
    dtype: torch.dtype | Sequence[torch.dtype],
    shape: Sequence[int | None],
    rows: bool = False,
) -> None:
    """dtype (one or a choice), exact rank, sizes (``None``: any) and a contiguous layout;
    ``rows`` (a matrix): contiguous rows at any row stride, e.g. a column slice of a wider
    matrix (kernels index such an argument's rows by its stride)."""
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
    if rows and (tensor.shape[1] <= 1 or tensor.stride(1) == 1) and (tensor.shape[0] <= 1 or tensor.stride(0) >= tensor.shape[1]):
        return
    if not tensor.is_contiguous():
        fail(op, name, "rows with unit column stride" if rows else "contiguous", f"strides {tensor.stride()}")


def named_tensors(tensors: dict) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of ``tensors``; a list argument gives one pair per member,
    named by index (``boxes[1]``); None is skipped."""
    named = []
    for name, value in tensors.items():
        if isinstance(value, (list, tuple)):
            named += [(f"{name}[{i}]", member) for i, member in enumerate(value)]
        elif value is not None:
            named.append((name, value))
    return named


def check_same_device(op: str, **tensors) -> None:
    """Every given tensor (lists: every member) on the device of the first one. A meta
    tensor among real ones would send the call to the fake, which writes nothing."""
    named = named_tensors(tensors)
    first_name, first = named[0]
    for name, tensor in named[1:]:
        if tensor.device != first.device:
            fail(op, name, f"on {first.device} (the device of '{first_name}')", tensor.device)


def byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """[first, end) bytes of the tensor's storage that its elements may occupy."""
    if tensor.numel() == 0:
        return 0, 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    size = tensor.element_size()
    return tensor.storage_offset() * size, (tensor.storage_offset() + last + 1) * size


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b may share bytes: one storage and overlapping spans (views carved from one
    allocation at disjoint ranges, e.g. a[0] and a[1], do not)."""
    if not torch._C._is_alias_of(a, b):
        return False
    (a0, a1), (b0, b1) = byte_span(a), byte_span(b)
    return a0 < b1 and b0 < a1


def check_distinct(op: str, **tensors) -> None:
    """No two of the given buffers (lists: members) share memory: a box passed twice, or
    one box as two roles, would have one write clobber the other."""
    named = named_tensors(tensors)
    for i, (name, tensor) in enumerate(named):
        for other_name, other in named[:i]:
            if overlaps(tensor, other):
                fail(op, name, f"a buffer of its own (not the memory of '{other_name}')", "the same memory")


def check_placement(op: str, written: dict, read: dict) -> None:
    """Every tensor on one device (lists by member), and no buffer the op writes sharing
    memory with another argument (a box passed twice would have one write clobber the
    other, or a read see a write)."""
    check_same_device(op, **written, **read)
    check_distinct(op, **written)
    buffers = named_tensors(written)
    for name, tensor in named_tensors(read):  # each read against each written buffer, once
        for buffer_name, buffer in buffers:
            if overlaps(tensor, buffer):
                fail(op, name, f"a buffer of its own (not the memory of '{buffer_name}')", "the same memory")


def check_range(op: str, name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        fail(op, name, f"in [{low}, {high}]", value)


def check_eps(op: str, eps: float) -> None:
    """A norm's eps: finite and > 0 (eps ≤ 0 turns an all-zero row into NaN or inf)."""
    if not (math.isfinite(eps) and eps > 0):
        fail(op, "eps", "finite and > 0", eps)


def fail_setting(owner: str, name: str, expected: str, got: object) -> None:
    """A model setting (KimiConfig field, KimiDecoder argument) out of its domain."""
    raise KimiArgumentError(f"{owner}: {name} must be {expected}, got {got if isinstance(got, str) else repr(got)}")


def is_int(value) -> bool:
    """An int that is not a bool (True would pass for TP 1 and layer count 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """An int or float that is not a bool (eps=True would pass as 1)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
