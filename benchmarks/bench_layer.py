"""Per-layer decode latency at TP1 on one GPU (issue 25, deliverable 3): the plain-PyTorch
composite (kimi_ops.testing.composite) against our decoder, on the same weights, B in BATCHES.

Per-layer rows (µs per layer: a forward of LAYERS layers over LAYERS, the embedding's
AttnRes shared among them; a 1-layer decoder does not exist: layer counts ≡ 1 mod 3 make
the tail parities collide, so LAYERS = 2):

- eager: the composite launched from the host, back-to-back calls (CUDA events);
- eager graph: the same composite captured in one CUDA graph and replayed;
- compiled: ``torch.compile(mode="reduce-overhead")`` of the composite (Inductor's CUDA
  graphs; the cudagraph skips it counted are reported, 0 expected), back-to-back calls;
- ours PDL: ``KimiDecoder`` (TP1 mailboxes) replayed from one CUDA graph, its kernels
  chained by programmatic dependent launch; ours no PDL: the same in a child process with
  ``KIMI_OPS_PDL=0`` (every kernel starts when its predecessor ended);
- = eager: of ``--replays`` (1000) replays of the captured step on fresh hidden states,
  how many equal an eager step of the decoder bit for bit;
- floor: the weight bytes a layer reads (every weight but the routed experts', plus the
  experts the batch routed to) at 4.3 TB/s.

A forward reads over a GB of weights at kimi_k3 shapes (2 layers), far past the 60 MB L2,
so the layer rows need no weight copies. The breakdown runs each of our ops of layer 0
alone, CUDA-graph replayed, with the real arguments of a forward (its activations and
boxes), every call of the graph on its own copy of the op's weights (copies > 60 MB): µs
against the op's weight floor. A polling op runs with its producer (a poll alone would find
its box re-armed): those rows say ``+``.

    python -m benchmarks.bench_layer [--batches 1 8 64] [--tp8-rank] [--json out.json]
    python -m benchmarks.bench_layer --smoke     # KimiConfig.tiny(), every path once, no timing
    python -m benchmarks.plot_layer out.json     # the breakdown as a PNG

``--tp8-rank``: one TP8 rank's shard shapes with TP1 mailboxes, through a TP1 config whose
widths make the decoder run them (TP8_RANK): o-proj K = 1536, shared 768, core
[1536, 1536]. Not a full rank: routing ranks 112 experts (a rank polls all 896 logits),
and the latent is 512 wide, the nearest width the tail kernel takes (L % 256 == 0; at
L = 448 the tail ran the reference, 235 µs): the front is [112 + 512, 7168] (the rank's
[112 + 448, 7168]), the experts work in L = 512, the tail's up projection is [7168, 512],
7.3 MB (the rank's [896, 3584]: 6.4 MB).
"""

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, replace

import torch

import kimi_ops  # noqa: F401
from kimi_ops import KimiConfig, KimiDecoder, backend
from kimi_ops.debug import KimiOpMode
from kimi_ops.kernels.launch import CARVEOUT, GEMM_ROOM
from kimi_ops.testing import guard
from kimi_ops.testing.composite import CompositeDecoder

from .common import HBM_BYTES_PER_US, L2_BYTES, capture, graph_us, print_table, rotating

BATCHES = (1, 8, 64)
LAYERS = 2
TP8_RANK = dict(attn_out=1536, shared_intermediate=768, experts=112, latent=512)
kimi = torch.ops.kimi


def config_for(args) -> KimiConfig:
    if args.smoke:
        return KimiConfig.tiny()
    config = KimiConfig.kimi_k3(expert_intermediate=args.expert_intermediate)
    return tp8_rank(config) if args.tp8_rank else config


def tp8_rank(config: KimiConfig) -> KimiConfig:
    """``config`` with TP8_RANK's widths (KimiConfig checks them again)."""
    return replace(config, **TP8_RANK)


def stream_us(fn, calls: int = 10, repeats: int = 10) -> float:
    """Median µs per call of ``calls`` back-to-back host calls of ``fn`` (launch cost included)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def expert_bytes(layer, ids) -> int:
    """The routed experts' weight bytes a batch reads: each distinct expert once."""
    per_expert = layer.expert_gate_up[0].nbytes + layer.expert_down[0].nbytes
    return int(ids.unique().numel()) * per_expert


