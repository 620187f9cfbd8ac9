"""Independent float64 computations of the §3 ops, written apart from kimi_ops' references:
float64 throughout, BF16/FP8 only at the rounding points DESIGN §3 names."""

import math

import torch

BF = torch.bfloat16


def d(x):
    return x.to(torch.float64)


def route(logits, bias, scale, renorm):
    score = torch.sigmoid(logits)  # the FP32 sigmoid both sides use
    keys = (score + bias).tolist()
    ids, weights = [], []
    for token, row in enumerate(keys):
        # NaN lowest, then the value, −0 below +0, then the lower expert first.
        order = sorted(
            range(len(row)),
            key=lambda e: (not math.isnan(row[e]), row[e] if row[e] == row[e] else 0.0,
                           math.copysign(1.0, row[e]), -e),
            reverse=True,
        )[:16]
        picked = d(score[token, order])
        w = picked * scale
        if renorm:
            w = w / (picked.sum() + 1e-20)
        ids.append(order)
        weights.append(w)
    return torch.tensor(ids, dtype=torch.int32), torch.stack(weights).to(BF)


def situ(gate_up, beta, linear_beta):
    width = gate_up.shape[1] // 2
    g, u = d(gate_up[:, :width].to(BF)), d(gate_up[:, width:].to(BF))
    return (g / (1 + torch.exp(-beta * g)) * (u + linear_beta)).to(BF)


def linear(x, w):
    return d(x) @ d(w).T


def rms(x, w, eps):
    x = d(x)
    return (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * d(w)).to(BF)


def tail(expanded, weights, shared, gamma, w_up, eps):
    partial = torch.zeros(expanded.shape[0], expanded.shape[2], dtype=torch.float64)
    for r in range(16):  # the FP32 FMA chain: one FP32 rounding per step
        partial = d((partial + d(expanded[:, r]) * d(weights[:, r, None])).float())
    partial = partial.to(BF)
    squares = d(d(partial).square().to(BF))
    xn = (d(partial) / torch.sqrt(squares.mean(-1, keepdim=True) + eps) * d(gamma)).to(BF)
    up = linear(xn, w_up).to(BF)
    return (d(up) + d(shared)).to(BF)


def e4m3(values):
    """Power-of-two scale per row of the last dim, FP8 bytes; float64 math."""
    values = d(values)
    amax = values.abs().amax(-1, keepdim=True).clamp_min(1e-10)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    return (values / scale).to(torch.float8_e4m3fn), scale


def index_front(rows, wq_b, head_in, q_norm_w, eps):
    if q_norm_w is not None:
        rows = rms(rows, q_norm_w, eps)
    proj = linear(rows, wq_b).to(BF).view(rows.shape[0], 32, 128)
    q, scale = e4m3(proj)
    return q, (d(head_in) * scale[..., 0] / 64).to(BF)


def index_key(k_in, norm_w, norm_b, eps):
    x = d(k_in)
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    key = ((x - mean) / torch.sqrt(var + eps) * d(norm_w) + d(norm_b)).to(BF)
    q, scale = e4m3(key)
    return torch.cat([q.view(torch.uint8), scale.float().view(torch.uint8)], -1)


def attn_res(blocks, partial, sublayer_out, query, key_norm_w, out_norm_w, eps):
    new_partial = (d(partial) + d(sublayer_out).sum(0)).to(BF)
    values = torch.cat([blocks, new_partial[None]])
    keys = rms(values, key_norm_w, eps)
    alpha = torch.softmax((d(keys) * d(query)).sum(-1), 0)
    h = (alpha.unsqueeze(-1) * d(values)).sum(0).to(BF)
    return new_partial, h, rms(h, out_norm_w, eps)


def routed_experts(latent, ids, gate_up, down, rank, tp):
    """(rows [B, 16, L] bf16, their terms' magnitude Σ_j |act_j · down[e, l, j]|)."""
    experts = gate_up.shape[0]
    rows = torch.zeros(latent.shape[0], ids.shape[1], latent.shape[1], dtype=BF)
    magnitude = torch.zeros(rows.shape, dtype=torch.float64)
    for b, token in enumerate(ids.tolist()):
        for k, e in enumerate(token):
            if 0 <= e < experts and e // (experts // tp) == rank:
                act = d(situ((d(gate_up[e]) @ d(latent[b])).float()[None], 1.0, 0.0)[0])
                rows[b, k] = (d(down[e]) @ act).float().to(BF)
                magnitude[b, k] = d(down[e]).abs() @ act.abs()
    return rows, magnitude
