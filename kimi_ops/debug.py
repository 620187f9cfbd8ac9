"""Debugging the composed decoder: every ``kimi`` op call of a step recorded, then replayed
against its reference (issue 35).

When the decoder guard (:mod:`kimi_ops.testing.guard`) trips, the question is which op
broke. :class:`OpRecorder` is a dispatch mode (off unless entered; nothing runs through
it otherwise) that sees each ``kimi`` op on the decoder's own path, eager: it keeps each
call's inputs as they were (a copy of every tensor but the model's weights), its returned
tensors, and the tensors it wrote (the ``Tensor(a!)`` arguments) after the call.
:func:`replay` runs each call's reference on the recorded inputs and compares.

    with OpRecorder(decoder) as recorder:
        decoder(hidden)
    print_table(replay(recorder.calls))

or ``python -m kimi_ops.debug --config kimi_k3 --batch 8 --layers 3``.
"""

import argparse
import os
import re
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .ops import OPS
from .schemas import NAMESPACE

# Boxes whose rows hold FP32 words as BF16 pairs (the front row's logits): compared as bits.
WORD_BOXES = {("moe_front_publish", "boxes"), ("moe_front_shared_push", "front_boxes")}


class KimiOpMode(TorchDispatchMode):
    """A dispatch mode that hands every ``kimi`` op call to :meth:`kimi_op` (the others
    pass through): the base of the recorder and of the guard's injected bugs."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != NAMESPACE:
            return func(*args, **kwargs)
        return self.kimi_op(func, list(args), kwargs)

    def kimi_op(self, func, args: list, kwargs: dict):
        return func(*args, **kwargs)


def weight_labels(decoder) -> dict[int, tuple[str, str]]:
    """data_ptr → (where a weight lives: ``layer 2 rank 0``, ``embed``; its name in the
    layer: ``front.shared_down``), for every weight buffer of ``decoder`` (its boxes and
    index caches are state, not weights)."""
    labels = {}
    for name, buffer in decoder.named_buffers():
        if name.startswith("boxes.") or name.endswith("index_cache"):
            continue
        if match := re.match(r"embed_res\.(.*)", name):
            labels[buffer.data_ptr()] = ("embed", match[1])
        elif match := re.match(r"layers\.(\d+)\.(\d+)\.(.*)", name):
            labels[buffer.data_ptr()] = (f"layer {match[1]} rank {decoder.group.ranks[int(match[2])]}", match[3])
        elif match := re.match(r"attn_res\.(\d+)\.(\d+)\.(.*)", name):
            labels[buffer.data_ptr()] = (f"layer {match[1]}", ("attention", "moe")[int(match[2])] + " residual")
    return labels


def tensors(value):
    """The tensors of an argument or result (a tensor, a list of them, or neither)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


@dataclass
class OpCall:
    """One recorded call: ``inputs`` as the op saw them, ``outputs`` name → tensor (the
    returned tensors as ``out0``…, the written arguments by their schema names)."""

    op: str
    where: str
    weight: str
    inputs: list
    outputs: dict = field(default_factory=dict)


class OpRecorder(KimiOpMode):
    """Records every ``kimi`` op call made while entered (eager calls only: a compiled or
    captured region does not dispatch through Python modes). Weights are kept by
    reference, everything else copied, so a box's later re-arm cannot change a record.
    Each call is labelled with the layer of its weights, or of the last call that had
    weights (situ, the pushes, the barrier)."""

    def __init__(self, decoder):
        super().__init__()
        self.labels = weight_labels(decoder)
        self.calls: list[OpCall] = []
        self.where = "input"

    def keep(self, value):
        if isinstance(value, (list, tuple)):
            return [self.keep(v) for v in value]
        if isinstance(value, torch.Tensor) and value.data_ptr() not in self.labels:
            return value.clone()
        return value

    def kimi_op(self, func, args, kwargs):
        weight = ""
        for tensor in (t for arg in args for t in tensors(arg)):
            if tensor.data_ptr() in self.labels:
                self.where, weight = self.labels[tensor.data_ptr()]
                break
        call = OpCall(func._schema.name.split("::")[1], self.where, weight, self.keep(args))
        result = func(*args, **kwargs)
        for i, tensor in enumerate(tensors(result)):
            call.outputs[f"out{i}"] = tensor.clone()
        for argument, value in zip(func._schema.arguments, args):
            if argument.alias_info is not None and argument.alias_info.is_write:
                for i, tensor in enumerate(tensors(value)):
                    name = argument.name if isinstance(value, torch.Tensor) else f"{argument.name}[{i}]"
                    call.outputs[name] = tensor.clone()
        self.calls.append(call)
        return result


