"""One TP1 rank's MoE-tail mailboxes outside a decoder: the tail kernels' tests and
benchmarks run the decoder's tail sequence through them."""

import torch


class TailBoxes:
    """One TP1 rank's MoE-tail mailboxes, allocated and armed: ``latent`` [3, 1, CAP, L],
    ``rs`` [3, 1, CAP, H], ``out`` [1, 1, CAP, H] and the ``error`` word. ``tail`` runs one
    MoE tail through them in the decoder's order (push, publish, polled tail); the output
    rows land in ``out``."""

    def __init__(self, capacity: int, latent: int, hidden: int, device):
        def box(parities, width):
            return torch.empty(parities, 1, capacity, width, dtype=torch.bfloat16, device=device)

        self.latent, self.rs, self.out = box(3, latent), box(3, hidden), box(1, hidden)
        self.error = torch.zeros(1, dtype=torch.int32, device=device)
        for mailbox in (self.latent, self.rs, self.out):
            torch.ops.kimi.mailbox_arm(mailbox)

    def tail(self, expanded, weights, shared, gamma, w_up, eps, parity, rearm_parity, rearm_batch,
             serve: bool = False) -> None:
        """``serve``: the push, then moe_tail_serve (publish and poll in one op)."""
        kimi, batch = torch.ops.kimi, expanded.shape[0]
        kimi.moe_tail_push(shared, [self.rs], parity, 0)
        if serve:
            kimi.moe_tail_serve(expanded, weights, [self.latent], self.rs, gamma, w_up, eps, [self.out], self.error,
                                parity, rearm_parity, rearm_batch, 0)
            return
        kimi.moe_tail_publish(expanded, weights, [self.latent], parity, 0)
        kimi.moe_tail_poll(self.latent, self.rs, gamma, w_up, eps, [self.out], self.error, parity, rearm_parity,
                           rearm_batch, 0, batch)
