"""The ``kimi`` op schemas: the one source of truth.

Python registration (:mod:`kimi_ops.ops.registry`) defines the ops from this table, and
``python -m kimi_ops.stubs`` renders the C++ ``TORCH_LIBRARY(kimi, m)`` declarations of
``csrc_stubs/`` from it (a test keeps the committed C++ equal to the table). Names and
argument order are the public contract of DESIGN §3; every buffer an op writes is
marked ``Tensor(a!)``.
"""

NAMESPACE = "kimi"

SCHEMAS: dict[str, str] = {
    "moe_route": (
        "moe_route(Tensor logits, Tensor bias, float scale, bool renorm)"
        " -> (Tensor ids, Tensor weights)"
    ),
    "moe_front": "moe_front(Tensor x, Tensor w, int n_logits) -> (Tensor logits, Tensor latent)",
    "situ": "situ(Tensor gate_up, float beta, float linear_beta) -> Tensor",
    "moe_tail": (
        "moe_tail(Tensor expanded, Tensor weights, Tensor shared, Tensor gamma,"
        " Tensor w_up, float eps) -> Tensor"
    ),
    "oproj": "oproj(Tensor x, Tensor w) -> Tensor",
    # Not in DESIGN §3: the decoder's first projection over the raw embedding (its AttnRes folded in).
    "normed_oproj": "normed_oproj(Tensor x, Tensor w, Tensor norm_w, float eps) -> Tensor",
    "gate_up_situ": "gate_up_situ(Tensor x, Tensor w, float beta, float linear_beta) -> Tensor",
    "dsa_index_front": (
        "dsa_index_front(Tensor rows, Tensor wq_b, Tensor head_in, Tensor? q_norm_w,"
        " float eps) -> (Tensor q, Tensor head_w)"
    ),
    "dsa_index_key_insert": (
        "dsa_index_key_insert(Tensor k_in, Tensor norm_w, Tensor norm_b, float eps,"
        " Tensor(a!) cache, Tensor slots) -> ()"
    ),
    "dsa_index_front_keys": (
        "dsa_index_front_keys(Tensor rows, Tensor wq_b, Tensor head_in, Tensor? q_norm_w, Tensor k_in,"
        " Tensor k_norm_w, Tensor k_norm_b, float eps, Tensor(a!) cache, Tensor slots) -> (Tensor q, Tensor head_w)"
    ),
    "attn_res": (
        "attn_res(Tensor blocks, Tensor partial, Tensor sublayer_out, Tensor query,"
        " Tensor key_norm_w, Tensor out_norm_w, float eps)"
        " -> (Tensor new_partial, Tensor h, Tensor h_normed)"
    ),
    # The routed experts' stand-in (not a seed kernel; DESIGN §2's rows of this rank's experts).
    "routed_experts": (
        "routed_experts(Tensor latent, Tensor ids, Tensor gate_up, Tensor down, int rank, int tp) -> Tensor"
    ),
    # Mailbox ops (DESIGN §4): every buffer written, the peers' boxes included, is marked
    # (x!), one alias set per argument.
    "mailbox_arm": "mailbox_arm(Tensor(a!) box) -> ()",
    "mailbox_rearm": "mailbox_rearm(Tensor(a!) box, int parity, int batch) -> ()",
    "mailbox_take": "mailbox_take(Tensor(a!) box, int parity, int batch, Tensor(b!) error) -> Tensor",
    "attn_res_take": (
        "attn_res_take(Tensor(a!) box, int parity, int batch, Tensor(b!) error, Tensor blocks,"
        " Tensor partial, Tensor query, Tensor key_norm_w, Tensor out_norm_w, float eps)"
        " -> (Tensor new_partial, Tensor h, Tensor h_normed)"
    ),
    "attn_res_take_into": (
        "attn_res_take_into(Tensor(a!) box, int parity, int batch, Tensor(b!) error, Tensor blocks,"
        " Tensor partial, Tensor query, Tensor key_norm_w, Tensor out_norm_w, float eps, Tensor(c!) h_normed)"
        " -> (Tensor new_partial, Tensor h)"
    ),
    "oproj_publish": "oproj_publish(Tensor x, Tensor w, Tensor(a!)[] boxes, int rank) -> ()",
    "oproj_push": "oproj_push(Tensor x, Tensor w, Tensor(a!)[] rs_boxes, int parity, int rank) -> ()",
    "shared_expert_push": (
        "shared_expert_push(Tensor x, Tensor w_gate_up, Tensor w_down, float beta, float linear_beta, Tensor(a!) act,"
        " Tensor(b!) ticket, Tensor(c!)[] rs_boxes, int parity, int rank, Tensor(d!) error) -> ()"
    ),
    "moe_front_publish": (
        "moe_front_publish(Tensor x, Tensor w, int n_logits, Tensor(a!)[] boxes, int parity,"
        " int rank) -> ()"
    ),
    "moe_front_shared_push": (
        "moe_front_shared_push(Tensor x, Tensor w_front, int n_logits, Tensor(a!)[] front_boxes, Tensor w_gate_up,"
        " Tensor w_down, float beta, float linear_beta, Tensor(b!) act, Tensor(c!) ticket, Tensor(d!)[] rs_boxes,"
        " int parity, int rank, Tensor(e!) error) -> ()"
    ),
    "moe_route_poll": (
        "moe_route_poll(Tensor(a!) box, Tensor bias, float scale, bool renorm, int parity,"
        " int batch, Tensor(b!) error, Tensor(c!)? ready=None) -> (Tensor ids, Tensor weights, Tensor latent)"
    ),
    "routed_experts_counted": (
        "routed_experts_counted(Tensor latent, Tensor ids, Tensor gate_up, Tensor down, int rank, int tp,"
        " Tensor(a!) ready, Tensor(b!) error) -> Tensor"
    ),
    "moe_tail_push": "moe_tail_push(Tensor shared, Tensor(a!)[] rs_boxes, int parity, int rank) -> ()",
    "moe_tail_publish": (
        "moe_tail_publish(Tensor expanded, Tensor weights, Tensor(a!)[] latent_boxes,"
        " int parity, int rank) -> ()"
    ),
    "moe_latent_reduce": (
        "moe_latent_reduce(Tensor(a!) recv_box, Tensor(b!)[] gathered_boxes, Tensor(c!) error, int parity,"
        " int rearm_parity, int rearm_batch, int rank, int batch) -> ()"
    ),
    "moe_tail_poll": (
        "moe_tail_poll(Tensor(a!) latent_box, Tensor(b!) rs_box, Tensor gamma, Tensor w_up,"
        " float eps, Tensor(c!)[] out_boxes, Tensor(d!) error, int parity, int rearm_parity,"
        " int rearm_batch, int rank, int batch) -> ()"
    ),
    "moe_tail_serve": (
        "moe_tail_serve(Tensor expanded, Tensor weights, Tensor(a!)[] latent_boxes, Tensor(b!) rs_box, Tensor gamma,"
        " Tensor w_up, float eps, Tensor(c!)[] out_boxes, Tensor(d!) error, int parity, int rearm_parity,"
        " int rearm_batch, int rank) -> ()"
    ),
    "group_barrier": "group_barrier(Tensor(a!)[] boxes, Tensor(b!) ticket, Tensor(c!) error, int rank) -> ()",
}
