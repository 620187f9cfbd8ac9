"""torch.compile(fullgraph=True) of the MoE chain front → route → situ → tail: no graph
breaks, output bit-equal to eager."""

import pytest
import torch
from torch._dynamo.utils import counters

from kimi_ops.config import KimiConfig
from kimi_ops.moe import MoeWeights, moe_step


@pytest.mark.parametrize("batch", [1, 8])
def test_moe_step_compiles_fullgraph_bit_equal(batch):
    config = KimiConfig.tiny()
    gen = torch.Generator().manual_seed(batch)
    weights = MoeWeights.random(config, gen)
    x = torch.randn(batch, config.hidden, generator=gen).bfloat16()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(moe_step, fullgraph=True)
    got = compiled(x, weights, config)
    assert not counters["graph_break"]
    assert torch.equal(got, moe_step(x, weights, config))
    assert got.abs().float().sum() > 0
