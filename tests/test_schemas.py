"""The registered schemas (expect test), the generated C++ stubs, and the stub library
loaded before or after kimi_ops."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

expecttest = pytest.importorskip("expecttest")
import torch

import kimi_ops
from kimi_ops import SCHEMAS, stubs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TestSchemas(expecttest.TestCase):
    def test_registered_schemas(self):
        text = "\n".join(str(getattr(torch.ops.kimi, name).default._schema) for name in SCHEMAS)
        self.assertExpectedInline(text, """\
kimi::moe_route(Tensor logits, Tensor bias, float scale, bool renorm) -> (Tensor ids, Tensor weights)
kimi::moe_front(Tensor x, Tensor w, int n_logits) -> (Tensor logits, Tensor latent)
kimi::situ(Tensor gate_up, float beta, float linear_beta) -> Tensor
kimi::moe_tail(Tensor expanded, Tensor weights, Tensor shared, Tensor gamma, Tensor w_up, float eps) -> Tensor
kimi::oproj(Tensor x, Tensor w) -> Tensor
kimi::normed_oproj(Tensor x, Tensor w, Tensor norm_w, float eps) -> Tensor
kimi::gate_up_situ(Tensor x, Tensor w, float beta, float linear_beta) -> Tensor
kimi::dsa_index_front(Tensor rows, Tensor wq_b, Tensor head_in, Tensor? q_norm_w, float eps) -> (Tensor q, Tensor head_w)
kimi::dsa_index_key_insert(Tensor k_in, Tensor norm_w, Tensor norm_b, float eps, Tensor(a!) cache, Tensor slots) -> ()
kimi::dsa_index_front_keys(Tensor rows, Tensor wq_b, Tensor head_in, Tensor? q_norm_w, Tensor k_in, Tensor k_norm_w, Tensor k_norm_b, float eps, Tensor(a!) cache, Tensor slots) -> (Tensor q, Tensor head_w)
kimi::attn_res(Tensor blocks, Tensor partial, Tensor sublayer_out, Tensor query, Tensor key_norm_w, Tensor out_norm_w, float eps) -> (Tensor new_partial, Tensor h, Tensor h_normed)
kimi::routed_experts(Tensor latent, Tensor ids, Tensor gate_up, Tensor down, int rank, int tp) -> Tensor
kimi::mailbox_arm(Tensor(a!) box) -> ()
kimi::mailbox_rearm(Tensor(a!) box, int parity, int batch) -> ()
kimi::mailbox_take(Tensor(a!) box, int parity, int batch, Tensor(b!) error) -> Tensor
kimi::attn_res_take(Tensor(a!) box, int parity, int batch, Tensor(b!) error, Tensor blocks, Tensor partial, Tensor query, Tensor key_norm_w, Tensor out_norm_w, float eps) -> (Tensor new_partial, Tensor h, Tensor h_normed)
kimi::attn_res_take_into(Tensor(a!) box, int parity, int batch, Tensor(b!) error, Tensor blocks, Tensor partial, Tensor query, Tensor key_norm_w, Tensor out_norm_w, float eps, Tensor(c!) h_normed) -> (Tensor new_partial, Tensor h)
kimi::oproj_publish(Tensor x, Tensor w, Tensor(a!)[] boxes, int rank) -> ()
kimi::oproj_push(Tensor x, Tensor w, Tensor(a!)[] rs_boxes, int parity, int rank) -> ()
kimi::shared_expert_push(Tensor x, Tensor w_gate_up, Tensor w_down, float beta, float linear_beta, Tensor(a!) act, Tensor(b!) ticket, Tensor(c!)[] rs_boxes, int parity, int rank, Tensor(d!) error) -> ()
kimi::moe_front_publish(Tensor x, Tensor w, int n_logits, Tensor(a!)[] boxes, int parity, int rank) -> ()
kimi::moe_front_shared_push(Tensor x, Tensor w_front, int n_logits, Tensor(a!)[] front_boxes, Tensor w_gate_up, Tensor w_down, float beta, float linear_beta, Tensor(b!) act, Tensor(c!) ticket, Tensor(d!)[] rs_boxes, int parity, int rank, Tensor(e!) error) -> ()
kimi::moe_route_poll(Tensor(a!) box, Tensor bias, float scale, bool renorm, int parity, int batch, Tensor(b!) error, Tensor(c!)? ready=None) -> (Tensor ids, Tensor weights, Tensor latent)
kimi::routed_experts_counted(Tensor latent, Tensor ids, Tensor gate_up, Tensor down, int rank, int tp, Tensor(a!) ready, Tensor(b!) error) -> Tensor
kimi::moe_tail_push(Tensor shared, Tensor(a!)[] rs_boxes, int parity, int rank) -> ()
kimi::moe_tail_publish(Tensor expanded, Tensor weights, Tensor(a!)[] latent_boxes, int parity, int rank) -> ()
kimi::moe_latent_reduce(Tensor(a!) recv_box, Tensor(b!)[] gathered_boxes, Tensor(c!) error, int parity, int rearm_parity, int rearm_batch, int rank, int batch) -> ()
kimi::moe_tail_poll(Tensor(a!) latent_box, Tensor(b!) rs_box, Tensor gamma, Tensor w_up, float eps, Tensor(c!)[] out_boxes, Tensor(d!) error, int parity, int rearm_parity, int rearm_batch, int rank, int batch) -> ()
kimi::moe_tail_serve(Tensor expanded, Tensor weights, Tensor(a!)[] latent_boxes, Tensor(b!) rs_box, Tensor gamma, Tensor w_up, float eps, Tensor(c!)[] out_boxes, Tensor(d!) error, int parity, int rearm_parity, int rearm_batch, int rank) -> ()
kimi::group_barrier(Tensor(a!)[] boxes, Tensor(b!) ticket, Tensor(c!) error, int rank) -> ()""")

    def test_defined_in_python_without_stub(self):
        self.assertEqual(kimi_ops.registry.defined_by, "python")


def test_committed_cpp_stubs_match_the_table():
    with open(stubs.STUB_PATH) as f:
        assert f.read() == stubs.render(), "run `python -m kimi_ops.stubs` and commit the result"


def run_python(*parts: str) -> str:
    code = "".join(textwrap.dedent(part) for part in parts)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True,
        cwd=ROOT, timeout=600, env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def stub_library(tmp_path_factory):
    """Build csrc_stubs/ with torch's cpp_extension (in a subprocess, so this process
    keeps its Python-defined ops); the path of the shared library."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    if shutil.which("ninja") is None:
        pytest.skip("torch's cpp_extension needs ninja")
    build = tmp_path_factory.mktemp("stub_build")
    return run_python(f"""
        from torch.utils.cpp_extension import load
        load("kimi_ops_stubs", [{str(stubs.STUB_PATH)!r}], build_directory={str(build)!r},
             is_python_module=False, verbose=False)
        print({str(build / "kimi_ops_stubs.so")!r})
    """).strip().splitlines()[-1]


CHECK_OPS = """
    import torch
    out = torch.ops.kimi.oproj(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(4, 8, dtype=torch.bfloat16))
    assert out.float().eq(8).all()
    for name in kimi_ops.SCHEMAS:
        assert getattr(torch.ops.kimi, name).default._schema is not None
    print(kimi_ops.registry.defined_by)
"""


def test_stub_loaded_first(stub_library):
    out = run_python(f"""
        import torch
        torch.ops.load_library({stub_library!r})
        import kimi_ops
    """, CHECK_OPS)
    assert out.strip() == "c++"


def test_stub_loaded_after_kimi_ops(stub_library):
    out = run_python(f"""
        import kimi_ops
        assert kimi_ops.registry.defined_by == "python"
        kimi_ops.load_stub_library({stub_library!r})
    """, CHECK_OPS)
    assert out.strip() == "c++"
