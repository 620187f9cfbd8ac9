"""Small valid argument tuples of every op, for opcheck, compile and error tests."""

import torch


def rand(gen, *shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def sample_args(name: str, batch: int, gen: torch.Generator) -> tuple:
    if name == "moe_route":
        return rand(gen, batch, 64, dtype=torch.float32), rand(gen, 64, dtype=torch.float32, scale=0.1), 2.5, True
    if name == "moe_front":
        return rand(gen, batch, 128), rand(gen, 32 + 48, 128, scale=0.1), 32
    if name == "situ":
        return rand(gen, batch, 96, dtype=torch.float32), 1.0, 0.0
    if name == "moe_tail":
        return (
            rand(gen, batch, 16, 64), rand(gen, batch, 16, scale=0.2), rand(gen, batch, 96),
            rand(gen, 64, scale=0.1) + 1, rand(gen, 96, 64, scale=0.1), 1e-6,
        )
    if name == "oproj":
        return rand(gen, batch, 64), rand(gen, 48, 64, scale=0.1)
    if name == "normed_oproj":  # raw rows of a scale the norm undoes
        return rand(gen, batch, 64, scale=3.0), rand(gen, 48, 64, scale=0.1), rand(gen, 64) + 1, 1e-6
    if name == "gate_up_situ":  # I = 16
        return rand(gen, batch, 64), rand(gen, 32, 64, scale=0.1), 1.0, 0.0
    if name == "dsa_index_front":
        return rand(gen, batch, 96), rand(gen, 4096, 96, scale=0.1), rand(gen, batch, 32), rand(gen, 96) + 1, 1e-6
    if name == "dsa_index_key_insert":
        cache = torch.randint(0, 256, (batch + 2, 132), dtype=torch.uint8, generator=gen)
        slots = torch.randperm(batch + 2, generator=gen)[:batch]
        return rand(gen, batch, 128), rand(gen, 128) + 1, rand(gen, 128, scale=0.1), 1e-5, cache, slots
    if name == "dsa_index_front_keys":
        rows, wq_b, head_in, q_norm_w, _ = sample_args("dsa_index_front", batch, gen)
        k_in, norm_w, norm_b, eps, cache, slots = sample_args("dsa_index_key_insert", batch, gen)
        return rows, wq_b, head_in, q_norm_w, k_in, norm_w, norm_b, eps, cache, slots
    if name == "attn_res":
        return (
            rand(gen, 2, batch, 64), rand(gen, batch, 64), rand(gen, 2, batch, 64),
            rand(gen, 64, scale=0.1), rand(gen, 64) + 1, rand(gen, 64) + 1, 1e-6,
        )
    if name == "routed_experts":  # E = 32 over TP2, rank 1: half the pairs zero
        ids = torch.stack([torch.randperm(32, generator=gen)[:16] for _ in range(batch)]).to(torch.int32)
        return rand(gen, batch, 64), ids, rand(gen, 32, 2 * 16, 64, scale=0.1), rand(gen, 32, 64, 16, scale=0.2), 1, 2
    if name == "routed_experts_counted":  # the route poll's 2B CTAs counted in
        ready, error = torch.tensor([2 * batch, 0]), torch.zeros(1, dtype=torch.int32)
        return (*sample_args("routed_experts", batch, gen), ready, error)
    return mailbox_sample_args(name, batch, gen)


CAP, TP = 8, 2


def mailbox_sample_args(name: str, batch: int, gen: torch.Generator) -> tuple:
    """Boxes of a TP2 group (CAP 8) filled with published-looking data."""
    error = torch.zeros(1, dtype=torch.int32)
    boxes = lambda *shape: [rand(gen, *shape) for _ in range(TP)]  # noqa: E731
    if name == "mailbox_arm":
        return (rand(gen, 3, TP, CAP, 16),)
    if name == "mailbox_rearm":
        return rand(gen, 3, TP, CAP, 16), 1, batch
    if name == "mailbox_take":
        return rand(gen, 1, TP, CAP, 64), 0, batch, error
    if name in ("attn_res_take", "attn_res_take_into"):
        into = (rand(gen, CAP, 64),) if name == "attn_res_take_into" else ()
        return (
            rand(gen, 1, TP, CAP, 64), 0, batch, error, rand(gen, 2, batch, 64), rand(gen, batch, 64),
            rand(gen, 64, scale=0.1), rand(gen, 64) + 1, rand(gen, 64) + 1, 1e-6, *into,
        )
    if name == "oproj_publish":
        return rand(gen, batch, 64), rand(gen, 48, 64, scale=0.1), boxes(1, TP, CAP, 48), 1
    if name == "oproj_push":  # N = 64 over TP2
        return rand(gen, batch, 64), rand(gen, 64, 64, scale=0.1), boxes(3, TP, CAP, 32), 0, 1
    if name == "shared_expert_push":  # I = 16, N = 64 over TP2
        return (
            rand(gen, batch, 64), rand(gen, 32, 64, scale=0.1), rand(gen, 64, 16, scale=0.1), 1.0, 0.0,
            rand(gen, CAP, 16), torch.zeros(1, dtype=torch.int64), boxes(3, TP, CAP, 32), 0, 1, error,
        )
    if name == "moe_front_publish":  # E = 32, L = 48 over TP2
        return rand(gen, batch, 128), rand(gen, 16 + 24, 128, scale=0.1), 16, boxes(3, 1, CAP, 48 + 64), 2, 1
    if name == "moe_front_shared_push":  # the front publish's, then a shared expert of I = 16, N = 64 over TP2
        x, w_front, n_logits, front_boxes, parity, rank = mailbox_sample_args("moe_front_publish", batch, gen)
        return (
            x, w_front, n_logits, front_boxes, rand(gen, 32, 128, scale=0.1), rand(gen, 64, 16, scale=0.1), 1.0, 0.0,
            rand(gen, CAP, 16), torch.zeros(1, dtype=torch.int64), boxes(3, TP, CAP, 32), parity, rank, error,
        )
    if name == "moe_route_poll":
        box = rand(gen, 3, 1, CAP, 48 + 64)
        box[..., 48:] = rand(gen, 3, 1, CAP, 32, dtype=torch.float32).view(torch.bfloat16)
        ready = torch.tensor([5, 0])  # counted: the outputs' CTAs add to it
        return box, rand(gen, 32, dtype=torch.float32, scale=0.1), 2.5, True, 1, batch, error, ready
    if name == "moe_tail_push":
        return rand(gen, batch, 64), boxes(3, TP, CAP, 32), 0, 1
    if name == "moe_tail_publish":
        return rand(gen, batch, 16, 48), rand(gen, batch, 16, scale=0.2), boxes(3, TP, CAP, 48), 1, 0
    if name == "moe_latent_reduce":  # L = 48 over TP2: chunks of 24
        return rand(gen, 3, TP, CAP, 24), boxes(3, 1, CAP, 48), error, 0, 2, CAP, 1, batch
    if name == "moe_tail_poll":
        return (
            rand(gen, 3, TP, CAP, 48), rand(gen, 3, TP, CAP, 32), rand(gen, 48) + 1,
            rand(gen, 32, 48, scale=0.1), 1e-6, boxes(1, 1, CAP, 64), error, 0, 2, CAP, 1, batch,
        )
    if name == "moe_tail_serve":
        return (
            rand(gen, batch, 16, 48), rand(gen, batch, 16, scale=0.2), boxes(3, TP, CAP, 48), rand(gen, 3, TP, CAP, 32),
            rand(gen, 48) + 1, rand(gen, 32, 48, scale=0.1), 1e-6, boxes(1, 1, CAP, 64), error, 0, 2, CAP, 1,
        )
    if name == "group_barrier":
        return boxes(1, TP, 1, 8), torch.tensor([3]), error, 1
    raise KeyError(name)
