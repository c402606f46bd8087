"""fp32 -> bf16 rounding shared by every kernel, and a launcher to cast a tensor with it.

Why integer ops: the Triton interpreter's ``.to(tl.bfloat16)`` truncates (even with ``fp_downcast_rounding``),
while GPUs round to nearest even. Rounding the bit pattern ourselves gives the same bits as
``Tensor.to(torch.bfloat16)`` under the interpreter and on every GPU:

    bits16 = (u32 + 0x7FFF + ((u32 >> 16) & 1)) >> 16        (round half to even)

Overflow past the largest finite bf16 carries into the exponent and gives inf, as IEEE does; +-inf are unchanged
(their low 16 bits are zero); NaN would carry into the sign bit for some payloads, so NaN is written as the
canonical quiet NaN 0x7FC0 (what ``Tensor.to(torch.bfloat16)`` gives on the CPU; torch's CUDA cast may write
0x7FFF). The choice is the same on every backend and checked on its own (tests/kernels/test_rounding.py); the
bitwise comparisons with torch treat any NaN as equal to any NaN.

Stochastic rounding adds a uniform 16-bit random number to the low half instead of 0x7FFF + tie bit, then
truncates: the result rounds up with probability (dropped bits) / 2^16, so ``E[round(x)] == x`` exactly for every
finite x whose rounded value stays finite.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._launch import cdiv
from ._dispatch import Backend, select_backend

__all__ = ["split_bf16_remainder", "combine_bf16_remainder", "to_fp32", "round_to_bf16", "stochastic_round_to_bf16",
           "block_random_bits",
           "cast_to_bf16", "cast_to_bf16_ref",
           "stochastic_cast_to_bf16_ref"]

BF16_CANONICAL_NAN = 0x7FC0


@triton.jit
def to_fp32(x):
    """Any float block -> fp32, exactly. bf16 goes through its bits: the interpreter's own bf16 -> fp32
    conversion is wrong for subnormals (measured: 24 of 5,000 random bf16 patterns differed), while
    ``bits << 16`` is exact everywhere and costs the same on a GPU."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def round_to_bf16(x):
    """fp32 block -> bf16 block, round to nearest even (bit-identical to torch)."""
    u = x.to(tl.uint32, bitcast=True)
    hi = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    hi = tl.where(x != x, 0x7FC0, hi)
    return hi.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def block_random_bits(seed, first, BLOCK: tl.constexpr):
    """32 random bits for each element ``first .. first + BLOCK - 1`` (``first`` a multiple of 4), reproducible per
    (seed, element): one Philox4x32-7 call per 4 elements (counter ``element // 4``), each element of the four
    taking its own 32-bit word of that call.
    tl.randint would run a full Philox per element and keep one of its four words. 7 rounds, not Triton's
    default 10: Philox4x32-7 already passes TestU01's BigCrush (Salmon et al., "Parallel random numbers: as
    easy as 1, 2, 3", SC 2011); the 3 extra rounds are a safety margin that rounding bits do not need.
    Instructions per element, sm_90 (benchmarks.compile_check): AdamW with stochastically rounded bf16 states
    compile to 916 PTX instructions per thread against 717 with round-to-nearest, 1.28x (it was 3.75x with a
    per-element tl.randint per state); Lion 1.41x and SGD 1.46x, smaller kernels paying the same Philox."""
    counters = first // 4 + tl.arange(0, BLOCK // 4)
    r0, r1, r2, r3 = tl.randint4x(seed, counters, n_rounds=7)
    # [B/4, 2, 2] -> [B]: elements 4c .. 4c+3 get words r0, r2, r1, r3 of call c (join adds the last axis)
    words = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [BLOCK])
    return words.to(tl.uint32, bitcast=True)


