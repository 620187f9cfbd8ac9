"""torch.library.opcheck of every op: schema (mutations declared), fake, aot_dispatch."""

import pytest
import torch

from kimi_ops import SCHEMAS
from samples import sample_args

from conftest import DEVICES


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_opcheck(name, batch, device):
    gen = torch.Generator().manual_seed(batch)
    move = lambda a: a.to(device) if isinstance(a, torch.Tensor) else a  # noqa: E731
    args = tuple([move(t) for t in a] if isinstance(a, list) else move(a) for a in sample_args(name, batch, gen))
    torch.library.opcheck(getattr(torch.ops.kimi, name).default, args)
