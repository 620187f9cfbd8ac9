"""One MoE sublayer through the functional ops (TP1): front → route → shared expert →
routed experts → tail. The composite the fused decode path reproduces."""

from dataclasses import dataclass

import torch

from .config import KimiConfig

kimi = torch.ops.kimi


@dataclass
class MoeWeights:
    front: torch.Tensor  # [E + L, H]: router rows, then the latent down rows
    bias: torch.Tensor  # [E] FP32 correction bias
    shared_gate_up: torch.Tensor  # [2S, H]
    shared_down: torch.Tensor  # [H, S]
    expert_gate_up: torch.Tensor  # [E, 2I, L]
    expert_down: torch.Tensor  # [E, L, I]
    gamma: torch.Tensor  # [L] the tail's RMSNorm weight
    w_up: torch.Tensor  # [H, L]

    @classmethod
    def random(cls, config: KimiConfig, gen: torch.Generator, device="cpu") -> "MoeWeights":
        """Seeded random weights scaled like trained ones (unit-variance outputs)."""
        h, l, e = config.hidden, config.latent, config.experts
        s, i = config.shared_intermediate, config.expert_intermediate

        def weight(*shape, dtype=torch.bfloat16):
            fan_in = shape[-1]
            return (torch.randn(*shape, generator=gen) * fan_in**-0.5).to(dtype).to(device)

        return cls(
            front=weight(e + l, h),
            bias=(torch.randn(e, generator=gen) * 0.01).to(device),
            shared_gate_up=weight(2 * s, h),
            shared_down=weight(h, s),
            expert_gate_up=weight(e, 2 * i, l),
            expert_down=weight(e, l, i),
            gamma=(1 + 0.1 * torch.randn(l, generator=gen)).bfloat16().to(device),
            w_up=weight(h, l),
        )


def moe_step(x: torch.Tensor, w: MoeWeights, config: KimiConfig) -> torch.Tensor:
    """x [B, H] bf16 → the MoE sublayer's output [B, H] bf16."""
    logits, latent = kimi.moe_front(x, w.front, config.experts)
    ids, weights = kimi.moe_route(logits, w.bias, config.routed_scale, config.renorm)
    shared = kimi.oproj(kimi.situ(kimi.oproj(x, w.shared_gate_up), 1.0, 0.0), w.shared_down)
    expanded = kimi.routed_experts(latent, ids, w.expert_gate_up, w.expert_down, 0, 1)
    return kimi.moe_tail(expanded, weights, shared, w.gamma, w.w_up, config.eps)
