"""Property-based tests of every op's argument space (issue 20): from a valid sample, up
to three random changes (dtype, shape, layout, storage offset, device, an int argument,
eps, a box list's members). Whatever the draw, the op either

- raises a KimiArgumentError in its own name that names one of its arguments, with no
  buffer changed, and its fake gives the same verdict; or
- returns what the reference returns (on CUDA: the kernels against the CPU reference),
  with outputs of the fake's shapes and dtypes.

Never an internal error (IndexError, a torch view error, a hang). Slot values of the key
insert are data, checked on the host only (the fake cannot see them): they stay valid.
Results are compared bit for bit on the CPU; CUDA draws (where a GPU is present) check the
verdicts and the fakes, while the kernels' tolerances live in their own tests."""

import math
import os
import re

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from kimi_ops import SCHEMAS, KimiArgumentError  # noqa: E402
from samples import sample_args  # noqa: E402

from conftest import reference  # noqa: E402

# CI: 40 fixed draws per op (~15 s in all); KIMI_OPS_HYPOTHESIS=deep draws 400 new ones.
settings.register_profile("ci", max_examples=40, derandomize=True)
settings.register_profile("deep", max_examples=400)
settings.load_profile(os.environ.get("KIMI_OPS_HYPOTHESIS", "ci"))

kimi = torch.ops.kimi
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8]
INTS = [-1, 0, 1, 2, 3, 4, 7, 8, 9, 16, 64]
EPS = [1e-6, 1e-30, 0.0, -1.0, math.nan, math.inf]


def argument_names(name: str) -> list[str]:
    return [a.name for a in getattr(kimi, name).default._schema.arguments]


def tensor_slots(args):
    """(argument index, list member or None) of every tensor argument."""
    slots = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            slots.append((i, None))
        elif isinstance(a, list):
            slots += [(i, m) for m in range(len(a))]
    return slots


def get(args, slot):
    i, m = slot
    return args[i] if m is None else args[i][m]


def put(args, slot, value):
    i, m = slot
    if m is not None:
        members = list(args[i])
        members[m] = value
        value = members
    return args[:i] + (value,) + args[i + 1 :]


def filled(shape, dtype, gen):
    values = torch.randn(*shape, generator=gen)
    if dtype.is_floating_point:
        return values.to(dtype)
    return (values * 3).to(dtype) if dtype != torch.uint8 else values.abs().mul(50).to(dtype)


def change(draw, name, args, gen):
    """One random change of ``args`` (a tuple)."""
    names = argument_names(name)
    slots = tensor_slots(args)
    ints = [i for i, a in enumerate(args) if isinstance(a, int) and not isinstance(a, bool)]
    eps = [i for i, n in enumerate(names) if n == "eps"]
    lists = [i for i, a in enumerate(args) if isinstance(a, list)]
    kinds = ["dtype", "shape", "layout", "offset", "meta"] + ["int"] * bool(ints) + ["eps"] * bool(eps) \
        + ["members"] * bool(lists)
    kind = draw(st.sampled_from(kinds))
    if kind == "int":
        return put(args, (draw(st.sampled_from(ints)), None), draw(st.sampled_from(INTS)))
    if kind == "eps":
        return put(args, (eps[0], None), draw(st.sampled_from(EPS)))
    if kind == "members":
        i = draw(st.sampled_from(lists))
        members = list(args[i])
        how = draw(st.sampled_from(["repeat", "drop", "add", "alias"]))
        if how == "repeat" and len(members) > 1:
            members[1] = members[0]
        elif how == "drop":
            members = members[:-1]
        elif how == "add":
            members = members + [members[0].clone()]
        elif how == "alias":  # a box of the list is another argument too
            other = draw(st.sampled_from(slots))
            members[0] = get(args, other)
        return args[:i] + (members,) + args[i + 1 :]
    slot = draw(st.sampled_from(slots))
    tensor = get(args, slot)
    if tensor.device.type == "meta" and kind != "dtype":
        return args  # no data to lay out anew
    if kind == "dtype":
        return put(args, slot, tensor.to(draw(st.sampled_from(DTYPES))))
    if kind == "shape":
        if tensor.dim() == 0:
            return args
        dim = draw(st.integers(0, tensor.dim() - 1))
        size = tensor.shape[dim]
        shape = list(tensor.shape)
        shape[dim] = draw(st.sampled_from(sorted({0, 1, max(size - 1, 0), size + 1, size + 8, 2 * size})))
        return put(args, slot, filled(shape, tensor.dtype, gen))
    if kind == "layout":
        if tensor.dim() >= 2 and tensor.shape[-1] > 1 and tensor.shape[-2] > 1:
            return put(args, slot, tensor.transpose(-1, -2).contiguous().transpose(-1, -2))
        wide = torch.empty(*tensor.shape[:-1], 2 * tensor.shape[-1], dtype=tensor.dtype) if tensor.dim() else None
        return args if wide is None else put(args, slot, wide[..., ::2].copy_(tensor))
    if kind == "offset":
        shift = draw(st.sampled_from([1, 2, 4, 8]))
        moved = torch.empty(tensor.numel() + shift, dtype=tensor.dtype)[shift:].view(tensor.shape)
        return put(args, slot, moved.copy_(tensor))
    return put(args, slot, tensor.to("meta"))


