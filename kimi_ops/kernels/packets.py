"""The numerics of packets on the device: BF16 pairs, butterflies, exact dot products, a
cluster's ordered sums, RMS."""

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Float64, Int32, Uint32

from .ptx import (
    bits_float,
    divide,
    double_words,
    float_bits,
    load_shared_doubles,
    pack_values,
    rsqrt_like_torch,
    store_cluster,
    widened_bf16,
)


@cute.jit
def ordered(x: Float32) -> Uint32:
    """The seeds' monotone uint32 key of a float; NaN maps to 0 (below every number)."""
    bits = float_bits(x)
    key = bits | Uint32(0x80000000)
    if (bits & Uint32(0x80000000)) != Uint32(0):
        key = ~bits
    if x != x:
        key = Uint32(0)
    return key


@cute.jit
def sigmoid(x: Float32) -> Float32:
    """1 / (1 + exp(−x)) with the accurate exp and an IEEE reciprocal, as torch's CUDA
    sigmoid computes it."""
    return Float32(1.0) / (Float32(1.0) + cute.math.exp(-x))


@cute.jit
def situ_value(gate: Float32, up: Float32, beta, linear_beta) -> Float32:
    """situ(g, u) = g · sigmoid(beta · g) · (u + linear_beta) in FP32, left to right
    (kimi_ops.ops.route.situ's rounding points: the caller rounds it once)."""
    return gate * sigmoid(gate * beta) * (up + linear_beta)


@cute.jit
def unpack_bf16(word: Uint32):
    """The two BF16 values of a word as FP32 (low half first)."""
    return bits_float(word << Uint32(16)), bits_float(word & Uint32(0xFFFF0000))


@cute.jit
def unpack_words(words):
    """A packet's BF16 values as FP32 (8 for a 16-byte packet)."""
    return [value for word in words for value in unpack_bf16(word)]


@cute.jit
def widened_packet(words):
    """A packet's BF16 values as FP64 times 2^-896 (ptx.widened_bf16: no cvt)."""
    return [value for word in words for value in widened_bf16(word)]


@cute.jit
def wide_operand(x: Float32) -> Float64:
    """The other operand of a product with a :func:`widened_packet` value: x times 2^896,
    exact for every finite BF16 value (the largest stays below FP64's), so that the
    product is the exact one."""
    return Float64(x) * Float64(2.0**896)


@cute.jit
def wide_dot(weights, values, total: Float64, stride: cutlass.Constexpr[int] = 2) -> Float64:
    """``total`` plus Σ weights[i] · values[i] in order, each product exact (a
    :func:`widened_packet` weight times a :func:`wide_operand`), one FMA each; the
    values' pairs are read from shared memory at ``values`` + q · ``stride``."""
    for q in cutlass.range_constexpr(len(weights) // 2):
        low, high = load_shared_doubles(values + q * stride)
        total = cute.math.fma(weights[2 * q], low, total)
        total = cute.math.fma(weights[2 * q + 1], high, total)
    return total


@cute.jit
def butterfly(value, lanes: cutlass.Constexpr[int], combine=operator.add, stride: cutlass.Constexpr[int] = 1):
    """``combine`` (associative and commutative: +, a max) of ``value`` over each aligned
    group of ``lanes`` lanes (a power of 2), in every lane of the group: log2(lanes)
    butterfly shuffles; ``stride`` (a power of 2): over the group's lanes that many apart
    (the lanes of a group with the same lane % stride), log2(lanes / stride) shuffles."""
    total = value
    for shift in cutlass.range_constexpr(stride.bit_length() - 1, lanes.bit_length() - 1):
        total = combine(total, cute.arch.shuffle_sync_bfly(total, offset=1 << shift))
    return total


@cute.jit
def butterfly_sum(value, lanes: cutlass.Constexpr[int]):
    """Σ of ``value`` over each aligned group of ``lanes`` lanes (:func:`butterfly`)."""
    return butterfly(value, lanes)


@cute.jit
def exact_dot(a, b) -> Float64:
    """Σ a · b of BF16 values (as FP32): FP32 products, exact, added in FP64 in order."""
    total = Float64(0.0)
    for x, y in zip(a, b):
        total += Float64(x * y)
    return total


# A cluster's exchange of per-CTA sums: ``received`` [rows, cluster] FP64 in every CTA, one
# column a CTA; each CTA stores its value of a row into column ``part`` of every CTA's
# (DSMEM; at a cluster of one, its own), a barrier, then every thread adds the columns in
# rank order: the same bits in every CTA and every run. With ``arrived`` (an mbarrier of
# the receiver's, armed for the round's bytes) the stores are st.async, counted on it: the
# receiver waits for its values alone, where a cluster barrier's release also waits for
# every global store issued before it.
@cute.jit
def send_to_cluster(received, row, value: Float64, part, cluster: cutlass.Constexpr[int], arrived=None):
    if cutlass.const_expr(cluster == 1):
        received[row, 0] = value
    elif cutlass.const_expr(arrived is not None):
        words = double_words(value)
        for c in cutlass.range_constexpr(cluster):
            cute.arch.store_async_dsmem(received.iterator + row * cluster + part, words, arrived, c)
    else:
        for c in cutlass.range_constexpr(cluster):
            store_cluster(received.iterator + row * cluster + part, value, c)


@cute.jit
def cluster_barrier(cluster: cutlass.Constexpr[int]):
    """Every CTA's sends landed (release / acquire); a CTA barrier at a cluster of one."""
    if cutlass.const_expr(cluster == 1):
        cute.arch.sync_threads()
    else:
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()


@cute.jit
def cluster_total(received, row, cluster: cutlass.Constexpr[int]) -> Float64:
    """Row ``row``'s sum over the cluster's CTAs, in rank order."""
    total = Float64(0.0)
    for c in cutlass.range_constexpr(cluster):
        total += received[row, c]
    return total


@cute.jit
def clamp(value: Int32, high: Int32) -> Int32:
    result = value
    if value > high:
        result = high
    return result


@cute.jit
def inverse_rms(total: Float64, latent: int, eps: Float32) -> Float32:
    """inv = rsqrt.approx(ss / L + eps) from the exact FP64 ss, rounded to FP32 first, as
    the reference's float32 ss."""
    return rsqrt_like_torch(divide(Float32(total), Float32(latent)) + eps)


@cute.jit
def normalized(values, inv: Float32, scale):
    """A packet of xn = BF16((latent · inv) · gamma) as four BF16x2 words."""
    normed = [(values[i] * inv) * scale[i] for i in range(8)]
    return pack_values(normed)
