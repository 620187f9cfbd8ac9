"""Model shapes (DESIGN §1)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class KimiConfig:
    hidden: int  # H
    latent: int  # L: the routed experts' space
    experts: int  # E
    top_k: int
    shared_intermediate: int  # S: the shared expert's width (all ranks together)
    expert_intermediate: int  # a routed expert's width (a parameter: not a seed kernel)
    attn_out: int  # o-proj K (all ranks together)
    q_lora: int  # the DSA indexer's q_c width
    routed_scale: float
    renorm: bool = True
    eps: float = 1e-6
    capacity: int = 64  # CAP: the largest decode batch
    attn_res_block: int = 2  # layers per AttnRes block
    index_slots: int = 256  # rows of each layer's DSA index key cache

    @classmethod
    def kimi_k3(cls, expert_intermediate: int = 16, **overrides) -> "KimiConfig":
        """The seeds' Kimi-K3 shapes. The routed experts' width is small by default so the
        whole model fits a CPU example; set it for real runs."""
        return cls(
            hidden=7168, latent=3584, experts=896, top_k=16, shared_intermediate=6144,
            expert_intermediate=expert_intermediate, attn_out=12288, q_lora=1536,
            routed_scale=2.827, **overrides,
        )

    @classmethod
    def tiny(cls, **overrides) -> "KimiConfig":
        """Small shapes for fast CPU tests (the DSA indexer keeps its fixed 32 × 128 heads)."""
        return cls(**{
            "hidden": 256, "latent": 128, "experts": 64, "top_k": 16, "shared_intermediate": 192,
            "expert_intermediate": 32, "attn_out": 256, "q_lora": 96, "routed_scale": 2.5, **overrides,
        })
