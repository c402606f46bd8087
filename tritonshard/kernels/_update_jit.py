"""Triton helpers shared by the fused optimizer-update kernels (adamw, sgd, lion)."""

import triton
import triton.language as tl

from .rounding import block_random_bits, round_to_bf16, stochastic_round_to_bf16, to_fp32


@triton.jit
def update_mask(offs, n, found_inf_ptr, HAS_FOUND_INF: tl.constexpr):
    """In-bounds lanes, or none at all when found_inf != 0 (then nothing is loaded or stored).

    The interpreter rejects a mask built from a loaded flag ("mask has unsupported dtype"), so the flag moves
    the bound instead."""
    if HAS_FOUND_INF:
        return offs < tl.where(tl.load(found_inf_ptr) == 0, n, 0)
    else:
        return offs < n


@triton.jit
def scalar_arg(ptr, value, IS_TENSOR: tl.constexpr):
    """A scalar that arrives either by value or as a 1-element device tensor (lr, step, grad_scale...)."""
    if IS_TENSOR:
        return to_fp32(tl.load(ptr))
    else:
        return value


@triton.jit
def load_grad(grad_ptr, offs, mask, grad_scale, MAXIMIZE: tl.constexpr):
    g = to_fp32(tl.load(grad_ptr + offs, mask=mask)) * grad_scale
    if MAXIMIZE:
        g = -g
    return g


@triton.jit
def load_param(param_ptr, param_out_ptr, offs, mask, REMAINDER: tl.constexpr):
    """The fp32 master: loaded, or (REMAINDER) rebuilt from the bf16 weight and the int16 remainder."""
    if REMAINDER:
        hi = tl.load(param_out_ptr + offs, mask=mask).to(tl.uint16, bitcast=True).to(tl.int32)
        rem = tl.load(param_ptr + offs, mask=mask).to(tl.int32)
        return ((hi << 16) + rem).to(tl.float32, bitcast=True)
    else:
        return tl.load(param_ptr + offs, mask=mask)


@triton.jit
def store_param(param_ptr, param_out_ptr, offs, mask, p, HAS_PARAM_OUT: tl.constexpr,
                REMAINDER: tl.constexpr = False):
    """The fp32 master, and its copy in the model's dtype: bf16 rounded on the bits (see rounding.py), fp16
    by the cast, which rounds to nearest even under the interpreter (numpy) and on GPUs alike. With REMAINDER,
    the master is stored as the bf16 weight plus an int16 remainder (see rounding.split_bf16_remainder)."""
    if REMAINDER:
        hi = round_to_bf16(p)
        rem = p.to(tl.int32, bitcast=True) - (hi.to(tl.uint16, bitcast=True).to(tl.int32) << 16)
        rem = tl.where(rem == 0x8000, 0x7FFF, rem)
        tl.store(param_out_ptr + offs, hi, mask=mask)
        tl.store(param_ptr + offs, rem.to(tl.int16), mask=mask)
    else:
        tl.store(param_ptr + offs, p, mask=mask)
        if HAS_PARAM_OUT:
            if param_out_ptr.dtype.element_ty == tl.bfloat16:
                tl.store(param_out_ptr + offs, round_to_bf16(p), mask=mask)
            else:
                tl.store(param_out_ptr + offs, p.to(param_out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_state(ptr, offs, mask):
    """An optimizer state block (fp32 or bf16 in memory) as fp32."""
    return to_fp32(tl.load(ptr + offs, mask=mask))


@triton.jit
def stochastic_bits(seed_ptr, start, BLOCK: tl.constexpr, STOCHASTIC: tl.constexpr):
    """32 random bits per element of the block at element ``start``, from the launch's Philox key (an int64 device
    scalar the optimizer advances each step), or 0 unused. State tensor j rounds with bits 16j..16j+15 of its
    element's word, so the (at most two) states of one update never share random bits."""
    if STOCHASTIC:
        return block_random_bits(tl.load(seed_ptr), start, BLOCK)
    else:
        return 0


# ---- segmented launches: one launch of an update kernel over the shards of several buckets (issue 20.3)
# Without MULTI, program p updates elements [p * BLOCK, (p + 1) * BLOCK) of the tensors it was given. With MULTI,
# the launch covers several "segments" (one per bucket), each with its own tensors of every per-bucket role
# (master, gradient shard, states, param shard, Philox key): the arguments are segment 0's tensors, ``segs`` holds
# per segment the element offset of each role's tensor from segment 0's (SEGMENT_FIELDS int64 per segment, the
# last one its numel), and ``sched`` per program its (segment, first element). A block of a segment computes what
# the same block of that bucket's own launch computes, random bits included (they depend on the element's index
# in its segment and the segment's own key). Offsets of the vectorized roles and every segment's numel are multiples
# of 16 elements (checked on the host, tritonshard.kernels._launch.segmented_spec), so 16-byte accesses stay possible.
@triton.jit
def program_block(sched_ptr, BLOCK: tl.constexpr, MULTI: tl.constexpr):
    """(segment, first element of this program's block in its segment); (0, p * BLOCK) without MULTI."""
    pid = tl.program_id(0).to(tl.int64)
    if MULTI:
        return tl.load(sched_ptr + 2 * pid), tl.multiple_of(tl.load(sched_ptr + 2 * pid + 1), BLOCK)
    else:
        return pid * 0, pid * BLOCK


@triton.jit
def segment_ptr(ptr, segs_ptr, seg, FIELD: tl.constexpr, MULTI: tl.constexpr, VECTOR: tl.constexpr = True):
    """``ptr`` moved to segment ``seg``'s tensor of the role in column FIELD (``ptr`` itself without MULTI)."""
    if MULTI:
        off = tl.load(segs_ptr + seg * 8 + FIELD)
        if VECTOR:
            off = tl.multiple_of(off, 16)
        return ptr + off
    else:
        return ptr


@triton.jit
def segment_numel(segs_ptr, seg, n, MULTI: tl.constexpr):
    """The numel of segment ``seg`` (``n`` without MULTI). A multiple of 16 (checked on the host): without the hint
    the mask ``offs < n`` could change at any element, and the compiler split every access into 2- and 4-byte ones
    (sm_90 PTX; a 302M AdamW step ran at 55 % of the copy bandwidth on an H200, 2026-12-04)."""
    if MULTI:
        return tl.multiple_of(tl.load(segs_ptr + seg * 8 + 7), 16)
    else:
        return n


@triton.jit
def store_state(ptr, offs, mask, x, bits, STREAM: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Store an fp32 state block in the state's dtype: bf16 states round to nearest even or, with STOCHASTIC,
    stochastically with the 16-bit half STREAM (0 or 1) of ``bits`` (see stochastic_bits)."""
    tl.static_assert(STREAM < 2, "two 16-bit streams per random word")
    if ptr.dtype.element_ty == tl.bfloat16:
        if STOCHASTIC:
            tl.store(ptr + offs, stochastic_round_to_bf16(x, (bits >> (16 * STREAM)) & 0xFFFF), mask=mask)
        else:
            tl.store(ptr + offs, round_to_bf16(x), mask=mask)
    else:
        tl.store(ptr + offs, x, mask=mask)

