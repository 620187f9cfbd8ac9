"""Bad inputs a serving engineer hits first (issue 39), each refused with the argument they
passed named, and the box rules' byte ranges: views carved from one allocation without
sharing bytes are distinct buffers."""

import pytest
import torch

from kimi_ops import KimiArgumentError, KimiConfig, KimiDecoder
from kimi_ops.mailbox import SENTINEL

kimi = torch.ops.kimi
CONFIG = KimiConfig.tiny()


@pytest.fixture(scope="module")
def decoder():
    return KimiDecoder(CONFIG, 2, seed=0)


@pytest.mark.parametrize("view", ["columns", "transpose"])
def test_forward_names_a_non_contiguous_hidden(decoder, view):
    base = torch.randn(4, 2 * CONFIG.hidden).bfloat16()
    hidden = base[:, ::2] if view == "columns" else torch.randn(CONFIG.hidden, 4).bfloat16().t()
    with pytest.raises(KimiArgumentError, match=r"hidden must be contiguous"):
        decoder(hidden)


def test_forward_names_non_contiguous_slots(decoder):
    slots = torch.arange(8)[::2]
    with pytest.raises(KimiArgumentError, match=r"slots must be contiguous int64 \[4\]"):
        decoder(torch.randn(4, CONFIG.hidden).bfloat16(), slots)


def test_meta_device_is_refused_at_construction():
    with pytest.raises(KimiArgumentError, match=r"device must be 'cpu' or a CUDA device, got meta"):
        KimiDecoder(CONFIG, 2, device="meta")
    with pytest.raises(KimiArgumentError, match=r"target must be 'cpu' or a CUDA device, got meta"):
        KimiDecoder(CONFIG, 2, target="meta")


@pytest.mark.parametrize("field, value", [("eps", True), ("routed_scale", False), ("top_k", 16.0)])
def test_config_refuses_bools_and_floats_for_its_fields(field, value):
    with pytest.raises(KimiArgumentError, match=field):
        KimiConfig.tiny(**{field: value})


def boxes_of_one_allocation(count, shape):
    whole = torch.empty(count, *shape, dtype=torch.bfloat16)
    for box in whole:
        kimi.mailbox_arm(box)
    return whole, list(whole)


def test_boxes_carved_from_one_allocation_are_distinct():
    """a[0] and a[1] share a storage but no byte: the op takes them and writes each."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    w = torch.randn(32, 64, generator=gen).bfloat16()
    whole, boxes = boxes_of_one_allocation(2, (1, 2, 8, 32))
    separate = [box.clone() for box in boxes]
    kimi.oproj_publish(x, w, boxes, 1)
    kimi.oproj_publish(x, w, separate, 1)
    assert torch.equal(whole, torch.stack(separate))
    assert not (whole[:, 0, 1, :3].view(torch.int32) == SENTINEL).any()


def test_overlapping_views_are_still_refused():
    whole, boxes = boxes_of_one_allocation(2, (1, 2, 8, 32))
    x, w = torch.randn(3, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    flat = whole.view(-1)
    overlapping = flat[8 * 32 : 8 * 32 + boxes[0].numel()].view(boxes[0].shape)  # half of box 0, half of box 1
    with pytest.raises(KimiArgumentError, match="a buffer of its own"):
        kimi.oproj_publish(x, w, [boxes[0], overlapping], 0)


def test_slots_may_live_in_the_cache_allocation():
    gen = torch.Generator().manual_seed(1)
    k_in = torch.randn(2, 128, generator=gen).bfloat16()
    norm_w, norm_b = torch.ones(128).bfloat16(), torch.zeros(128).bfloat16()
    storage = torch.zeros(4 * 132 + 16, dtype=torch.uint8)
    cache, slots = storage[: 4 * 132].view(4, 132), storage[4 * 132 :].view(torch.int64)
    slots.copy_(torch.tensor([2, 0]))
    want = torch.zeros(4, 132, dtype=torch.uint8)
    kimi.dsa_index_key_insert(k_in, norm_w, norm_b, 1e-6, want, slots.clone())
    kimi.dsa_index_key_insert(k_in, norm_w, norm_b, 1e-6, cache, slots)
    assert torch.equal(cache, want) and cache[2].any()
