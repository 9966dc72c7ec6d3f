"""An independent float64 reference of fusedps' low-precision AdamW state, written from the
algorithm's definition (kernels/quant_math.h's header comment, docs/python.md), not from the
server's code: numpy only, no fusedps.

  * dynamic_map(signed): bitsandbytes' create_dynamic_map (7 exponent bits, 8 bits in all):
    for decade i = 0..6, the midpoints of 2^i + 1 (signed) or 2^(i+1) + 1 (unsigned) evenly
    spaced points on [0.1, 1], times 10^(i-6); signed adds their negatives; then 0 and 1;
    sorted, computed in float64 and rounded once to fp32.
  * adamw_step: one torch.optim.AdamW step (decoupled weight decay) in float64.
  * sparse_adam_rows: one torch.optim.SparseAdam step of an embedding table's pushed rows in
    float64 (duplicate keys summed, as its grad.coalesce()), with decoupled weight decay first
    when set (fusedps' addition; SparseAdam has none).
  * quantize_blocks: per block of 256 (a dense tensor's) or of ``block`` elements (an embedding
    table's: its dim, a scale per row), absmax = max |x| (signed) or max x (unsigned); code =
    the map value nearest to x / absmax, ties away from zero; a block of zeros has absmax 0
    and the code of 0. dequantize: map[code] * absmax, one fp32 multiply.
  * bf16_rne / bf16_neighbours: bf16 rounding and the two bf16 values around a number.

Each check of the server's results against this reference also says where the server may
differ by a rounding: the server computes each step in fp32, so its values differ from the
float64 ones by a few fp32 ulps (error_bound_*), and a rounding or quantization decision can
go the other way only where the reference's value lies that close to a decision boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

BLOCK = 256
MIN_QUANT_NUMEL = 4096
U32 = 2.0 ** -24  # fp32's unit roundoff


def dynamic_map(signed: bool) -> np.ndarray:
    """The 256 values of the dynamic map, ascending, as float64 holding fp32 values."""
    values = []
    for i in range(7):
        points = (2 ** i if signed else 2 ** (i + 1)) + 1
        edges = np.linspace(0.1, 1.0, points)
        means = (edges[:-1] + edges[1:]) / 2.0 * 10.0 ** (i - 6)
        values += list(means)
        if signed:
            values += list(-means)
    values += [0.0, 1.0]
    assert len(values) == 256
    return np.sort(np.asarray(values, dtype=np.float64).astype(np.float32)).astype(np.float64)


SIGNED = dynamic_map(True)
UNSIGNED = dynamic_map(False)


@dataclass
class Hyper:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 1e-2


def adamw_step(h: Hyper, step: int, grad, param, exp_avg, exp_avg_sq):
    """(param, exp_avg, exp_avg_sq) after one AdamW step (step counted from 1), float64."""
    g = np.asarray(grad, np.float64)
    p = np.asarray(param, np.float64) * (1.0 - h.lr * h.weight_decay)
    m = h.beta1 * np.asarray(exp_avg, np.float64) + (1.0 - h.beta1) * g
    v = h.beta2 * np.asarray(exp_avg_sq, np.float64) + (1.0 - h.beta2) * g * g
    bias_correction1 = 1.0 - h.beta1 ** step
    bias_correction2 = 1.0 - h.beta2 ** step
    denom = np.sqrt(v) / np.sqrt(bias_correction2) + h.eps
    return p - h.lr / bias_correction1 * m / denom, m, v


def sparse_adam_rows(h: Hyper, step: int, keys, grads, param, exp_avg, exp_avg_sq):
    """One torch.optim.SparseAdam step (step counted from 1) of a table's pushed rows, float64.

    keys: n row indices, repeats allowed; grads: [n, dim], grads[i] the gradient of row
    keys[i]. param, exp_avg, exp_avg_sq: the [rows, dim] values before the step (the rows not
    pushed are not read). Returns (unique keys ascending, summed gradient rows [u, dim], and
    the new param, exp_avg, exp_avg_sq of those rows, each [u, dim]).

    torch.optim.SparseAdam (torch/optim/_functional.py, sparse_adam), on the coalesced
    gradient's rows only:
        exp_avg += (g - exp_avg) * (1 - beta1)
        exp_avg_sq += (g * g - exp_avg_sq) * (1 - beta2)
        param -= lr * sqrt(1 - beta2^step) / (1 - beta1^step) * exp_avg / (sqrt(exp_avg_sq) + eps)
    preceded, when h.weight_decay != 0, by the decoupled decay param -= lr * weight_decay *
    param (AdamW's; fusedps' addition for tables)."""
    keys = np.asarray(keys, np.int64).reshape(-1)
    grads = np.asarray(grads, np.float64).reshape(len(keys), -1)
    unique, inverse = np.unique(keys, return_inverse=True)
    g = np.zeros((len(unique), grads.shape[1]))
    np.add.at(g, inverse, grads)
    p = np.asarray(param, np.float64)[unique].copy()
    m = np.asarray(exp_avg, np.float64)[unique]
    v = np.asarray(exp_avg_sq, np.float64)[unique]
    if h.weight_decay != 0.0:
        p = p - h.lr * h.weight_decay * p
    m = m + (g - m) * (1.0 - h.beta1)
    v = v + (g * g - v) * (1.0 - h.beta2)
    step_size = h.lr * np.sqrt(1.0 - h.beta2 ** step) / (1.0 - h.beta1 ** step)
    p = p - step_size * m / (np.sqrt(v) + h.eps)
    return unique, g, p, m, v


def error_bound_exp_avg(h: Hyper, grad, exp_avg_old, exp_avg_new) -> np.ndarray:
    """A bound on |fp32 exp_avg - float64 exp_avg| of one step from the same inputs: each of
    the few fp32 operations rounds by at most U32 of its operands' magnitudes (the fp32
    constants 1 - beta1 included), with a factor 2 of margin."""
    g, old, new = (np.abs(np.asarray(a, np.float64)) for a in (grad, exp_avg_old, exp_avg_new))
    return 8 * U32 * (old + (1 - h.beta1) * (g + old) + new) + 1e-45


def error_bound_exp_avg_sq(h: Hyper, grad, exp_avg_sq_old, exp_avg_sq_new) -> np.ndarray:
    """As error_bound_exp_avg, for exp_avg_sq (every term >= 0: no cancellation)."""
    g = np.asarray(grad, np.float64)
    return 8 * U32 * (h.beta2 * np.asarray(exp_avg_sq_old, np.float64) + (1 - h.beta2) * g * g
                      + np.asarray(exp_avg_sq_new, np.float64)) + 1e-45


# -- int8 block-wise quantization -------------------------------------------------------------

def nearest_codes(x: np.ndarray, table: np.ndarray):
    """(codes, distance to the decision boundary) of the values x (in [-1, 1]): the index of
    the nearest table value, ties away from zero; the boundary is the midpoint of the two
    table values around x."""
    x = np.asarray(x, np.float64)
    hi = np.clip(np.searchsorted(table, x, side="left"), 1, len(table) - 1)
    lo = hi - 1
    to_lo, to_hi = x - table[lo], table[hi] - x
    take_hi = (to_hi < to_lo) | ((to_hi == to_lo) & (x > 0))
    codes = np.where(take_hi, hi, lo)
    exact = table[codes] == x
    boundary = np.where(exact, np.inf, np.abs(to_hi - to_lo) / 2)
    return codes.astype(np.int64), boundary


@dataclass
class Quantized:
    codes: np.ndarray        # int64, one per element
    absmax: np.ndarray       # fp32 scale per block (float64 holding the fp32 value)
    near_boundary: np.ndarray  # bool: the code may be off by one at fp32 precision
    block: int = BLOCK       # elements per scale

    def dequantize(self, table: np.ndarray, block: Optional[int] = None) -> np.ndarray:
        """table[code] * absmax, one fp32 multiply (as the server dequantizes), as float32.
        ``block``: elements per scale (default: the one these codes were made with)."""
        block = self.block if block is None else block
        scales = np.repeat(self.absmax, block)[:len(self.codes)].astype(np.float32)
        return table[self.codes].astype(np.float32) * scales


def quantize_blocks(x, table: np.ndarray, error=None, block: int = BLOCK) -> Quantized:
    """x (flat float64) quantized block by block against ``table`` (SIGNED or UNSIGNED),
    ``block`` elements per scale (256: a dense tensor's; an embedding table's dim: a scale per
    row).

    ``error``: a bound on how far the server's fp32 value of each x may be from it; an element
    whose x / absmax lies within the resulting error of a decision boundary is flagged
    near_boundary (so is one whose block's absmax is that uncertain)."""
    x = np.asarray(x, np.float64).reshape(-1)
    error = np.zeros_like(x) if error is None else np.asarray(error, np.float64).reshape(-1)
    n = len(x)
    blocks = -(-n // block)
    padded = np.zeros(blocks * block)
    padded[:n] = x
    magnitude = np.abs(padded) if table[0] < 0 else padded
    absmax = magnitude.reshape(blocks, block).max(axis=1)
    err = np.zeros(blocks * block)
    err[:n] = error
    absmax_err = err.reshape(blocks, block).max(axis=1)  # the max element's own error, at most
    scale = np.repeat(absmax, block)[:n]
    scale_err = np.repeat(absmax_err, block)[:n]
    with np.errstate(divide="ignore", invalid="ignore"):
        normalized = np.where(scale > 0, x / scale, 0.0)
        # |d(x/s)| <= (|dx| + |x/s| |ds|) / s, plus fp32's rounding of the division and of the
        # server's thresholds (fp32 midpoints).
        band = np.where(scale > 0, (error + np.abs(normalized) * scale_err) / scale, 0.0)
    band = 2 * band + 4 * U32 * np.abs(normalized)
    codes, boundary = nearest_codes(normalized, table)
    return Quantized(codes, absmax.astype(np.float32).astype(np.float64), boundary <= band,
                     block)


def recover_codes(pulled, table: np.ndarray, block: int = BLOCK) -> Quantized:
    """The codes and scales behind dequantized int8 state as a server pulls it (table[code] *
    absmax in fp32), ``block`` elements per scale (as quantize_blocks'): per block, absmax is
    the largest value (code 255 stands for 1.0), or, for
    a signed block whose largest magnitude is negative, |min| / |table[0]|; each code is then
    the nearest table value to pulled / absmax (neighbouring map values are 0.35% apart or
    more, far more than that estimate's fp32 error)."""
    pulled = np.asarray(pulled, np.float64).reshape(-1)
    n = len(pulled)
    blocks = -(-n // block)
    padded = np.zeros(blocks * block)
    padded[:n] = pulled
    by_block = padded.reshape(blocks, block)
    absmax = by_block.max(axis=1)
    if table[0] < 0:
        absmax = np.maximum(absmax, -by_block.min(axis=1) / -table[0])
        # A block whose largest magnitude is negative: that estimate may be an fp32 ulp off the
        # server's scale. Take the fp32 value next to it that gives back every pulled value of
        # the block exactly (table[code] * absmax in fp32), as the true scale does.
        t32 = np.asarray(table, np.float32)
        lowest = by_block.min(axis=1)
        for b in np.nonzero((lowest < 0) & (-lowest >= by_block.max(axis=1)))[0]:
            guess = np.float32(absmax[b])
            up = np.nextafter(guess, np.float32(np.inf))
            for candidate in (guess, up, np.nextafter(guess, np.float32(0)),
                              np.nextafter(up, np.float32(np.inf))):
                codes, _ = nearest_codes(by_block[b] / np.float64(candidate), table)
                if np.array_equal((t32[codes] * candidate).astype(np.float64), by_block[b]):
                    absmax[b] = np.float64(candidate)
                    break
    scale = np.repeat(absmax, block)[:n]
    with np.errstate(divide="ignore", invalid="ignore"):
        codes, _ = nearest_codes(np.where(scale > 0, pulled / scale, 0.0), table)
    return Quantized(codes, absmax, np.zeros(n, bool), block)


# -- bf16 -------------------------------------------------------------------------------------

def bf16_neighbours(x):
    """(below, above, ulp) for each x (float64, finite): the bf16 values at or below and above
    |x|'s fp32 value with x's sign, and the bf16 ulp there. Exact bf16 values have
    below == x."""
    f = np.asarray(x, np.float64).astype(np.float32)
    bits = f.view(np.uint32)
    down_bits = bits & np.uint32(0xFFFF0000)
    below = down_bits.view(np.float32).astype(np.float64)
    up_bits = down_bits + np.uint32(0x10000)
    above = up_bits.view(np.float32).astype(np.float64)
    return below, above, np.abs(above - below)


def bf16_rne(x) -> np.ndarray:
    """x rounded to bf16, nearest even, from float64 (float64 holding bf16 values)."""
    x = np.asarray(x, np.float64)
    below, above, ulp = bf16_neighbours(x)
    d_below, d_above = np.abs(x - below), np.abs(above - x)
    even_below = (below.astype(np.float32).view(np.uint32) >> 16) & 1 == 0
    take_above = (d_above < d_below) | ((d_above == d_below) & ~even_below)
    return np.where(take_above, above, below)


def bf16_midpoint_distance(x) -> np.ndarray:
    """How far x is from the rounding boundary between its two bf16 neighbours (float64). (The
    boundaries beyond them are a quarter of an ulp away or more: never within fp32 error.)"""
    below, above, _ = bf16_neighbours(x)
    return np.abs(np.asarray(x, np.float64) - (below + above) / 2)


def is_bf16(x) -> np.ndarray:
    """Whether each value (fp32) is a bf16 value (its low 16 bits are zero)."""
    return (np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFF)) == 0
