"""Model shapes (DESIGN §1)."""

import math
from dataclasses import dataclass, fields

from .checks import fail_setting, is_int, is_number
from .mailbox import PACKET

TOP_K = 16  # routed experts a token (the routing ops' fixed top-k)
MAX_EXPERTS = 1024  # the routing kernels' largest expert count
INDEX_HEADS, INDEX_DIM = 32, 128  # the DSA indexer's heads × head width (fixed by the seeds)

# Fields that are sizes (positive ints); those that set a mailbox row's width must be
# whole 16-byte packets of it (the front row packs E logits as FP32 words, two BF16 each).
SIZES = ("hidden", "latent", "experts", "shared_intermediate", "expert_intermediate", "attn_out", "q_lora",
         "capacity", "attn_res_block")
PACKED = {"hidden": PACKET, "latent": PACKET, "experts": PACKET // 2}


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

    def __post_init__(self):
        """Every field in its domain, at construction (a bad one would otherwise surface as
        an op's argument error, or NaN, at the first forward)."""
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name in SIZES and not (is_int(value) and value >= 1):
                fail_setting("KimiConfig", field.name, "a positive int", value)
        for name, multiple in PACKED.items():
            if getattr(self, name) % multiple:
                fail_setting("KimiConfig", name, f"a multiple of {multiple} (whole 16-byte mailbox packets)",
                             getattr(self, name))
        if not is_int(self.top_k) or self.top_k != TOP_K:
            fail_setting("KimiConfig", "top_k", f"{TOP_K} (the routing ops' fixed top-k)", self.top_k)
        if not TOP_K <= self.experts <= MAX_EXPERTS:
            fail_setting("KimiConfig", "experts", f"in [{TOP_K}, {MAX_EXPERTS}] (the routing ops' range)", self.experts)
        if not (is_int(self.index_slots) and self.index_slots >= 0):
            fail_setting("KimiConfig", "index_slots", "an int ≥ 0", self.index_slots)
        if not (is_number(self.eps) and math.isfinite(self.eps) and self.eps > 0):
            fail_setting("KimiConfig", "eps", "finite and > 0", self.eps)
        if not (is_number(self.routed_scale) and math.isfinite(self.routed_scale)):
            fail_setting("KimiConfig", "routed_scale", "a finite number", self.routed_scale)
        if not isinstance(self.renorm, bool):
            fail_setting("KimiConfig", "renorm", "a bool", self.renorm)

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