def flat_tensors(args):
    return [get(args, s) for s in tensor_slots(args)]


def snapshot(args):
    return [None if t.device.type == "meta" else t.clone() for t in flat_tensors(args)]


def unchanged(before, args) -> bool:
    return all(
        old is None or equal_bits(old, new)
        for old, new in zip(before, flat_tensors(args))
    )


def verdict(call):
    """(None, result) or (message, None) of a KimiArgumentError."""
    try:
        return None, call()
    except KimiArgumentError as error:
        return str(error), None


def on_fakes(name, args):
    """The op under fake tensors: its fake's checks and result metadata."""
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        fakes = tuple([fake(m) for m in a] if isinstance(a, list) else fake(a) for a in args)
        return verdict(lambda: getattr(kimi, name)(*fakes))


def outputs(result):
    return [] if result is None else list(result) if isinstance(result, tuple) else [result]


def equal_bits(a, b) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    dense = lambda t: torch.empty(t.shape, dtype=t.dtype).copy_(t).view(torch.uint8)  # noqa: E731
    return torch.equal(dense(a), dense(b))


def cloned(args, device="cpu"):
    """A deep copy of ``args`` that keeps aliasing between arguments (the same box twice
    stays one buffer)."""
    copies = {}

    def copy(t):
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) not in copies:
            copies[id(t)] = t if t.device.type == "meta" else t.clone().to(device)
        return copies[id(t)]

    return tuple([copy(m) for m in a] if isinstance(a, list) else copy(a) for a in args)


def restored(args, before):
    """``args`` with every tensor replaced by a copy of its snapshot, one copy per buffer."""
    copies = {}
    for tensor, old in zip(flat_tensors(args), before):
        copies.setdefault(id(tensor), old.clone())
    swap = lambda t: copies[id(t)] if isinstance(t, torch.Tensor) else t  # noqa: E731
    return tuple([swap(m) for m in a] if isinstance(a, list) else swap(a) for a in args)


OPS = list(SCHEMAS)
# Data checks made on the host only (values, not metadata): a fake cannot see them.
SLOT_VALUES = re.compile(r"argument 'slots' must be (in \[|distinct)")
HOST_ONLY = {"dsa_index_key_insert": SLOT_VALUES, "dsa_index_front_keys": SLOT_VALUES}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("name", OPS)
@settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_argument_space(name, data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    batch = data.draw(st.sampled_from([1, 3, 8]), label="batch")
    args = sample_args(name, batch, gen)
    changes = data.draw(st.integers(0, 3), label="changes")
    for _ in range(changes):
        args = change(data.draw, name, args, gen)
    device = data.draw(st.sampled_from(DEVICES), label="device")
    args = cloned(args, device)
    before = snapshot(args)
    real_error, result = verdict(lambda: getattr(kimi, name)(*args))
    fake_error, fake_result = on_fakes(name, cloned(args, device))
    if changes == 0:
        assert real_error is None, real_error  # the samples are valid: never over-strict
    if real_error is not None:
        named = re.match(rf"kimi::{name}: argument '([A-Za-z_]+)", real_error)
        assert named and named.group(1) in argument_names(name), real_error
        assert unchanged(before, args), f"kimi::{name} wrote before raising: {real_error}"
        host_only = HOST_ONLY.get(name)
        if not (host_only and host_only.search(real_error)):
            assert fake_error == real_error
        return
    assert fake_error is None, fake_error
    for got, meta in zip(outputs(result), outputs(fake_result)):
        assert (got.shape, got.dtype) == (meta.shape, meta.dtype)
    if any(t.device.type == "meta" for t in flat_tensors(args)):
        return  # all tensors on meta: the fake ran, no data to compare
    if device != "cpu":
        return  # kernels round differently: test_kernels and friends hold their tolerances
    # The reference on the inputs as they were (aliasing kept): the same bits, written
    # buffers included.
    expected_args = restored(args, before)
    expected = reference(getattr(kimi, name), *expected_args)
    for got, want in zip(outputs(result), outputs(expected)):
        assert equal_bits(got, want)
    for got, want in zip(flat_tensors(args), flat_tensors(expected_args)):
        assert equal_bits(got, want)
