"""Bad input raises a KimiArgumentError naming the argument and the expectation; nothing
is written."""

import pytest
import torch

from kimi_ops import KimiArgumentError
from samples import sample_args

kimi = torch.ops.kimi
gen = torch.Generator().manual_seed(7)


def replace(args, index, value):
    return args[:index] + (value,) + args[index + 1 :]


# (op, argument index, bad value from the good one, words the message must hold)
CASES = [
    ("moe_route", 0, lambda t: t.double(), ["'logits'", "torch.float32"]),
    ("moe_route", 0, lambda t: t[:, :8].contiguous(), ["'logits.shape[1] (experts)'", "[16, 1024]"]),
    ("moe_route", 0, lambda t: torch.zeros(t.shape[0], 2048), ["experts", "1024"]),
    ("moe_route", 1, lambda t: t[:32], ["'bias'", "[64]"]),
    ("moe_route", 1, lambda t: t.to("meta"), ["'bias'", "on cpu"]),
    ("moe_front", 1, lambda t: t[:, :64].contiguous(), ["'w'", "[*, 128]"]),
    ("moe_front", 2, lambda n: 81, ["'n_logits'", "[0, 80]"]),
    ("situ", 0, lambda t: t[:, :95].contiguous(), ["'gate_up'", "even"]),
    ("situ", 0, lambda t: t.half(), ["'gate_up'", "torch.float32 or torch.bfloat16"]),
    ("situ", 0, lambda t: t.t(), ["'gate_up'", "contiguous"]),
    ("moe_tail", 0, lambda t: t[:, :8].contiguous(), ["'expanded'", "[*, 16, *]"]),
    ("moe_tail", 1, lambda t: t.float(), ["'weights'", "torch.bfloat16"]),
    ("moe_tail", 2, lambda t: t[:, :10].contiguous(), ["'shared'", "[3, 96]"]),
    ("moe_tail", 4, lambda t: t[:, :32].contiguous(), ["'w_up'", "[*, 64]"]),
    ("oproj", 1, lambda t: t.float(), ["'w'", "torch.bfloat16"]),
    ("oproj", 0, lambda t: t[None], ["'x'", "[*, *]"]),
    ("dsa_index_front", 1, lambda t: t[:2048].contiguous(), ["'wq_b'", "[4096, 96]"]),
    ("dsa_index_front", 2, lambda t: t[:, :16].contiguous(), ["'head_in'", "[3, 32]"]),
    ("dsa_index_front", 3, lambda t: t[:48].contiguous(), ["'q_norm_w'", "[96]"]),
    ("dsa_index_key_insert", 0, lambda t: t[:, :64].contiguous(), ["'k_in'", "[*, 128]"]),
    ("dsa_index_key_insert", 4, lambda t: t[:, :128].contiguous(), ["'cache'", "[*, 132]"]),
    ("dsa_index_key_insert", 5, lambda t: t.int(), ["'slots'", "torch.int64"]),
    ("dsa_index_key_insert", 5, lambda t: torch.tensor([0, 99, -1]), ["'slots'", "[-1, 5)", "99"]),
    ("dsa_index_key_insert", 5, lambda t: torch.tensor([0, -7, 1]), ["'slots'", "-7"]),
    ("dsa_index_key_insert", 5, lambda t: torch.tensor([2, -1, 2]), ["'slots'", "distinct"]),
    ("attn_res", 0, lambda t: t[:, :2].contiguous(), ["'blocks'", "[*, 3, 64]"]),
    ("attn_res", 3, lambda t: t[:32].contiguous(), ["'query'", "[64]"]),
    ("attn_res", 5, lambda t: t.float(), ["'out_norm_w'", "torch.bfloat16"]),
]


@pytest.mark.parametrize("name, index, corrupt, words", CASES, ids=lambda c: str(c)[:40])
def test_bad_argument(name, index, corrupt, words):
    args = sample_args(name, 3, gen)
    bad = replace(args, index, corrupt(args[index]))
    on_host = lambda a: isinstance(a, torch.Tensor) and a.device.type != "meta"  # noqa: E731
    snapshot = [a.clone() if on_host(a) else None for a in bad]
    with pytest.raises(KimiArgumentError) as error:
        getattr(kimi, name)(*bad)
    message = str(error.value)
    assert message.startswith(f"kimi::{name}: argument ")
    for word in words:
        assert word in message, message
    for before, after in zip(snapshot, bad):  # nothing written on error
        if before is not None:
            assert torch.equal(before, after)


def test_bad_argument_under_fake_tensors():
    """The fakes run the same checks, so torch.compile reports bad shapes at trace time."""
    args = sample_args("oproj", 3, gen)
    compiled = torch.compile(kimi.oproj, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="argument 'w' must be of shape"):
        compiled(args[0], args[1][:, :32].contiguous())
