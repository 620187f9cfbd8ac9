"""The ``kimi`` ops: the functional ops of DESIGN §3 and the mailbox ops of §4. Each
module holds an op family's checks, reference (the oracle) and fake;
:mod:`kimi_ops.registry` attaches them to the dispatcher."""

from . import attn_res, dsa, experts, front, mailbox_ops, oproj, route, tail

# op name → (reference, fake); the schemas live in kimi_ops.schemas.
OPS = {
    "moe_route": (route.moe_route, route.moe_route_fake),
    "moe_front": (front.moe_front, front.moe_front_fake),
    "situ": (route.situ, route.situ_fake),
    "moe_tail": (tail.moe_tail, tail.moe_tail_fake),
    "oproj": (oproj.oproj, oproj.oproj_fake),
    "dsa_index_front": (dsa.dsa_index_front, dsa.dsa_index_front_fake),
    "dsa_index_key_insert": (dsa.dsa_index_key_insert, dsa.dsa_index_key_insert_fake),
    "attn_res": (attn_res.attn_res, attn_res.attn_res_fake),
    "routed_experts": (experts.routed_experts, experts.routed_experts_fake),
    **mailbox_ops.OPS,
}
