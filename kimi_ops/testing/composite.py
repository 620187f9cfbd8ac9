"""The plain-PyTorch composites that benchmarks time against our ops and tests hold to them:
what a serving engineer writes without our ops. BF16 GEMMs through cuBLAS (``x @ w.T``),
torch ops elsewhere, FP32 where the ops keep FP32, never float64.

- :func:`tail_composite`: kimi::moe_tail, and with a group the TP tail on NCCL;
- :func:`front_composite`, :func:`key_composite`: the DSA indexer front and key insert;
- :class:`CompositeDecoder`: the decoder's layers at TP1 on a :class:`~kimi_ops.KimiDecoder`'s
  own weights (its buffers, shared, not copied), with the decoder's data flow
  (runtime/decoder.py, DESIGN §2):

    index front: q_c = x @ wq_a.T; QueryNorm; @ wq_b.T; per-(token, head) FP8 with the
                 power-of-two scale and the folded head weight; key = LayerNorm(x @ wk.T)
                 → FP8 rows at the slots (the DSA composites);
    the stand-in core q_c @ w_core.T; o-proj; AttnRes;
    MoE front: one GEMM over [router; down] → FP32 logits, BF16 latent;
    routing: sigmoid + bias, top-16, renormalized, times the routed scale;
    shared expert: gate/up GEMM, SwiGLU, down GEMM;
    routed experts: the decoder's stand-in form (a SwiGLU per expert in the latent space);
    tail: Σ w·rows, RMSNorm, up projection + shared (:func:`tail_composite`); AttnRes.

  It rounds where our ops round, but its sums are cuBLAS's / torch's (not the reference's
  exact-then-round), so it equals the decoder to BF16 rounding noise, not bit for bit
  (tests/test_bench_layer.py states the tolerance).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import INDEX_DIM, INDEX_HEADS, TOP_K


def tail_composite(expanded, weights, shared, gamma, w_up, eps, group=None):
    """kimi::moe_tail in PyTorch: the same rounding points, BF16 GEMM. ``group``
    (benchmarks/bench_tp.py: an NCCL group of the TP ranks, ``w_up`` this rank's rows): the
    partial latent all-reduced, the shared rows [B, H] reduce-scattered to this rank's
    columns, the output rows all-gathered, as every rank's output box ends."""
    partial = (expanded.float() * weights.float().unsqueeze(-1)).sum(1).bfloat16()
    if group is not None:
        dist.all_reduce(partial, group=group)
    ss = partial.float().square().bfloat16().float().sum(-1, keepdim=True)
    xn = (partial.float() * torch.rsqrt(ss / partial.shape[-1] + eps) * gamma.float()).bfloat16()
    if group is None:
        return (F.linear(xn, w_up).float() + shared.float()).bfloat16()
    tp, (batch, shard) = dist.get_world_size(group), (shared.shape[0], w_up.shape[0])
    # flat buffers, rank-major: gloo checks dim 0 (output × TP = input), NCCL only sizes
    mine = shared.new_empty((batch * shard,))
    dist.reduce_scatter_tensor(mine, shared.view(batch, tp, shard).transpose(0, 1).reshape(-1), group=group)
    out = (F.linear(xn, w_up).float() + mine.view(batch, shard).float()).bfloat16()
    rows = shared.new_empty((tp * batch * shard,))
    dist.all_gather_into_tensor(rows, out.view(-1), group=group)
    return rows.view(tp, batch, shard).permute(1, 0, 2).reshape(batch, tp * shard)


def pow2_ceil(v):
    bits = v.view(torch.int32)
    up = (bits & 0x7F800000) + 0x00800000
    return torch.where((bits & 0x007FFFFF) == 0, bits, up).view(torch.float32)


def quantize(values):
    """kimi_ops.numerics.quantize_e4m3 in FP32 torch ops (the DSA composites')."""
    values = values.float()
    scale = pow2_ceil(values.abs().amax(-1, keepdim=True).clamp_min(1e-10) / 448.0)
    return (values / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def front_composite(rows, wq_b, head_in, q_norm_w, eps):
    """kimi::dsa_index_front in plain torch: QueryNorm, the BF16 projection (cuBLAS, FP32 accumulation),
    the per-head FP8 quantization and the folded head weights."""
    if q_norm_w is not None:
        x = rows.float()
        rows = ((x * torch.rsqrt(x.square().sum(-1, keepdim=True) / x.shape[-1] + eps)) * q_norm_w.float()).bfloat16()
    q, scale = quantize((rows @ wq_b.T).view(rows.shape[0], INDEX_HEADS, INDEX_DIM))
    return q, ((head_in.float() * scale.squeeze(-1)) * (INDEX_HEADS * INDEX_DIM) ** -0.5).bfloat16()


def key_composite(k_in, norm_w, norm_b, eps, cache, slots):
    """kimi::dsa_index_key_insert in plain torch (every slot valid: benchmarks/bench_dsa.py's)."""
    key = F.layer_norm(k_in.float(), (INDEX_DIM,), norm_w.float(), norm_b.float(), eps).bfloat16()
    q, scale = quantize(key)
    bits = scale.view(torch.int32)  # the scale's bytes by shifts: Inductor cannot view FP32 as bytes
    scale_bytes = torch.cat([(bits >> shift) & 0xFF for shift in (0, 8, 16, 24)], -1).to(torch.uint8)
    cache.index_copy_(0, slots, torch.cat([q.view(torch.uint8), scale_bytes], -1))


def rms_norm(x, weight, eps):
    """BF16 of (x · rsqrt(mean x² + eps)) · weight in FP32."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).bfloat16()


def logits_and_latent(x, w, n_logits):
    """One GEMM over [router; down]: FP32 logits, BF16 latent (rounded once). On CUDA one
    cuBLAS BF16 GEMM with FP32 output; elsewhere (smoke runs) an FP32 GEMM."""
    if x.is_cuda:
        out = torch.mm(x, w.T, out_dtype=torch.float32)
    else:
        out = x.float() @ w.float().T
    return out[:, :n_logits], out[:, n_logits:].bfloat16()


def route(logits, bias, scale, renorm):
    """Top-16 of sigmoid(logit) + bias; weights = score · scale (/ Σ score), BF16."""
    score = logits.sigmoid()
    ids = (score + bias).topk(TOP_K, dim=-1).indices
    picked = score.gather(1, ids)
    weights = picked * scale
    if renorm:
        weights = weights / (picked.sum(-1, keepdim=True) + 1e-20)
    return ids, weights.bfloat16()


def swiglu(gate_up):
    """SwiGLU of BF16 [.., 2S] (gate first), FP32 math, BF16 out."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).bfloat16()


def routed_experts(latent, ids, gate_up, down):
    """The decoder's stand-in experts as batched BF16 GEMMs over the gathered weights:
    [B, 16, L] bf16 by rank."""
    hidden = (gate_up[ids] @ latent[:, None, :, None]).squeeze(-1)  # [B, 16, 2I]
    return (down[ids] @ swiglu(hidden)[..., None]).squeeze(-1)  # [B, 16, L]


def attn_res(blocks, partial, rows, query, key_norm_w, out_norm_w, eps):
    """Block AttnRes in torch ops: (new_partial, h, h_normed)."""
    new_partial = (partial.float() + rows.float().sum(0)).bfloat16()
    values = torch.cat([blocks, new_partial[None]])
    logits = (rms_norm(values, key_norm_w, eps).float() * query.float()).sum(-1)  # [N + 1, B]
    h = (logits.softmax(0)[..., None] * values.float()).sum(0).bfloat16()
    return new_partial, h, rms_norm(h, out_norm_w, eps)


ATTENTION = ("wq_a", "q_norm_w", "wq_b", "w_head", "wk", "k_norm_w", "k_norm_b")
MOE = ("front", "bias", "shared_gate_up", "shared_down", "expert_gate_up", "expert_down")
RESIDUAL = ("query", "key_norm_w", "out_norm_w")


class CompositeDecoder(nn.Module):
    """The composite of ``decoder``'s layers (a TP1 ``KimiDecoder``) on its weights.

    ``forward(hidden [B, H] bf16, slots [B] int64)`` returns (h [B, H], the indexer's
    (q, head_w) of every layer): h as the decoder returns it; the indexer outputs are
    returned so that torch.compile keeps the work a real attention core would consume.
    The index key caches are this module's own (zeros like the decoder's), so running it
    leaves the decoder's state alone."""

    def __init__(self, decoder):
        super().__init__()
        if decoder.group.tp != 1:
            raise ValueError(f"the composite is the TP1 layer; the decoder has TP{decoder.group.tp}")
        self.config, self.num_layers = decoder.config, decoder.num_layers
        self.embed = self.residual_buffers(decoder.embed_res)
        self.layers = nn.ModuleList()
        for (part,), (attn_res, moe_res) in zip(decoder.layers, decoder.attn_res):
            layer = nn.Module()
            for name in ATTENTION:  # the decoder's three projections of x are rows of one weight
                weight = part.index.weight(name) if name in part.index.SPLITS else getattr(part.index, name)
                layer.register_buffer(name, weight)
            layer.register_buffer("index_cache", torch.zeros_like(part.index.index_cache))
            layer.register_buffer("w_core", part.oproj.w_core)
            layer.register_buffer("w_o", part.oproj.w_o)
            for name in MOE:  # the decoder's gate/up rows are interleaved for its epilogue
                weight = part.front.shared_gate_up_rows() if name == "shared_gate_up" else getattr(part.front, name)
                layer.register_buffer(name, weight)
            layer.register_buffer("gamma", part.tail.gamma)
            layer.register_buffer("w_up", part.tail.w_up)
            layer.attn_res = self.residual_buffers(attn_res)
            layer.moe_res = self.residual_buffers(moe_res)
            self.layers.append(layer)

    @staticmethod
    def residual_buffers(res) -> nn.Module:
        module = nn.Module()
        for name in RESIDUAL:
            module.register_buffer(name, getattr(res, name))
        return module

    def residual(self, res, blocks, partial, rows):
        return attn_res(blocks, partial, rows, res.query, res.key_norm_w, res.out_norm_w, self.config.eps)

    def layer(self, w, x, partial, blocks, slots, trace=None):
        """One decode layer: (new_partial, h, h_normed, (q, head_w))."""
        c = self.config
        q_c = x @ w.wq_a.T
        index = front_composite(q_c, w.wq_b, x @ w.w_head.T, w.q_norm_w, c.eps)
        key_composite(x @ w.wk.T, w.k_norm_w, w.k_norm_b, c.eps, w.index_cache, slots)
        rows = (q_c @ w.w_core.T) @ w.w_o.T
        partial, _, x = self.residual(w.attn_res, blocks, partial, rows[None])
        logits, latent = logits_and_latent(x, w.front, c.experts)
        ids, weights = route(logits, w.bias, c.routed_scale, c.renorm)
        shared = swiglu(x @ w.shared_gate_up.T) @ w.shared_down.T
        expanded = routed_experts(latent, ids, w.expert_gate_up, w.expert_down)
        out = tail_composite(expanded, weights, shared, w.gamma, w.w_up, c.eps)
        if trace is not None:
            trace.setdefault("moe_input", []).append(x)
            trace.setdefault("ids", []).append(ids)
        partial, h, x = self.residual(w.moe_res, blocks, partial, out[None])
        return partial, h, x, index

    def forward(self, hidden, slots, trace=None):
        """``trace``: a dict that eager callers pass to get each layer's MoE input and ids."""
        c = self.config
        blocks = hidden.new_empty((0, hidden.shape[0], c.hidden))
        # The embedding is the first sublayer output of the first block.
        partial, h, x = self.residual(self.embed, blocks, torch.zeros_like(hidden), hidden[None])
        indexer = []
        for i, layer in enumerate(self.layers):
            partial, h, x, index = self.layer(layer, x, partial, blocks, slots, trace)
            indexer.append(index)
            if (i + 1) % c.attn_res_block == 0:  # a block boundary (static)
                blocks = torch.cat([blocks, partial[None]])
                partial = torch.zeros_like(partial)
        return h, indexer
