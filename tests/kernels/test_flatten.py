"""flatten_into: bit-exact against flatten_into_ref for every dtype pair, accumulate and scale, on both code paths
(aligned full blocks, element-wise rest); one launch per (dtype, alignment)."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import assert_bitwise_equal
from tests.kernels.common import DEVICE, ODD_SIZES, randn, random_fp32_bits
from tritonshard.kernels import Backend, flatten_into, flatten_into_ref, last_backend
from tritonshard.kernels import flatten as flatten_module
from tritonshard.layout import Layout

SRC_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OUT_DTYPES = [torch.bfloat16, torch.float32]


def _sources(sizes, dtype, seed):
    ts = []
    for i, n in enumerate(sizes):
        t = randn(n, seed + i, torch.float32, scale=3.0)
        if n > 10:  # a few specials where fp32 can hold them: overflow to inf in fp16, NaN, a bf16 tie
            t[:3] = torch.tensor([7e4, float("nan"), 1 + 2 ** -8])
        ts.append(t.to(dtype))
    return ts


def _run_both(out_dtype, tensors, offsets, numel, accumulate, scale, seed):
    initial = randn(numel, seed + 999, out_dtype)
    out, ref = initial.clone(), initial.clone()
    flatten_into(out, tensors, offsets, accumulate=accumulate, scale=scale)
    assert last_backend("flatten_into") is not Backend.TORCH
    flatten_into_ref(ref, tensors, offsets, accumulate=accumulate, scale=scale)
    return out, ref, initial


def _assert_outside_untouched(out, initial, tensors, offsets):
    owned = torch.zeros(out.numel(), dtype=torch.bool, device=DEVICE)
    for off, t in zip(offsets, tensors):
        owned[off:off + t.numel()] = True
    assert_bitwise_equal(out[~owned], initial[~owned], "elements outside every tensor are not written")


def _record_launches(monkeypatch) -> list[dict]:
    """Run the real kernel, and record the keyword (constexpr) arguments of every launch."""
    launches = []
    real = flatten_module._flatten_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(kwargs)
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(flatten_module, "_flatten_kernel", Recording())
    return launches


@pytest.mark.parametrize("src_dtype", SRC_DTYPES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_every_dtype_pair_matches_reference(src_dtype, out_dtype, accumulate, scale):
    sizes = ODD_SIZES + [8191]  # 8191: a prime above BLOCK
    tensors = _sources(sizes, src_dtype, seed=len(sizes))
    layout = Layout(sizes, world_size=3, align=64)  # gaps between views: padding must stay untouched
    out, ref, initial = _run_both(out_dtype, tensors, list(layout.offsets), layout.padded_numel, accumulate,
                                  scale, seed=1)
    assert_bitwise_equal(out, ref, f"flatten {src_dtype}->{out_dtype} acc={accumulate} scale={scale}")
    _assert_outside_untouched(out, initial, tensors, layout.offsets)


# numpy (under the interpreter) warns when it multiplies a signalling NaN, which random bit patterns include
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
def test_reference_is_round_to_nearest_even_of_fp32_math():
    # the reference itself, checked against a formula written out independently, on random bit patterns
    x = random_fp32_bits(5000, 11)
    acc = randn(5000, 12, torch.bfloat16)
    out = acc.clone()
    flatten_into(out, [x], [0], accumulate=True, scale=0.5)
    expected = ((x * 0.5) + acc.float()).to(torch.bfloat16)
    assert_bitwise_equal(out, expected, "0.5 * x + acc")


def test_non_contiguous_sources():
    base = randn(37 * 41, 5).view(37, 41)
    tensors = [base.t(), base[::3, 1::2], randn(6 * 5 * 4, 6).view(6, 5, 4).permute(2, 0, 1),
               torch.randn(1, device=DEVICE).expand(7)]
    sizes = [t.numel() for t in tensors]
    layout = Layout(sizes, 2, align=8)
    out = torch.zeros(layout.padded_numel, dtype=torch.bfloat16, device=DEVICE)
    flatten_into(out, tensors, list(layout.offsets))
    for t, off in zip(tensors, layout.offsets):
        assert_bitwise_equal(out[off:off + t.numel()], t.flatten().to(torch.bfloat16), "non-contiguous source")


def test_aligned_full_blocks_and_element_wise_tails_match_reference(monkeypatch):
    # The kernel has two code paths: 16-byte-aligned tensors copy full BLOCKs unmasked (vector accesses on a GPU),
    # everything else (tails, misaligned sources or destinations) masked element by element. Sizes around BLOCK
    # multiples, sources at 2- and 4-byte offsets from an allocation, destinations at odd offsets.
    launches = _record_launches(monkeypatch)
    block = flatten_module.BLOCK
    for out_dtype in OUT_DTYPES:
        for src_dtype in (torch.float32, torch.bfloat16):
            launches.clear()
            aligned = [randn(n, n, torch.float32).to(src_dtype) for n in (block, 2 * block + 1, block - 1, 5,
                                                                          block - 1)]
            storage = randn(3 * block + 8, 7, torch.float32).to(src_dtype)
            misaligned = [storage[1:block + 2], storage[block + 3:2 * block + 3]]  # 2/4-byte and odd offsets
            tensors = aligned + misaligned
            offsets, off = [], 0
            for i, t in enumerate(tensors):
                offsets.append(off + (3 if i == 2 else 0))  # tensors[2] lands at an odd destination offset
                off = offsets[-1] + t.numel() + 64 - (offsets[-1] + t.numel()) % 64
            out, ref, initial = _run_both(out_dtype, tensors, offsets, off, False, 0.37, seed=3)
            assert_bitwise_equal(out, ref, f"aligned and misaligned {src_dtype}->{out_dtype}")
            _assert_outside_untouched(out, initial, tensors, offsets)
            paths = sorted(k["ALIGNED"] for k in launches)
            assert paths == [False, True], f"both code paths must run, got ALIGNED={paths}"


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("accumulate", [False, True])
def test_four_blocks_per_program_from_two_byte_sources(monkeypatch, src_dtype, accumulate):
    # A 2-byte source (the bf16 gradients of the step's flatten), aligned, not accumulating: each program copies
    # four blocks, their loads first (BLOCKS_PER_PROGRAM); fp32 sources and accumulation keep one. Sizes: four
    # blocks exactly (one full program), 9 blocks + 7 (two full programs, then a tail program of one full block and
    # a partial one), 5 blocks (a tail program of one full block and three past the end, the next tensor's), 4
    # blocks less one, and small ones; the same bits as the reference, nothing outside the tensors written
    launches = _record_launches(monkeypatch)
    block = flatten_module.BLOCK
    sizes = [4 * block, 9 * block + 7, 5 * block, 4 * block - 1, 3, 64]
    tensors = _sources(sizes, src_dtype, seed=11)
    offsets, off = [], 0
    for n in sizes:
        offsets.append(off)
        off += n + 64 - n % 64  # (64-element destinations: the aligned path)
    for out_dtype in OUT_DTYPES:
        launches.clear()
        out, ref, initial = _run_both(out_dtype, tensors, offsets, off, accumulate, 0.37, seed=5)
        assert_bitwise_equal(out, ref, f"{src_dtype}->{out_dtype}, accumulate={accumulate}")
        _assert_outside_untouched(out, initial, tensors, offsets)
        want = 1 if accumulate or src_dtype == torch.float32 else 4
        assert [(k["ALIGNED"], k["BLOCKS"]) for k in launches] == [(True, want)], launches


def test_many_tensors_one_launch_per_dtype(monkeypatch):
    launches = _record_launches(monkeypatch)
    rng = random.Random(0)
    sizes = [rng.choice([0, 1, 2, 3, 17, 64, 199, 1000]) for _ in range(500)] + [9000]  # a big one among tiny
    dtypes = [SRC_DTYPES[i % 3] for i in range(len(sizes))]
    tensors = [randn(n, i, torch.float32).to(dt) for i, (n, dt) in enumerate(zip(sizes, dtypes))]
    order = list(range(len(sizes)))
    rng.shuffle(order)  # offsets in a different order from the list
    sizes_in_order = [sizes[i] for i in order]
    layout = Layout(sizes_in_order, 4, align=1)
    offsets = [0] * len(sizes)
    for pos, i in enumerate(order):
        offsets[i] = layout.offsets[pos]
    out = torch.zeros(layout.padded_numel, dtype=torch.bfloat16, device=DEVICE)
    ref = out.clone()
    flatten_into(out, tensors, offsets)
    flatten_into_ref(ref, tensors, offsets)
    assert_bitwise_equal(out, ref, "500 mixed tensors")
    # one launch per (source dtype, 16-byte aligned or not): align=1 offsets give both kinds for every dtype
    kinds = [(k["SRC_DTYPE"], k["ALIGNED"]) for k in launches]
    assert len(kinds) == len(set(kinds)) == 6, f"one launch per (dtype, alignment), got {kinds}"
    # single-dtype list of 1,000 tensors in a Buffer-like layout (64-element aligned offsets): exactly one launch
    launches.clear()
    tensors = [randn(rng.randint(1, 50), i) for i in range(1000)]
    layout = Layout([t.numel() for t in tensors], 1, align=64)
    out = torch.zeros(layout.padded_numel, dtype=torch.float32, device=DEVICE)
    flatten_into(out, tensors, list(layout.offsets))
    assert len(launches) == 1
    for t, off in zip(tensors, layout.offsets):
        assert_bitwise_equal(out[off:off + t.numel()], t, "1,000 fp32 tensors")


def test_the_optimizers_plan_path_follows_new_addresses_and_structures(monkeypatch):
    """``launch_unchecked`` with a launch cache (the optimizer's path, issue 20.5) reuses its plan while the gradients
    come back at the same addresses and rebuilds only the address table when they do not. Every call here checks
    the result against the reference: the same tensors again, clones at new addresses, a zero-numel tensor among
    them, a misaligned source (own launch), mixed dtypes, a transposed one, then the first structure again."""
    launches = _record_launches(monkeypatch)
    sizes = [4099, 0, 1, 640, 13]
    layout = Layout(sizes, 1, align=64)
    out = randn(layout.padded_numel, 7, torch.bfloat16)
    cache: dict = {}
    base = [randn(n, 10 + i, torch.float32, scale=3.0).bfloat16() for i, n in enumerate(sizes)]
    misaligned = randn(641, 20, torch.bfloat16)[1:]  # 2 bytes past a 16-byte boundary
    mixed = [t.float() if i % 2 else t for i, t in enumerate(base)]
    transposed = randn(640, 21, torch.bfloat16).view(32, 20).t()
    def fresh(seed):  # the same sizes at new addresses, with other values (a stale address table must show)
        return [randn(n, seed + i, torch.float32, scale=3.0).bfloat16() for i, n in enumerate(sizes)]

    calls = [base, base, fresh(30), fresh(40), base[:3] + [misaligned] + base[4:],
             mixed, base[:3] + [transposed] + base[4:], base]
    for i, tensors in enumerate(calls):
        accumulate = i % 3 == 1
        ref = out.clone()
        launches.clear()
        flatten_module.launch_unchecked(out, tensors, list(layout.offsets), accumulate, 1.0, cache)
        flatten_into_ref(ref, tensors, list(layout.offsets), accumulate=accumulate)
        assert_bitwise_equal(out, ref, f"call {i}")
        want = {4: 2, 5: 2}.get(i, 1)  # the misaligned source, and the fp32 ones, take a launch of their own
        assert len(launches) == want, f"call {i}: {launches}"


def test_a_plan_of_one_aligned_group_follows_new_addresses_through_its_own_table(monkeypatch):
    """When gradients come back at new addresses (every end-of-backward flush of a 302M GPT on the H200, 2026-12-04),
    a plan of one aligned group keeps its launch and rewrites its own address table in place. A stale table would
    flatten the old tensors' values (each call here has new values), a table shared with another plan would point
    that plan elsewhere, and a misaligned source must not be read through the aligned launch (it takes a launch of
    its own, as before)."""
    launches = _record_launches(monkeypatch)
    sizes = [4099, 1, 640, 13]  # (no empty tensor: then the group is every tensor, in order)
    layout = Layout(sizes, 1, align=64)
    offsets = list(layout.offsets)
    out = randn(layout.padded_numel, 7, torch.bfloat16)
    cache: dict = {}

    def fresh(seed):
        return [randn(n, seed + i, torch.float32, scale=3.0).bfloat16() for i, n in enumerate(sizes)]
    base = fresh(10)
    misaligned = randn(641, 20, torch.bfloat16)[1:]
    calls = [base, fresh(30), fresh(40), base[:2] + [misaligned] + base[3:], fresh(50), base]
    tables = []
    for i, tensors in enumerate(calls):
        accumulate = i % 2 == 1
        ref = out.clone()
        launches.clear()
        flatten_module.launch_unchecked(out, tensors, offsets, accumulate, 1.0, cache)
        flatten_into_ref(ref, tensors, offsets, accumulate=accumulate)
        assert_bitwise_equal(out, ref, f"call {i}")
        assert len(launches) == (2 if i == 3 else 1), f"call {i}: {launches}"
        plan = cache[("plan", accumulate, 1.0)]
        own = plan[4]
        if i == 3:
            assert own is None, "a misaligned source: two groups, no table of the plan's own"
            continue
        assert own is not None and own[0].tolist() == [t.data_ptr() for t in tensors], f"call {i}"
        tables.append((accumulate, own[0]))
    # tables: calls 0, 1, 2, 4, 5 (call 3 has none). Calls 0, 2 and 4 (accumulate False) are one plan, whose table
    # new addresses rewrite in place; call 5 (True) follows call 3's two-group plan, which had no table to rewrite
    (_, t0), _, (_, t2), (_, t4), (_, t5) = tables
    assert t2 is t0 and t4 is t0, "new addresses rewrote the plan's own table instead of building another"
    assert t5 is not t0


def test_the_plan_path_follows_the_offsets_when_the_addresses_repeat():
    """The same gradient addresses for other parameters: when the set of parameters that get a gradient changes
    (an unused expert, a branch not taken), the caching allocator hands parameter C's gradient the block parameter
    A's had. A plan found by the addresses alone wrote C's gradient into A's place (a silent wrong result)."""
    sizes = [640, 640, 640, 13]
    layout = Layout(sizes, 1, align=64)
    offsets = list(layout.offsets)
    out = randn(layout.padded_numel, 7, torch.bfloat16)
    cache: dict = {}
    grads = [randn(640, 50 + i, torch.float32, scale=3.0).bfloat16() for i in range(2)]
    for i, which in enumerate([(0, 1), (0, 1), (1, 2), (0, 2), (0, 1)]):
        for g in grads:  # new values at the same addresses
            g.copy_(torch.randn(640, generator=torch.Generator().manual_seed(100 + i)).to(g.device))
        ref = out.clone()
        flatten_module.launch_unchecked(out, grads, [offsets[j] for j in which], False, 1.0, cache)
        flatten_into_ref(ref, grads, [offsets[j] for j in which])
        assert_bitwise_equal(out, ref, f"call {i}: gradients for parameters {which}")


def test_empty_inputs_launch_nothing():
    out = torch.zeros(4, device=DEVICE)
    flatten_into(out, [], [])
    flatten_into(out, [torch.empty(0, device=DEVICE)], [4])  # a zero-numel tensor at the very end is legal
    assert bool((out == 0).all())


@pytest.mark.parametrize("make, exc, match", [
    (lambda: (torch.zeros(4, 4, device=DEVICE), [torch.ones(3, device=DEVICE)], [0]), ValueError, "1-D"),
    (lambda: (torch.zeros(8, dtype=torch.float16, device=DEVICE), [torch.ones(3, device=DEVICE)], [0]), TypeError,
     "out must be bfloat16 or float32"),
    (lambda: (torch.zeros(8, device=DEVICE), [torch.ones(3, dtype=torch.int32, device=DEVICE)], [0]), TypeError,
     r"tensors\[0\] must be float32"),
    (lambda: (torch.zeros(8, device=DEVICE), [torch.ones(3, device=DEVICE)] * 2, [0, 2]), ValueError, "overlap"),
    (lambda: (torch.zeros(8, device=DEVICE), [torch.ones(3, device=DEVICE)], [6]), ValueError, "outside out"),
    (lambda: (torch.zeros(8, device=DEVICE), [torch.ones(3, device=DEVICE)], [-1]), ValueError, "outside out"),
    (lambda: (torch.zeros(8, device=DEVICE), [torch.ones(3, device=DEVICE)], [0, 4]), ValueError, "same length"),
    (lambda: (torch.zeros(8, device=DEVICE), [torch.ones(3, device="meta")], [0]), ValueError, "is on meta"),
    (lambda: (torch.zeros(8, device=DEVICE), [[1.0, 2.0]], [0]), TypeError, r"tensors\[0\] must be a torch.Tensor"),
    (lambda: (torch.zeros(8, device=DEVICE), [torch.ones(3, device=DEVICE)], [1.5]), TypeError, r"offsets\[0\]"),
    (lambda: (torch.zeros(16, device=DEVICE)[::2], [torch.ones(3, device=DEVICE)], [0]), ValueError, "contiguous"),
])
def test_bad_input(make, exc, match):
    out, tensors, offsets = make()
    with pytest.raises(exc, match=match):
        flatten_into(out, tensors, offsets)


def test_torch_backend_is_explicit_and_observable():
    out = torch.zeros(10, dtype=torch.bfloat16, device=DEVICE)
    t = randn(10, 1)
    flatten_into(out, [t], [0], backend="torch")
    assert last_backend("flatten_into") is Backend.TORCH
    assert_bitwise_equal(out, t.to(torch.bfloat16), "torch backend")


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_layouts_and_alignments_match_reference(data):
    # Property: whatever mix of sizes (around BLOCK boundaries), source misalignments (elements skipped at the start
    # of an allocation) and destination offsets, every element lands where the reference puts it, bit for bit,
    # and nothing outside the tensors is written.
    block = flatten_module.BLOCK
    src_dtype = data.draw(st.sampled_from(SRC_DTYPES), label="src_dtype")
    out_dtype = data.draw(st.sampled_from(OUT_DTYPES), label="out_dtype")
    count = data.draw(st.integers(1, 4), label="count")
    sizes = data.draw(st.lists(st.sampled_from([1, 7, block - 1, block, block + 1, 2 * block + 3]),
                               min_size=count, max_size=count), label="sizes")
    # aligned tensors (fresh allocation, 16-byte destination offset) take the vector path, the rest element-wise
    aligned = data.draw(st.lists(st.booleans(), min_size=count, max_size=count), label="aligned")
    skips = data.draw(st.lists(st.integers(1, 9), min_size=count, max_size=count), label="source skips")
    gaps = data.draw(st.lists(st.integers(0, 17), min_size=count, max_size=count), label="destination gaps")
    seed = data.draw(st.integers(0, 2 ** 16), label="seed")
    tensors, offsets, off = [], [], 0
    for i, (n, a, skip, gap) in enumerate(zip(sizes, aligned, skips, gaps)):
        if a:
            tensors.append(randn(n, seed + i, torch.float32).to(src_dtype))
            offsets.append(-(-(off + gap) // 8) * 8)
        else:
            tensors.append(randn(n + skip, seed + i, torch.float32).to(src_dtype)[skip:])
            offsets.append(off + gap)
        off = offsets[-1] + n
    out, ref, initial = _run_both(out_dtype, tensors, offsets, off + 5, data.draw(st.booleans(), label="acc"),
                                  0.37, seed)
    assert_bitwise_equal(out, ref, f"sizes={sizes} aligned={aligned} skips={skips} gaps={gaps}")
    _assert_outside_untouched(out, initial, tensors, offsets)


def test_the_optimizers_one_launch_flush_of_every_bucket_matches_the_reference():
    """ShardedAdamW without overlap_comm flattens every bucket's gradients in one launch, each bucket's tensors at
    their buffer's distance from bucket 0's (negative for a buffer below it), and takes every shard's norm pass in
    one launch (issue 20.3). Here in tests/kernels so that the GPU check runs it compiled: two backward passes
    (the second accumulates) must leave each bucket's grad buffer as the reference flatten leaves it, bit for bit,
    and the norm must be the float64 norm of those buffers."""
    from tritonshard import ShardedAdamW
    sizes = (4099, 199, 1, 12_289, 640)
    params = [torch.nn.Parameter(randn(n, 60 + i)) for i, n in enumerate(sizes)]
    opt = ShardedAdamW(params, lr=1e-3, bucket_cap_mb=5000 * 2 / 2 ** 20)
    assert len(opt.buckets) >= 3
    weights = [[randn(n, 70 + 10 * k + i, scale=2.0) for i, n in enumerate(sizes)] for k in range(2)]
    for k in range(2):
        sum((p.float() * w).sum() for p, w in zip(params, weights[k])).backward()  # p.grad = w in bf16
    expected_norm_sq = 0.0
    index = {id(p): i for i, p in enumerate(params)}
    for b in opt.buckets:
        want = torch.zeros_like(b.grad_buffer.get_data())
        for k in range(2):
            grads = [weights[k][index[id(p)]].to(torch.bfloat16) for p in b.params]
            flatten_into_ref(want, grads, list(b.grad_buffer.offsets), accumulate=k == 1)
        assert_bitwise_equal(b.grad_buffer.get_data(), want, f"bucket {b.index}'s grad buffer")
        expected_norm_sq += float(want.double().square().sum())
    norm = opt.clip_grad_norm_(1e9)
    # the squares summed in float64 and rounded to fp32 once, then an fp32 sqrt: within 2 fp32 ulps
    assert float(norm) == pytest.approx(expected_norm_sq ** 0.5, rel=2 ** -22)
