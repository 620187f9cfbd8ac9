"""The CUDA dispatch (DESIGN §5), exercised on the CPU through ``backend.cuda_impl``."""

import warnings

import pytest
import torch

from kimi_ops import backend


class FakeKernel:
    def __init__(self, reason=None):
        self.reason, self.calls, self.prepared, self.asked = reason, 0, [], 0

    def check(self, x):
        if x.dim() != 0:
            raise ValueError("kimi::op: argument 'x' must be a scalar tensor")

    def unsupported(self, x):
        self.asked += 1
        x.item()  # like a kernel reading its argument's shape: only for checked arguments
        return self.reason

    def prepare(self, *key):
        self.prepared.append(key)

    def __call__(self, x):
        self.calls += 1
        return x + 1


@pytest.fixture
def kernels(monkeypatch):
    monkeypatch.setattr(backend, "KERNELS", {})
    monkeypatch.setattr(backend, "_warned", set())
    monkeypatch.delenv("KIMI_OPS_BACKEND", raising=False)
    return backend.KERNELS


def reference(x):
    return x * 2


def test_no_kernel_falls_back_with_one_warning(kernels):
    impl = backend.cuda_impl("op", reference)
    with pytest.warns(UserWarning, match="kimi::op: using the reference backend on CUDA"):
        assert impl(torch.tensor(3)) == 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert impl(torch.tensor(3)) == 6  # once only


def test_supported_kernel_is_used_and_unsupported_falls_back(kernels):
    kernels["op"] = FakeKernel()
    assert backend.cuda_impl("op", reference)(torch.tensor(3)) == 4
    kernels["other"] = FakeKernel(reason="L must be a multiple of 8")
    with pytest.warns(UserWarning, match="L must be a multiple of 8"):
        assert backend.cuda_impl("other", reference)(torch.tensor(3)) == 6


def test_forced_backends(kernels, monkeypatch):
    kernels["op"] = FakeKernel()
    monkeypatch.setenv("KIMI_OPS_BACKEND", "reference")
    assert backend.cuda_impl("op", reference)(torch.tensor(3)) == 6
    backend.prepare("op", 896)
    assert kernels["op"].prepared == []
    monkeypatch.setenv("KIMI_OPS_BACKEND", "cute")
    with pytest.raises(NotImplementedError, match="kimi::missing: KIMI_OPS_BACKEND=cute but no CuTe kernel"):
        backend.cuda_impl("missing", reference)(torch.tensor(3))
    backend.prepare("op", 896)
    assert kernels["op"].prepared == [(896,)]
    monkeypatch.setenv("KIMI_OPS_BACKEND", "triton")
    with pytest.raises(ValueError, match="KIMI_OPS_BACKEND must be one of"):
        backend.cuda_impl("op", reference)(torch.tensor(3))


def test_bad_input_fails_its_check_before_any_kernel_looks_at_it(kernels):
    kernels["op"] = FakeKernel()
    with pytest.raises(ValueError, match="argument 'x' must be a scalar"):
        backend.cuda_impl("op", reference)(torch.ones(2))
    assert kernels["op"].asked == 0 and kernels["op"].calls == 0


def test_reference_backend_never_asks_the_kernel(kernels, monkeypatch):
    kernels["op"] = FakeKernel()
    monkeypatch.setenv("KIMI_OPS_BACKEND", "reference")
    assert backend.cuda_impl("op", reference)(torch.tensor(3)) == 6
    assert kernels["op"].asked == 0


@pytest.mark.parametrize("ask", ["serves", "prefers"])
def test_serves_and_prefers_ask_the_kernel_for_cuda_tensors_unless_the_reference_is_forced(kernels, monkeypatch,
                                                                                           ask):
    """backend.serves and backend.prefers: False without a kernel, without its answer, for
    tensors off CUDA (a CPU decoder in a process with CUDA runs the references alone) or
    under the reference backend; else the kernel's answer for the shapes."""
    cuda = torch.device("cuda", 0)
    assert not getattr(backend, ask)("op", cuda, 8)
    kernels["op"] = FakeKernel()
    assert not getattr(backend, ask)("op", cuda, 8)  # no answer: nothing to rely on
    setattr(kernels["op"], ask, lambda width: width % 8 == 0)
    assert getattr(backend, ask)("op", cuda, 8) and not getattr(backend, ask)("op", cuda, 12)
    assert not getattr(backend, ask)("op", torch.device("cpu"), 8)
    monkeypatch.setenv("KIMI_OPS_BACKEND", "reference")
    assert not getattr(backend, ask)("op", cuda, 8)


def test_every_kernels_check_takes_its_ops_arguments_in_order(kernels):
    """The dispatch calls ``kernel.check(*args)`` with the op's arguments as they came: a
    check whose parameters are not the schema's, in order, reads one argument as another
    (attn_res_take's counters once went in as h_normed)."""
    import inspect

    pytest.importorskip("cutlass")
    from kimi_ops import kernels as cute_kernels

    assert cute_kernels.register()
    assert kernels, "no kernel registered"
    for name, kernel in kernels.items():
        expected = [argument.name for argument in getattr(torch.ops.kimi, name).default._schema.arguments]
        got = list(inspect.signature(kernel.check).parameters)[:len(expected)]  # then defaults (op)
        assert got == expected, f"kimi::{name}: check's parameters {got}, the schema's {expected}"