def layer_weight_bytes(composite, ids_per_layer) -> list[int]:
    """Each layer's weight bytes (its index cache excluded; the routed experts by ids)."""
    out = []
    for layer, ids in zip(composite.layers, ids_per_layer):
        fixed = sum(b.nbytes for name, b in layer.named_buffers()
                    if name not in ("index_cache", "expert_gate_up", "expert_down"))
        out.append(fixed + expert_bytes(layer, ids))
    return out


@dataclass
class Unit:
    """One op of layer 0 with its real arguments: ``call(*weights)`` runs it. ``in_layer``:
    its time counts in the layer's Σ (a lone publish does not: its '+' row holds it)."""

    name: str
    call: object
    weights: tuple = ()
    floor_bytes: int = 0
    in_layer: bool = True


def layer_units(decoder, hidden, slots) -> list[Unit]:
    """Layer 0 of rank 0 walked as KimiDecoder.forward drives it, each op run once (its
    outputs are the next op's real arguments); the units re-run them."""
    c, boxes = decoder.config, decoder.boxes
    part, (attn_res, moe_res) = decoder.layers[0][0], decoder.attn_res[0]
    index, oproj, front, tail = part.index, part.oproj, part.front, part.tail
    batch, eps, error = hidden.shape[0], c.eps, boxes.error(0)
    empty = hidden.new_empty((0, batch, c.hidden))
    partial, _, x = decoder.residual(decoder.embed_res, empty, torch.zeros_like(hidden), hidden[None])
    units = []

    def unit(name, call, *weights, extra_bytes=0, in_layer=True):
        units.append(Unit(name, call, weights, sum(w.nbytes for w in weights) + extra_bytes, in_layer))
        return call(*weights)

    q_c, head_in, k_in = unit("oproj wq_a + w_head + wk", lambda w: kimi.oproj(x, w), index.w_in).split(
        index.sizes, dim=1)
    if batch <= decoder.embedding_folds_to:  # a step's first layer: the embedding's AttnRes inside (once a step)
        norm_w = decoder.embed_res.out_norm_w
        unit("normed_oproj the same, layer 0 (the embedding's AttnRes folded)",
             lambda w: kimi.normed_oproj(hidden, w, norm_w, eps), index.w_in, extra_bytes=norm_w.nbytes,
             in_layer=False)
    unit("dsa_index_front_keys", lambda w: kimi.dsa_index_front_keys(
        q_c, w, head_in, index.q_norm_w, k_in, index.k_norm_w, index.k_norm_b, eps, index.index_cache, slots),
        index.wq_b, extra_bytes=index.q_norm_w.nbytes + index.k_norm_w.nbytes + index.k_norm_b.nbytes)
    attn = unit("oproj core", lambda w: kimi.oproj(q_c, w), oproj.w_core)
    attn_boxes = boxes.peers("attn", 0)
    unit("oproj_publish", lambda w: kimi.oproj_publish(attn, w, attn_boxes, 0), oproj.w_o, in_layer=False)

    res_bytes = 3 * 2 * c.hidden

    def take_attn(w, partial=partial):
        kimi.oproj_publish(attn, w, attn_boxes, 0)
        return decoder.residual_take(attn_res, boxes.own("attn", 0), empty, partial, batch, error, boxes.moe_input(0))

    partial, _, x = unit("oproj_publish + attn_res_take", take_attn, oproj.w_o, extra_bytes=res_bytes)
    front_boxes = boxes.peers("front", 0)
    unit("moe_front_publish", lambda w: kimi.moe_front_publish(x, w, c.experts, front_boxes, front.parity, 0),
         front.front, in_layer=False)

    def route(w):
        kimi.moe_front_publish(x, w, c.experts, front_boxes, front.parity, 0)
        return kimi.moe_route_poll(boxes.own("front", 0), front.bias, c.routed_scale, c.renorm, front.parity,
                                   batch, error)  # uncounted: the experts below run alone

    ids, weights, latent = unit("moe_front_publish + moe_route_poll", route, front.front,
                                extra_bytes=front.bias.nbytes)
    fused = front.fused_shared
    act = unit("gate_up_situ shared gate_up", lambda w: kimi.gate_up_situ(x, w, 1.0, 0.0), front.shared_gate_up,
               in_layer=not fused)
    rs_boxes, latent_boxes = boxes.peers("rs", 0), boxes.peers("latent", 0)
    unit("oproj_push shared down", lambda w: kimi.oproj_push(act, w, rs_boxes, front.parity, 0), front.shared_down,
         in_layer=not fused)
    shared_act, shared_ticket = boxes.shared(0)
    inside = front.fronts_shared()
    unit("shared_expert_push (the two above, one launch)", lambda g, d: kimi.shared_expert_push(
        x, g, d, 1.0, 0.0, shared_act, shared_ticket, rs_boxes, front.parity, 0, error),
        front.shared_gate_up, front.shared_down, in_layer=fused and not inside)
    # in the layer its route poll is timed with the front publish's unit above
    unit("moe_front_shared_push (the front publish and the shared expert, one launch)",
         lambda f, g, d: kimi.moe_front_shared_push(x, f, c.experts, front_boxes, g, d, 1.0, 0.0, shared_act,
                                                    shared_ticket, rs_boxes, front.parity, 0, error),
         front.front, front.shared_gate_up, front.shared_down, in_layer=inside)
    shared = kimi.oproj(act, front.shared_down)  # the same rows, for the tail chain's push
    unit("moe_tail_push", lambda: kimi.moe_tail_push(shared, rs_boxes, front.parity, 0), in_layer=False)
    expanded = unit("routed experts (stand-in)", lambda g, d: kimi.routed_experts(latent, ids, g, d, 0, 1),
                    front.expert_gate_up, front.expert_down)
    units[-1].floor_bytes = expert_bytes(front, ids)  # only the distinct experts routed to
    unit("moe_tail_publish", lambda: kimi.moe_tail_publish(expanded, weights, latent_boxes, tail.parity, 0),
         in_layer=False)

    def tail_chain(w, partial=partial):  # the decoder's serving path (TP1); the push stands in for oproj_push's
        kimi.moe_tail_push(shared, rs_boxes, tail.parity, 0)
        kimi.moe_tail_serve(expanded, weights, latent_boxes, boxes.own("rs", 0), tail.gamma, w, eps,
                            boxes.peers("out", 0), error, tail.parity, tail.rearm, c.capacity if tail.wrap else batch, 0)
        return decoder.residual_take(moe_res, boxes.own("out", 0), empty, partial, batch, error)

    unit("tail: push + moe_tail_serve + attn_res_take", tail_chain, tail.w_up,
         extra_bytes=tail.gamma.nbytes + res_bytes)
    return units