def scale_ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest |got − want| in ulps of the output's scale: each row's (last dim) largest
    |want| sets the ulp (BF16 8 bits, FP32 24, e4m3 4 of significand); NaN = NaN."""
    bits = {torch.bfloat16: 8, torch.float32: 24, torch.float8_e4m3fn: 4}[want.dtype]
    got, want = got.double(), want.double()
    scale = want.abs().nan_to_num(0).amax(-1, keepdim=True).clamp_min(2**-126)
    ulp = torch.exp2(torch.floor(torch.log2(scale)) - (bits - 1))
    diff = (got - want).abs() / ulp
    diff = torch.where(torch.isnan(got) & torch.isnan(want), torch.zeros_like(diff), diff)
    return float(diff.nan_to_num(float("inf")).max()) if diff.numel() else 0.0


@dataclass
class Agreement:
    """One output of one call: max ulps at its scale (None where its bytes are not values:
    ids, index cache rows, the front row's words) and the share of elements not bit-equal."""

    op: str
    where: str
    weight: str
    output: str
    max_ulps: float | None
    not_equal: float


def bit_view(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(
        {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def replay(calls: list[OpCall]) -> list[Agreement]:
    """Each call's reference on its recorded inputs (on their device), against what the
    decoder's path returned and wrote."""
    rows = []
    for call in calls:
        reference, _ = OPS[call.op]
        args = [[t.clone() for t in a] if isinstance(a, list) else a.clone() if isinstance(a, torch.Tensor) else a
                for a in call.inputs]
        schema = getattr(torch.ops.kimi, call.op).default._schema
        result = reference(*args)
        want = {f"out{i}": t for i, t in enumerate(tensors(result))}
        for argument, value in zip(schema.arguments, args):
            if argument.alias_info is not None and argument.alias_info.is_write:
                for i, tensor in enumerate(tensors(value)):
                    want[argument.name if isinstance(value, torch.Tensor) else f"{argument.name}[{i}]"] = tensor
        for name, got in call.outputs.items():
            expected = want[name]
            not_equal = float((bit_view(got) != bit_view(expected)).double().mean()) if got.numel() else 0.0
            values = expected.is_floating_point() and (call.op, name.split("[")[0]) not in WORD_BOXES
            rows.append(Agreement(call.op, call.where, call.weight, name, scale_ulps(got, expected) if values else None, not_equal))
    return rows


def summary(rows: list[Agreement]) -> list[tuple]:
    """(op and its weight, layer, max ulps, largest % not bit-equal) per op call site and
    layer: outputs and ranks merged."""
    merged: dict[tuple, list] = {}
    for row in rows:
        op = f"{row.op} ({row.weight})" if row.weight else row.op
        entry = merged.setdefault((op, re.sub(r" rank \d+", "", row.where)), [None, 0.0])
        if row.max_ulps is not None:
            entry[0] = max(entry[0] or 0.0, row.max_ulps)
        entry[1] = max(entry[1], row.not_equal)
    return [(op, where, ulps, not_equal) for (op, where), (ulps, not_equal) in merged.items()]


def print_table(rows: list[Agreement]) -> None:
    lines = summary(rows)
    width = max(len(op) for op, *_ in lines)
    print(f"{'op (weight)':<{width}s} {'where':<8s} {'max ulps':>9s} {'% not bit-equal':>16s}")
    for op, where, ulps, not_equal in lines:
        shown = "bits" if ulps is None else f"{ulps:.1f}"
        print(f"{op:<{width}s} {where:<8s} {shown:>9s} {100 * not_equal:>15.2f}%")


def main(argv=None) -> list[Agreement]:
    from .config import KimiConfig
    from .runtime.decoder import KimiDecoder

    parser = argparse.ArgumentParser(description="Record one decoder step's kimi ops and replay their references.")
    parser.add_argument("--config", choices=("tiny", "kimi_k3"), default="tiny")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2, help="steps run; the last one is recorded")
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args(argv)
    config = getattr(KimiConfig, args.config)()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"building {args.config} TP{args.tp}, {args.layers} layers on {device} "
          f"(backend {os.environ.get('KIMI_OPS_BACKEND', 'auto')})", flush=True)
    decoder = KimiDecoder(config, args.layers, tp=args.tp, seed=args.seed, device=device)
    gen = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for _ in range(args.steps - 1):
            decoder(torch.randn(args.batch, config.hidden, generator=gen).bfloat16().to(device))
        hidden = torch.randn(args.batch, config.hidden, generator=gen).bfloat16().to(device)
        with OpRecorder(decoder) as recorder:
            decoder(hidden)
        rows = replay(recorder.calls)
    print(f"{len(recorder.calls)} calls, B = {args.batch}: each op's reference on its recorded inputs")
    print_table(rows)
    return rows


if __name__ == "__main__":
    main()
