"""The ``kimi`` ops: the functional ops of DESIGN §3 and the mailbox ops of §4. Each
module holds an op family's checks, reference (the oracle) and fake;
:mod:`kimi_ops.registry` attaches them to the dispatcher."""

from . import attn_res, boxes, dsa, experts, front, oproj, route, tail

# op name → (reference, fake); the schemas live in kimi_ops.schemas.
OPS = {
    "moe_route": (route.moe_route, route.moe_route_fake),
    "moe_front": (front.moe_front, front.moe_front_fake),
    "situ": (route.situ, route.situ_fake),
    "moe_tail": (tail.moe_tail, tail.moe_tail_fake),
    "oproj": (oproj.oproj, oproj.oproj_fake),
    "normed_oproj": (oproj.normed_oproj, oproj.normed_oproj_fake),
    "gate_up_situ": (oproj.gate_up_situ, oproj.gate_up_situ_fake),
    "dsa_index_front": (dsa.dsa_index_front, dsa.dsa_index_front_fake),
    "dsa_index_key_insert": (dsa.dsa_index_key_insert, dsa.dsa_index_key_insert_fake),
    "dsa_index_front_keys": (dsa.dsa_index_front_keys, dsa.dsa_index_front_keys_fake),
    "attn_res": (attn_res.attn_res, attn_res.attn_res_fake),
    "routed_experts": (experts.routed_experts, experts.routed_experts_fake),
    # the mailbox ops (DESIGN §4): the box protocol's, then each family's
    "mailbox_arm": (boxes.mailbox_arm, boxes.fake_of(boxes.check_mailbox_arm)),
    "mailbox_rearm": (boxes.mailbox_rearm, boxes.fake_of(boxes.check_mailbox_rearm)),
    "mailbox_take": (boxes.mailbox_take, boxes.mailbox_take_fake),
    "attn_res_take": (attn_res.attn_res_take, attn_res.attn_res_take_fake),
    "attn_res_take_into": (attn_res.attn_res_take_into, attn_res.attn_res_take_into_fake),
    "oproj_publish": (oproj.oproj_publish, boxes.fake_of(oproj.check_oproj_publish)),
    "oproj_push": (oproj.oproj_push, boxes.fake_of(oproj.check_oproj_push)),
    "shared_expert_push": (oproj.shared_expert_push, boxes.fake_of(oproj.check_shared_expert_push)),
    "moe_front_publish": (front.moe_front_publish, boxes.fake_of(front.check_moe_front_publish)),
    "moe_front_shared_push": (oproj.moe_front_shared_push, boxes.fake_of(oproj.check_moe_front_shared_push)),
    "moe_route_poll": (route.moe_route_poll, route.moe_route_poll_fake),
    "routed_experts_counted": (experts.routed_experts_counted, experts.routed_experts_counted_fake),
    "moe_tail_push": (tail.moe_tail_push, boxes.fake_of(tail.check_moe_tail_push)),
    "moe_tail_publish": (tail.moe_tail_publish, boxes.fake_of(tail.check_moe_tail_publish)),
    "moe_latent_reduce": (tail.moe_latent_reduce, boxes.fake_of(tail.check_moe_latent_reduce)),
    "moe_tail_poll": (tail.moe_tail_poll, boxes.fake_of(tail.check_moe_tail_poll)),
    "moe_tail_serve": (tail.moe_tail_serve, boxes.fake_of(tail.check_moe_tail_serve)),
    "group_barrier": (boxes.group_barrier, boxes.fake_of(boxes.check_group_barrier)),
}