def rotating_unit(unit: Unit):
    """A call of the unit on the next copy of its weights (copies > L2; the graph captures
    the rotation), and how many calls a graph should hold."""
    if not unit.weights:
        return unit.call, 20
    nbytes = sum(w.nbytes for w in unit.weights)
    read = unit.floor_bytes or nbytes  # the experts read only the routed rows
    copies = max(2, int(L2_BYTES // max(read, 1)) + 1)
    copies = min(copies, max(2, int(8e9 // nbytes)))  # the experts' whole arrays: bounded memory
    sets = [unit.weights] + [tuple(w.clone() for w in unit.weights) for _ in range(copies - 1)]
    return rotating(lambda weights: unit.call(*weights), sets), max(20, copies)


class RoutedIds(KimiOpMode):
    """The decoder's routed ids per layer (``moe_route_poll``'s first output), eager."""

    def __init__(self):
        super().__init__()
        self.ids = []

    def kimi_op(self, func, args, kwargs):
        out = func(*args, **kwargs)
        if func._schema.name == "kimi::moe_route_poll":
            self.ids.append(out[0])
        return out


def same_routes(ours, theirs) -> torch.Tensor:
    """Per token: True where both routed it to the same 16 experts in every layer."""
    same = torch.ones(ours[0].shape[0], dtype=torch.bool, device=ours[0].device)
    for a, b in zip(ours, theirs, strict=True):
        same &= (a.long().sort(-1).values == b.long().sort(-1).values).all(-1)
    return same


def rel_l2(got, want) -> torch.Tensor:
    """Per-token relative L2 error of got against want."""
    return (got.float() - want.float()).norm(dim=-1) / want.float().norm(dim=-1).clamp_min(1e-30)


def attempt(row, key, measure_fn) -> None:
    """row[key] = measure_fn(); a composite column that fails says why (row[key + '_error'])
    instead of ending the run."""
    try:
        row[key] = measure_fn()
    except Exception as error:  # noqa: BLE001 (a peer's failure is a result, not our crash)
        row[key + "_error"] = f"{type(error).__name__}: {error}"
        print(f"warning: {key} at B = {row['B']} failed: {row[key + '_error']}", file=sys.stderr)


def compiled_us(composite, hidden, slots, want, row) -> float:
    """torch.compile(mode="reduce-overhead") of the composite, back-to-back calls; records in
    ``row`` the cudagraph skips Inductor counted (0 expected) and how far its h is from
    ours (Inductor fuses across the composite's BF16 roundings)."""
    from torch._dynamo.utils import counters

    compiled = torch.compile(composite, mode="reduce-overhead", fullgraph=True, dynamic=False)
    skips = counters["inductor"]["cudagraph_skips"]
    us = stream_us(lambda: compiled(hidden, slots))
    row["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips
    row["compiled_rel_l2_max"] = float(rel_l2(compiled(hidden, slots)[0], want).max())
    return us


def inputs(config, batch, device):
    gen = torch.Generator().manual_seed(batch)
    return torch.randn(batch, config.hidden, generator=gen).bfloat16().to(device), torch.arange(batch, device=device)


def ours_us(decoder, hidden, slots) -> float:
    with torch.no_grad():
        return graph_us(lambda: decoder(hidden, slots), calls=10, replays=20) / decoder.num_layers


def replays_equal(decoder, hidden, slots, replays: int) -> int:
    """Of ``replays`` replays of one captured step, each on fresh hidden states, how many
    equal an eager step of the same decoder bit for bit (the steps alternate: a step leaves
    the boxes as the next one needs them, whoever runs it)."""
    static = hidden.clone()
    with torch.no_grad():
        graph, out = capture(lambda: decoder(static, slots), warmups=1)
        gen = torch.Generator(device=hidden.device).manual_seed(7)
        same = 0
        for _ in range(replays):
            static.copy_(torch.randn(hidden.shape, generator=gen, device=hidden.device).bfloat16())
            graph.replay()
            same += int(torch.equal(out, decoder(static.clone(), slots)))
    decoder.check()
    return same


def add_ab_options(parser) -> None:
    """The A/B arms of issue 37's chain: the token groups from which the polled tail runs
    as the wave (PollNormFront + WaveMoeTail) instead of MoeTail, those up to which the
    wave runs its own front (one launch), the fused shared expert's place in the chain and the front's publish inside it. The
    compiled-in arms are settings of the environment
    (kimi_ops/kernels/launch.py), named in the title and the JSON: KIMI_OPS_SMEM_CARVEOUT
    (every kernel's preferred shared-memory carveout, %) and KIMI_OPS_GEMM_ROOM (KB every
    decode-GEMM ring leaves its SM)."""
    parser.add_argument("--wave-from-groups", type=int, default=0, metavar="G",
                        help="the polled tail as the wave from G 8-token groups on (0: the kernels' own rule)")
    parser.add_argument("--wave-front-groups", type=int, default=0, metavar="G",
                        help="the wave with its own front up to G 8-token groups, where its xn fits (0: never)")
    parser.add_argument("--shared-last", action="store_true",
                        help="the fused shared expert after the routed experts, routing waiting for its "
                             "predecessor (the chain before it led)")
    parser.add_argument("--front-apart", action="store_true",
                        help="the front's publish in a launch of its own before the fused shared expert "
                             "(not inside it: kimi::moe_front_shared_push)")


def apply_ab_options(args) -> None:
    """Before the decoder prepares its kernels (the setting chooses compiles); set on every
    run, so a second ``main`` in one process does not inherit the last arm."""
    poll = backend.KERNELS.get("moe_tail_poll")
    if poll is None:
        if args.wave_from_groups or args.wave_front_groups:
            raise SystemExit("--wave-from-groups and --wave-front-groups choose CuTe kernels: none are registered")
        return
    from kimi_ops.kernels.tail.wave import MIN_POLL_WAVE_GROUPS

    type(poll).min_wave_groups = args.wave_from_groups or MIN_POLL_WAVE_GROUPS  # moe_tail_serve's poll too
    type(poll).front_groups = args.wave_front_groups


def apply_chain_options(decoder, args) -> None:
    """The arm's chain, on a decoder built: the routing kernel it then calls compiles on
    its first (eager) call, before any capture."""
    for layer in decoder.layers:
        layer[0].front.shared_first &= not args.shared_last
        layer[0].front.front_inside &= not args.front_apart


def ab_label(args) -> str:
    """The A/B arm, for titles and file names ('' for the default)."""
    return "".join([f" carveout {CARVEOUT}"] * (CARVEOUT is not None) + [f" room {GEMM_ROOM // 1024} KB"] * bool(GEMM_ROOM)
                   + [f" wave from {args.wave_from_groups}"] * bool(args.wave_from_groups)
                   + [f" wave front to {args.wave_front_groups}"] * bool(args.wave_front_groups)
                   + [" shared last"] * args.shared_last + [" front apart"] * args.front_apart)


def ab_settings(args) -> dict:
    """The arm's settings, for the JSON."""
    return {"smem_carveout": CARVEOUT, "gemm_room_kb": GEMM_ROOM // 1024, "wave_from_groups": args.wave_from_groups,
            "wave_front_groups": args.wave_front_groups}


def ab_arguments(args) -> list[str]:
    """The arm's options, for without_pdl's child (which inherits the environment's)."""
    return (["--wave-from-groups", str(args.wave_from_groups)] * bool(args.wave_from_groups)
            + ["--wave-front-groups", str(args.wave_front_groups)] * bool(args.wave_front_groups)
            + ["--shared-last"] * args.shared_last + ["--front-apart"] * args.front_apart)


def without_pdl(args) -> dict:
    """{B: ours µs per layer} from a child process whose kernels launch without PDL (the
    setting is compiled in: a process of its own, a cache key of its own)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ours.json")
        command = [sys.executable, "-m", __spec__.name, "--ours-only", "--json", path,
                   "--expert-intermediate", str(args.expert_intermediate), "--batches", *map(str, args.batches)]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package's parent: -m finds it
        subprocess.run(command + ["--tp8-rank"] * args.tp8_rank + ["--two-op-shared"] * args.two_op_shared
                       + ab_arguments(args),
                       check=True, cwd=root,
                       env={**os.environ, "KIMI_OPS_PDL": "0"})
        with open(path) as f:
            return {int(b): us for b, us in json.load(f).items()}


def guard_row(decoder, batch, row) -> None:
    """The decoder guard (kimi_ops.testing.guard): three steps of ours against the same
    decoder under the reference backend, inside the reference's spread under nudges."""
    verdict = guard.guard(decoder, guard.random_steps(decoder, batch, seed=100 + batch))
    row.update(guard_drift=verdict.drift, guard_spread=verdict.spread, guard_margin=verdict.margin)


def measure(decoder, composite, batch, smoke, replays) -> dict:
    """One batch: the layer row and the breakdown (timings None in smoke mode)."""
    config, layers = decoder.config, decoder.num_layers
    device = decoder.boxes.error(0).device
    hidden, slots = inputs(config, batch, device)
    trace, routed = {}, RoutedIds()
    with torch.no_grad():
        got, _ = composite(hidden, slots, trace)
        with routed:
            want = decoder(hidden, slots)
    err = rel_l2(got, want)
    same = same_routes(routed.ids, trace["ids"])  # TP1: one routing a layer
    floors = layer_weight_bytes(composite, trace["ids"])
    floor = sum(floors) / layers / HBM_BYTES_PER_US
    row = {"B": batch, "eager_us": None, "eager_graph_us": None, "compiled_us": None, "ours_us": None,
           "ours_no_pdl_us": None, "floor_us": floor, "cudagraph_skips": None, "replays": 0, "replays_equal": None,
           "rel_l2_max": float(err.max()), "rel_l2_mean": float(err.mean()), "compiled_rel_l2_max": None,
           "same_routes": float(same.double().mean()),
           "rel_l2_max_same_routes": float(err[same].max()) if bool(same.any()) else None}
    guard_row(decoder, batch, row)
    cuda = hidden.is_cuda
    if cuda and not smoke:
        row["ours_us"] = ours_us(decoder, hidden, slots)
        row["replays"], row["replays_equal"] = replays, replays_equal(decoder, hidden, slots, replays)
        with torch.no_grad():
            attempt(row, "eager_us", lambda: stream_us(lambda: composite(hidden, slots)) / layers)
            attempt(row, "eager_graph_us",
                    lambda: graph_us(lambda: composite(hidden, slots), calls=10, replays=20) / layers)
            attempt(row, "compiled_us", lambda: compiled_us(composite, hidden, slots, want, row) / layers)
    elif cuda:  # smoke on a GPU: every path once (the compiled one too)
        compiled = torch.compile(composite, mode="reduce-overhead", fullgraph=True, dynamic=False)
        with torch.no_grad():
            compiled(hidden, slots)
    breakdown = []
    for unit in layer_units(decoder, hidden, slots):
        if cuda and not smoke:
            call, calls = rotating_unit(unit)
            us = graph_us(call, calls=calls)
        else:  # the timed path's call (weights rotated), once
            rotating_unit(unit)[0]()
            us = None
        breakdown.append({"op": unit.name, "us": us, "floor_us": unit.floor_bytes / HBM_BYTES_PER_US,
                          "weight_bytes": unit.floor_bytes, "in_layer": unit.in_layer})
    decoder.check()  # every poll of the breakdown found its rows
    decoder.reset()  # the lone publishes left rows in the boxes
    return {"row": row, "breakdown": breakdown}


NOTES = [
    ("µs per layer: a forward of LAYERS layers / LAYERS (the embedding AttnRes shared among them; up to "
     "KimiDecoder.embedding_folds_to inside layer 0's stacked GEMM, kimi::normed_oproj)"),
    "ours PDL / no PDL: KimiDecoder CUDA-graph replayed, kernels chained by PDL / launched without it "
    "(KIMI_OPS_PDL=0, a child process)",
    "compiled: torch.compile(mode='reduce-overhead') of the composite; cudagraph_skips should be 0",
    "err eager / err comp.: the largest per-token relative L2 error of the composite's h (eager / compiled) "
    "against ours",
    "same route: the tokens the composite and ours routed to the same 16 experts in every layer; err same: "
    "err eager over those tokens alone (a near-tie routing flip moves a token's h by far more than rounding)",
    "floor: weight bytes (routed experts: the distinct experts routed to) at 4.3 TB/s; activations not counted",
    "= eager: graph replays on fresh inputs equal to eager steps, bit for bit",
    "guard: ours against the reference backend on the same decoder (3 steps), per-token relative L2 at q50 / q90, "
    "inside FACTOR x the reference's own spread under one-ulp nudges of 0.1 % of the inputs (margin <= 1 passes)",
    "breakdown: each op of layer 0 graph-replayed alone on its real arguments, weights rotated past L2; "
    "a poll runs with its producer ('+' rows)",
]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--tp8-rank", action="store_true", help="one TP8 rank's shard shapes, TP1 mailboxes")
    parser.add_argument("--expert-intermediate", type=int, default=16, help="the routed experts' width (a stand-in)")
    parser.add_argument("--json", help="write the rows and breakdowns here")
    parser.add_argument("--smoke", action="store_true", help="KimiConfig.tiny(), every path once, no timing")
    parser.add_argument("--replays", type=int, default=1000, help="graph replays checked against eager steps")
    parser.add_argument("--two-op-shared", action="store_true",
                        help="the shared expert as gate_up_situ + oproj_push (the A/B of its fused launch)")
    add_ab_options(parser)
    parser.add_argument("--skip-no-pdl", action="store_true", help="no 'ours no PDL' column (its child recompiles all)")
    parser.add_argument("--ours-only", action="store_true",
                        help="µs a layer of ours alone, by batch (A/B runs; without_pdl's child): printed, and to --json")
    args = parser.parse_args(argv)
    config = config_for(args)
    torch._dynamo.config.cache_size_limit = 64  # a compiled graph per batch: more than the default 8
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not args.smoke and device != "cuda":
        raise SystemExit("bench_layer times CUDA graphs: it needs a GPU (--smoke runs anywhere)")
    if device == "cuda":
        apply_ab_options(args)
    name = "tiny" if args.smoke else "kimi_k3 TP8 rank" if args.tp8_rank else "kimi_k3"
    decoder = KimiDecoder(config, LAYERS, tp=1, seed=0, device=device)
    for layer in decoder.layers:
        layer[0].front.fused_shared &= not args.two_op_shared
    apply_chain_options(decoder, args)
    if args.ours_only:
        times = {b: ours_us(decoder, *inputs(config, b, device)) for b in args.batches}
        print(json.dumps(times))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(times, f)
        return times
    composite = CompositeDecoder(decoder)
    results = {b: measure(decoder, composite, b, args.smoke, args.replays) for b in args.batches}
    if not (args.smoke or args.skip_no_pdl):
        for b, us in without_pdl(args).items():
            results[b]["row"]["ours_no_pdl_us"] = us
    where = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"{where}, {name} TP1{ab_label(args)}, {LAYERS}-layer KimiDecoder, median µs per layer"
          + (" (smoke: no timing)" if args.smoke else ""))
    columns = ("B", "eager", "eager graph", "compiled", "ours no PDL", "ours PDL", "floor", "ours/floor",
               "comp./ours", "skips", "= eager", "err eager", "err comp.", "same route", "err same")
    rows = []
    for b, result in results.items():
        r = result["row"]
        ratio = r["ours_us"] / r["floor_us"] if r["ours_us"] else None
        speedup = r["compiled_us"] / r["ours_us"] if r["ours_us"] and r["compiled_us"] else None
        rows.append(tuple("-" if v is None else v for v in (
            b, r["eager_us"], r["eager_graph_us"], r["compiled_us"], r["ours_no_pdl_us"], r["ours_us"], r["floor_us"],
            ratio, speedup, r["cudagraph_skips"], f"{r['replays_equal']}/{r['replays']}" if r["replays"] else None,
            f"{r['rel_l2_max']:.2e}", None if r["compiled_rel_l2_max"] is None else f"{r['compiled_rel_l2_max']:.2e}",
            f"{100 * r['same_routes']:.1f}%",
            None if r["rel_l2_max_same_routes"] is None else f"{r['rel_l2_max_same_routes']:.2e}")))
    print_table(rows, columns)
    print("\nguard: drift of ours from the reference backend vs the reference's spread (per-token relative L2)")
    print_table([(b, *(f"{v:.4f}" for v in r["row"]["guard_drift"] + r["row"]["guard_spread"]),
                  f"{r['row']['guard_margin']:.2f}") for b, r in results.items()],
                ("B", "drift q50", "drift q90", "spread q50", "spread q90", "margin"))
    for b, result in results.items():
        ops = result["breakdown"]
        width = max(len(op["op"]) for op in ops)
        print(f"\nbreakdown, B = {b}: µs per call; floor: the op's weight bytes; * not in the layer's Σ")
        print(f"{'op':<{width + 2}s} {'ours':>10s} {'floor':>10s} {'ours/floor':>10s}")
        layer = [op for op in ops if op["in_layer"]]
        total = None if any(op["us"] is None for op in layer) else sum(op["us"] for op in layer)
        for op in ops + [{"op": "Σ of the layer's ops", "us": total, "in_layer": True,
                          "floor_us": sum(op["floor_us"] for op in layer)}]:
            us, ratio = ("-", "-") if op["us"] is None else (f"{op['us']:.2f}", f"{op['us'] / op['floor_us']:.2f}"
                                                             if op["floor_us"] else "-")
            mark = " " if op["in_layer"] else "*"
            print(f"{op['op']:<{width}s} {mark} {us:>10s} {op['floor_us']:10.2f} {ratio:>10s}")
    for note in NOTES:
        print("note:", note)
    out = {"device": where, "config": name, "shapes": asdict(config), "layers": LAYERS, "smoke": args.smoke,
           **ab_settings(args),
           "notes": NOTES, "rows": [r["row"] for r in results.values()],
           "breakdown": {str(b): r["breakdown"] for b, r in results.items()}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