@triton.jit
def stochastic_round_to_bf16(x, bits16):
    """fp32 block -> bf16 block, stochastic rounding: add 16 uniform random bits (``bits16``, uint32 < 2^16) below
    the bf16 mantissa and truncate, so the probability of rounding up is the distance to the lower neighbour."""
    u = x.to(tl.uint32, bitcast=True)
    hi = (u + bits16) >> 16
    hi = tl.where(x != x, 0x7FC0, hi)
    return hi.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _cast_kernel(x_ptr, out_ptr, n, seed, STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = to_fp32(tl.load(x_ptr + offs, mask=mask))
    if STOCHASTIC:
        y = stochastic_round_to_bf16(x, block_random_bits(seed, tl.program_id(0).to(tl.int64) * BLOCK, BLOCK)
                                     & 0xFFFF)
    else:
        y = round_to_bf16(x)
    tl.store(out_ptr + offs, y, mask=mask)


def cast_to_bf16_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference: round to nearest even, exactly ``x.float().to(torch.bfloat16)``."""
    return x.float().to(torch.bfloat16)


def stochastic_cast_to_bf16_ref(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Reference stochastic rounding with torch's RNG (same distribution as the kernel, different random bits)."""
    u = x.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    r = torch.randint(0, 1 << 16, u.shape, generator=generator, device=u.device, dtype=torch.int64)
    hi = ((u + r) >> 16) & 0xFFFF
    hi = torch.where(x.isnan(), torch.full_like(hi, BF16_CANONICAL_NAN), hi)
    return hi.to(torch.int32).to(torch.int16).view(torch.bfloat16).view(x.shape)


def cast_to_bf16(x: torch.Tensor, *, stochastic: bool = False, seed: int = 0, out: torch.Tensor | None = None,
                 backend: str | None = None) -> torch.Tensor:
    """Cast ``x`` (fp32, fp16 or bf16; contiguous) to bf16 with round-to-nearest-even or seeded stochastic rounding.

    Stochastic rounding is reproducible for a given (seed, element index) on the Triton backends.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    if out is None:
        out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    elif out.dtype != torch.bfloat16 or out.shape != x.shape or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bfloat16 tensor of shape {tuple(x.shape)} on {x.device}")
    chosen = select_backend("cast_to_bf16", x.device, backend)
    if chosen is Backend.TORCH:
        gen = torch.Generator(device=x.device).manual_seed(seed) if stochastic else None
        out.copy_(stochastic_cast_to_bf16_ref(x, gen) if stochastic else cast_to_bf16_ref(x))
        return out
    n = x.numel()
    if n:
        block = 4096
        _cast_kernel[(cdiv(n, block),)](x, out, n, seed, STOCHASTIC=stochastic, BLOCK=block,
                                                enable_fp_fusion=False)
    return out


# ----------------------------------------------------------------------------- fp32 = bf16 + 16-bit remainder
# The fp32 master stored as its bf16 rounding (the model's weight, already in the param buffer) plus a signed 16-bit
# remainder: bits(master) = (bits(bf16) << 16) + remainder. With round-to-nearest-even the remainder lies in
# [-0x8000, +0x8000]; +0x8000 (an exact tie rounded down to an even bf16) does not fit in 16 bits, and no encoding
# can fit it: an even bf16 value has 2^16 + 1 fp32 values rounding to it (both ties), one more than 16 bits can
# name. That one case is stored as +0x7FFF: the master moves down by one fp32 ulp and still rounds to the same bf16.
# Everywhere else, store and load are exact inverses (the "consistent rounding" other implementations miss when
# they round the bf16 half one way and reconstruct it another).


def split_bf16_remainder(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 -> (bf16 round-to-nearest-even, int16 remainder). Reference for the kernels' split."""
    hi = master.to(torch.bfloat16)
    hi32 = hi.view(torch.int16).to(torch.int32) << 16  # sign-extended: the same bit pattern as an int32
    rem = master.view(torch.int32).to(torch.int64) - hi32.to(torch.int64)
    rem = torch.where(rem == 0x8000, torch.full_like(rem, 0x7FFF), rem)
    return hi, rem.to(torch.int16)


def combine_bf16_remainder(hi: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    """(bf16, int16 remainder) -> fp32: the inverse of :func:`split_bf16_remainder`."""
    bits = (hi.view(torch.int16).to(torch.int32) << 16) + rem.to(torch.int32)
    return bits.view(torch.float32)


def remainder_after_write(hi: torch.Tensor, rem: torch.Tensor, before: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``rem`` where it can stay with ``hi`` after a write outside the optimizer into the high half (the model's
    weight), 0 elsewhere: where ``hi`` differs from ``before`` (the weights the remainders belong to, where the
    caller kept them from before the write), and where ``hi`` is zero or not finite.

    Where the weights from before the write are not known, the old remainder stays with a finite nonzero ``hi``: a
    master within 1/2 bf16 ulp of the written value, not the written value (a stated limit; elements the write
    left keep their fp32 bits). Beside a zero it would borrow through the sign: +0's bits plus a negative
    remainder are a negative NaN's, -0's wrap around to a positive NaN's, and a positive one makes a denormal the
    loop never wrote; beside an inf it makes a NaN or the largest finite value. There the master is ``hi``, as
    torch.optim's fp32 weight is. (An element whose master was a denormal below half the smallest bf16 one,
    ~4.6e-41, rounds to zero and becomes zero, if its weights were written.)"""
    keep = (hi != 0) & torch.isfinite(hi)
    if before is not None:
        keep &= hi == before
    return torch.where(keep, rem, 0)

