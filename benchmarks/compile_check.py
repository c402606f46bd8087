"""Compile every kernel specialization the library launches for a real GPU target, on a machine without a GPU.

    python -m benchmarks.compile_check [--arch 90] [--out DIR]

The CPU suite runs the kernels through the Triton interpreter, which never meets the compiler: a construct the
interpreter accepts can still fail to lower (a dtype branch, a bitcast, a Philox call on a loaded seed), and an
access pattern that is right can still be slow (scalar loads where 16-byte vectors were meant). This check closes
that gap without a GPU. It installs a dry-run Triton driver whose target is ``cuda:<arch>`` and whose launcher
does nothing, then calls the library's own launchers on CPU tensors for every branch of their constexpr
arguments. Triton specializes and compiles each launch exactly as it would on the GPU, through ``ptxas`` (shipped
inside the triton wheel) to a cubin; nothing is executed.

For each compiled kernel it reports the registers, spills and shared memory (``cuobjdump -res-usage`` on the
cubin) and the widths of its global loads and stores (from the PTX), and fails when:

* a launch does not compile;
* a kernel spills registers to local memory;
* AdamW's coefficients kernel (float64 scalars, compared bit for bit with torch's ops) contains a fused
  multiply-add or an approximate division or square root, or lacks the correctly rounded ones; so for the clip
  coefficient's fp32 division;
* a streaming kernel has no 16-byte global load, or no 16-byte global store, each direction on its own (exempt:
  the one-program finalize of ``scale_`` and its per-segment sums, flatten's ALIGNED=False path, element-wise by
  design, and the stores of the read-only ``sum_sq_nonfinite`` pass, which writes one partial per program). A
  kernel with 16-byte stores and scalar loads (flatten's aligned path until 2026-11-30: the alignment hint was
  lost at the int-to-pointer cast) fails.

It also counts the PTX instructions of each kernel (static, both sides of every branch) per element a thread
handles (BLOCK / (32 x warps)): an upper bound of the work per element, to compare specializations (e.g. the
stochastic-rounding variants against round-to-nearest).

Reading the report: "layout converts" counts TTGIR ``convert_layout`` ops (data reshuffled between threads through
shared memory). In the update kernels with a bf16 gradient, the loads and the arithmetic use the bf16 accesses'
8-elements-per-thread layout while each fp32 store keeps 4 per thread (one 16-byte vector), so every fp32 store is
preceded by a conversion (3 in AdamW: param, exp_avg, exp_avg_sq; seen in the TTGIR, not chosen by us). Whether
that costs bandwidth is for a GPU to say.

What it cannot tell: speed (that is ``benchmarks.run`` on a GPU), and whether the compiled code computes the
right values (that is ``tests/kernels`` on a GPU, in ``benchmarks/gpu_check.sh``). The dry-run driver uses
Triton's driver interface (``triton.runtime.driver.set_active``; the launcher and ``load_binary`` hooks of
``CompiledKernel``), which is internal: checked with Triton 3.6 (the GPU machine's) and 3.9 (CI's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

from tritonshard.kernels import (_dispatch, _launch, adamw_step_, cast_to_bf16, flatten_into, lion_step_, scale_,
                                 sgd_step_, sum_sq_nonfinite)
from tritonshard.kernels import adamw as adamw_mod
from tritonshard.kernels import flatten as flatten_mod
from tritonshard.kernels import lion as lion_mod
from tritonshard.kernels import rounding as rounding_mod
from tritonshard.kernels import scalars as scalars_mod
from tritonshard.kernels import scale as scale_mod
from tritonshard.kernels import sgd as sgd_mod

KERNELS = {
    "flatten": flatten_mod._flatten_kernel,
    "scale": scale_mod._scale_kernel,
    "scale_finalize": scale_mod._finalize_kernel,
    "norm_pass": scale_mod._partials_multi_kernel,
    "segment_sums": scale_mod._segment_sums_kernel,
    "cast_to_bf16": rounding_mod._cast_kernel,
    "adamw": adamw_mod._adamw_kernel,
    "sgd": sgd_mod._sgd_kernel,
    "lion": lion_mod._lion_kernel,
    "adamw_coefficients": adamw_mod._coefficients_kernel,
    "step_flags": scalars_mod._step_flags_kernel,
    "clip_coefficient": scalars_mod._clip_coefficient_kernel,
    "round_totals": scalars_mod._round_totals_kernel,
}
# one program reducing a few partials, or computing a few scalars: neither streaming nor worth vectorizing
NOT_STREAMING = {"scale_finalize", "segment_sums", "adamw_coefficients", "step_flags", "clip_coefficient",
                 "round_totals"}
#: kernels whose float64 arithmetic must round each operation as torch's ops do (their results are compared bit
#: for bit with them): no fused multiply-add, no approximate division or square root in their PTX
IEEE_F64 = {"adamw_coefficients"}
#: ... and in fp32 (the clip coefficient: torch's reciprocal is an IEEE division on a GPU)
IEEE_F32 = {"clip_coefficient"}

# ------------------------------------------------------------------------------------------------ dry-run driver


_DRY_MODULE = object()  # stands for a loaded cubin: nothing is loaded anywhere


class _DryRunUtils:
    """What CompiledKernel asks of a driver's utils when it is first launched: nothing is loaded anywhere."""

    def __init__(self, props: dict):
        self.props = props

    def load_binary(self, name, kernel, shared, device):
        # (module, function, n_regs, n_spills, n_max_threads); registers and spills are read off the cubin instead.
        # A module that is not None: CompiledKernel loads once (a None module made it reload at every launch, which
        # inflated benchmarks.host_overhead by ~5 us per launch over what a GPU pays)
        return _DRY_MODULE, None, 0, 0, 1024

    def get_device_properties(self, device):
        return self.props

    def unload_module(self, module):
        pass


class DryRunDriver:
    """A Triton driver that compiles for ``target`` and launches nothing. ``launches`` counts what was asked."""

    def __init__(self, target: GPUTarget):
        self.target = target
        # H100/H200 limits: only max_shared_mem is consulted (a kernel asking more would fail to launch there)
        self.utils = _DryRunUtils({"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536,
                                   "warpSize": 32, "sm_clock_rate": 0, "mem_clock_rate": 0, "mem_bus_width": 0})
        self.launches = 0

        def launcher_cls(src, metadata):
            def launch(*args, **kwargs):
                self.launches += 1
            return launch

        self.launcher_cls = launcher_cls

    def is_active(self):
        return True

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_device_capability(self, device=None):
        return divmod(self.target.arch, 10)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty):
        return ty

    def get_benchmarker(self):
        raise RuntimeError("the dry-run driver times nothing")


# ------------------------------------------------------------------------------------------------ the launches


def _t(n, dtype=torch.float32, offset=0):
    """A CPU tensor of n elements; ``offset`` elements into its allocation (offset 1: not 16-byte aligned)."""
    return torch.randn(n + offset).to(dtype)[offset:]


def _update_tensors(n, state_dtype=torch.float32, grad_dtype=torch.bfloat16, out_dtype=torch.bfloat16,
                    remainders=False):
    param = torch.zeros(n, dtype=torch.int16) if remainders else _t(n)
    return param, _t(n, grad_dtype), _t(n, state_dtype), _t(n, state_dtype), _t(n, out_dtype)


def _scalars(tensors: bool):
    """lr, step, grad_scale and found_inf as Python numbers, or as 1-element device tensors (the optimizer's way
    with a tensor lr schedule, capturable steps and loss scaling)."""
    if not tensors:
        return dict(lr=1e-3, step=3, grad_scale=0.5), None
    return (dict(lr=torch.tensor(1e-3), step=torch.tensor(3.0), grad_scale=torch.tensor([0.5])),
            torch.zeros(1))


def _segmented_update(which: str, n: int) -> None:
    """One segmented launch (kernels._launch.segmented_spec) of an update kernel over three buckets' shards of ``n``,
    ``n + 64`` and 16 elements, each role's shards slices of one allocation (as the optimizer's buffers are laid out
    by the caching allocator), with the tensor coefficients, grad_scale and found_inf ShardedOptimizer passes. Before
    2026-12-04 this specialization used 2- and 4-byte accesses (a segment's numel, loaded from the table, gave its
    mask no known constancy): a 302M AdamW step ran at 55 % of the copy bandwidth on an H200."""
    sizes = [n, n + 64, 16]
    starts = [0, n + 64, 2 * n + 192]
    total = starts[-1] + 64

    def role(dtype):
        whole = _t(total, dtype)
        return [whole[a:a + k] for a, k in zip(starts, sizes)]
    params, grads, states, outs = role(torch.float32), role(torch.bfloat16), role(torch.float32), role(torch.bfloat16)
    grad_scale, found_inf = torch.tensor([0.5]), torch.zeros(1)
    if which == "adamw":
        coef, module = adamw_mod.adamw_coefficients(torch.tensor(1e-3, dtype=torch.float64), torch.tensor(3.0),
                                                    0.9, 0.999, 0.1), adamw_mod
        second = role(torch.float32)
        specs = [adamw_mod.launch_spec(p, g, m, v, coef, None, grad_scale, found_inf, o, None, 0.9, 0.999, 1e-8,
                                       False, False) for p, g, m, v, o in zip(params, grads, states, second, outs)]
    elif which == "sgd":
        coef, module = sgd_mod.sgd_coefficients(torch.tensor(1e-3, dtype=torch.float64),
                                                torch.device("cpu"))[0], sgd_mod
        specs = [sgd_mod.launch_spec(p, g, m, coef, None, 3.0, grad_scale, found_inf, o, None, 0.9, 0.0, 0.01, True,
                                     False, False) for p, g, m, o in zip(params, grads, states, outs)]
    else:
        coef, module = lion_mod.lion_coefficients(torch.tensor(1e-3, dtype=torch.float64), 0.1,
                                                  torch.device("cpu"))[0], lion_mod
        specs = [lion_mod.launch_spec(p, g, m, coef, None, grad_scale, found_inf, o, None, 0.9, 0.99, False, False)
                 for p, g, m, o in zip(params, grads, states, outs)]
    merged = _launch.segmented_spec(specs, block=specs[0][3]["BLOCK"], **module.SEGMENTS)
    if merged is None:
        raise RuntimeError(f"{which}: the shards did not merge into one segmented launch")
    kernel, grid, args, kwargs = merged
    kernel[grid](*args, **kwargs)


def _norm_pass(dtype: torch.dtype, aligned: bool, blocks_per_program: int = scale_mod.NORM_BLOCKS_PER_PROGRAM) -> None:
    """ShardedOptimizer's norm pass (kernels.scale.partials_multi_launch_spec): one launch over three buckets' grad
    shards (full blocks and tails, slices of one allocation as the caching allocator lays them out), or with a
    source one element off (the element-wise path); four blocks per program (the default) or one."""
    whole = _t(3 * 8192 + 256, dtype)
    xs = [whole[0:8192 + 64], whole[8192 + 128:2 * 8192 + 128], whole[2 * 8192 + 192:2 * 8192 + 208]]
    if not aligned:
        xs[1] = whole[8192 + 129:2 * 8192 + 129]
    _, slices = scale_mod.shared_sum_sq_workspace([x.numel() for x in xs], torch.device("cpu"))
    kernel, grid, args, kwargs = scale_mod.partials_multi_launch_spec(xs, 0.5, slices,
                                                                      blocks_per_program=blocks_per_program)
    kernel[grid](*args, **kwargs)


def _coefficients(weight_decay: float, pow_in_kernel: bool = True, lr_in_memory: bool = False) -> None:
    """ShardedAdamW's per-step coefficients launch (kernels.adamw.adamw_coefficients_launch): compiled, the powers
    in the kernel and the lr a kernel argument (a captured step: read from its float64 tensor); without the powers,
    the interpreter's arithmetic, whose float64 ops alone show there is no contraction (libdevice's pow has fused
    multiply-adds of its own: problems() exempts that specialization's)."""
    pows = torch.empty(2, dtype=torch.float64)
    lr = torch.tensor(1e-3, dtype=torch.float64) if lr_in_memory else 1e-3
    adamw_mod.adamw_coefficients_launch(torch.empty(3), (torch.empty((), dtype=torch.float64), pows, pows.unbind()),
                                        lr, torch.tensor(3.0), 0.9, 0.999, weight_decay, {},
                                        pow_in_kernel=pow_in_kernel)


def _step_flags(clip: bool) -> None:
    """ShardedOptimizer's launch of the step's scalars (kernels.scalars.step_flags_), with and without a clip."""
    scalar = lambda dtype=torch.float32: torch.zeros((), dtype=dtype)  # noqa: E731
    scalars_mod.step_flags_(scalar(), scalar(), scalar(), scalar(torch.int64), scalar(torch.bool), [scalar(), scalar()],
                            scalar() if clip else None, 0.5, scalar() if clip else None)


def cases() -> list[tuple[str, Callable[[], None]]]:
    """Every branch of every launcher's constexpr arguments, each as (name, call)."""
    n = 8192 + 64  # full blocks and a tail; a multiple of 16 like every Buffer shard
    out = []
    for out_dtype in (torch.bfloat16, torch.float32):
        for src_dtype in (torch.float32, torch.bfloat16, torch.float16):
            for acc in (False, True):
                def flat(out_dtype=out_dtype, src_dtype=src_dtype, acc=acc):
                    dst = torch.empty(3 * n, dtype=out_dtype)
                    # an aligned multi-block tensor, an aligned small one, a misaligned source: both code paths
                    flatten_into(dst, [_t(n, src_dtype), _t(33, src_dtype), _t(1000, src_dtype, offset=1)],
                                 [0, n, n + 64], accumulate=acc, scale=0.5)
                out.append((f"flatten {src_dtype}->{out_dtype} acc={acc}".replace("torch.", ""), flat))

    def flat_one_block():  # (the one-block kernel from a 2-byte source, which benchmarks.run times beside the default)
        with flatten_mod.one_block_per_program():
            flatten_into(_t(n + 1000, torch.bfloat16), [_t(n, torch.bfloat16), _t(33, torch.bfloat16)], [0, n])
    out.append(("flatten bfloat16->bfloat16, one block per program (the kernel the H200 measured)", flat_one_block))
    for x_dtype in (torch.bfloat16, torch.float32):
        for tensor_factor in (False, True):
            out.append((f"scale {x_dtype} factor={'tensor' if tensor_factor else 'float'}".replace("torch.", ""),
                        lambda x_dtype=x_dtype, tf=tensor_factor:
                        scale_(_t(n, x_dtype), torch.tensor([0.25]) if tf else 0.25)))
            # the read-only pass the optimizer runs on every grad shard (same kernel, WRITE=False)
            out.append((f"sum_sq_nonfinite {x_dtype} factor={'tensor' if tensor_factor else 'float'}"
                        .replace("torch.", ""),
                        lambda x_dtype=x_dtype, tf=tensor_factor:
                        sum_sq_nonfinite(_t(n, x_dtype), torch.tensor([0.25]) if tf else 0.25)))
    for x_dtype, aligned in ((torch.bfloat16, True), (torch.float32, True), (torch.bfloat16, False)):
        out.append((f"norm pass {x_dtype} aligned={aligned} (one launch over several grad shards, as ShardedOptimizer "
                    "reduces)".replace("torch.", ""), lambda x_dtype=x_dtype, aligned=aligned: _norm_pass(x_dtype,
                                                                                                         aligned)))
    out.append(("norm pass bfloat16 aligned=True, one block per program (the kernel the H200 measured, session 32)",
                lambda: _norm_pass(torch.bfloat16, True, blocks_per_program=1)))
    # the per-piece totals of the per-parameter norms (torch's clip over param.grad): one program per segment
    out.append(("segment sums (each grad piece's partials: per-parameter norms)",
                lambda: scale_mod.segment_sums_(torch.zeros(3000, dtype=torch.float64), torch.tensor([0, 1000]),
                                                torch.tensor([1000, 2000]), torch.empty(2, dtype=torch.float64))))
    for src_dtype in (torch.float32, torch.bfloat16, torch.float16):
        for stochastic in (False, True):
            out.append((f"cast_to_bf16 {src_dtype} stochastic={stochastic}".replace("torch.", ""),
                        lambda src_dtype=src_dtype, s=stochastic: cast_to_bf16(_t(n, src_dtype), stochastic=s,
                                                                               seed=5)))
    # optimizer updates: one case per constexpr branch, the common configuration first
    variants = [
        ("bf16 grad, bf16 out", {}, {}),
        ("fp32 grad, fp16 out, maximize", dict(grad_dtype=torch.float32, out_dtype=torch.float16),
         dict(maximize=True)),
        ("fp16 grad, no out", dict(grad_dtype=torch.float16), dict(param_out=None)),
        ("tensor lr/step/grad_scale, found_inf", {}, dict(_tensors=True)),
        ("remainders", dict(remainders=True), dict(remainders=True)),
        ("bf16 states nearest", dict(state_dtype=torch.bfloat16), {}),
        ("bf16 states stochastic", dict(state_dtype=torch.bfloat16), dict(state_rounding="stochastic", seed=7)),
        ("bf16 states stochastic, tensor seed, remainders", dict(state_dtype=torch.bfloat16, remainders=True),
         dict(state_rounding="stochastic", seed=torch.tensor([7]), remainders=True)),
    ]
    for name, tensor_kw, call_kw in variants:
        def update(which, tensor_kw=tensor_kw, call_kw=dict(call_kw)):
            p, g, s1, s2, po = _update_tensors(n, **tensor_kw)
            scalars, found_inf = _scalars(call_kw.pop("_tensors", False))
            kw = dict(scalars, found_inf=found_inf, param_out=po)
            kw.update(call_kw)
            if which == "adamw":
                adamw_step_(p, g, s1, s2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, **kw)
            elif which == "sgd":
                sgd_step_(p, g, s1, momentum=0.9, weight_decay=0.01, nesterov=True, **kw)
            else:
                kw.pop("step")
                lion_step_(p, g, s1, beta1=0.9, beta2=0.99, weight_decay=0.1, **kw)
        for which in ("adamw", "sgd", "lion"):
            out.append((f"{which} {name}", lambda which=which, update=update: update(which)))
    for which in ("adamw", "sgd", "lion"):
        out.append((f"{which} segmented (MULTI: one launch over several buckets' shards, as ShardedOptimizer "
                    "steps without overlap_comm)", lambda which=which: _segmented_update(which, n)))
    for weight_decay in (0.0, 0.1):  # (its bits: 0 is an int32 argument, 0.1's an int64: two specializations)
        out.append((f"adamw coefficients, weight_decay={weight_decay}", lambda wd=weight_decay: _coefficients(wd)))
    out.append(("adamw coefficients, the lr in memory (a captured step)", lambda: _coefficients(0.1, True, True)))
    out.append(("adamw coefficients, the powers from memory (the interpreter's path)",
                lambda: _coefficients(0.1, False)))
    for clip in (False, True):
        out.append((f"step flags, clip={clip}", lambda clip=clip: _step_flags(clip)))
    out.append(("clip coefficient", lambda: scalars_mod.clip_coefficient_(torch.ones(()), torch.empty(()), 1.0)))
    out.append(("clip coefficient and the norm's sqrt (as ShardedOptimizer.clip_grad_norm_ launches it compiled)",
                lambda: scalars_mod.clip_coefficient_(torch.empty(()), torch.empty(()), 1.0, sum_sq=torch.ones(()))))
    out.append(("norm totals rounded", lambda: scalars_mod.round_totals_(torch.ones(2, dtype=torch.float64),
                                                                          torch.empty(2))))
    out.append(("adamw beta1=0.3 (lerp from the end)", lambda: adamw_step_(
        *_update_tensors(n)[:4], lr=1e-3, beta1=0.3, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)))
    out.append(("sgd no momentum, no weight decay", lambda: sgd_step_(
        _t(n), _t(n, torch.bfloat16), None, lr=0.1, param_out=_t(n, torch.bfloat16))))
    out.append(("sgd momentum, dampening, tensor step", lambda: sgd_step_(
        _t(n), _t(n, torch.bfloat16), _t(n), lr=0.1, momentum=0.9, dampening=0.1, step=torch.tensor(2.0))))
    return out


# ------------------------------------------------------------------------------------------------ inspection

_ACCESS = re.compile(r"\b(ld|st)\.global((?:\.[A-Za-z][\w:]*)*?)(?:\.v(\d))?\.([bfsu])(\d+)\b")


def global_access_bytes(ptx: str) -> dict[str, list[int]]:
    """Bytes moved per thread by each kind of global load/store instruction in ``ptx``: {"ld": [16, 4], ...}."""
    widths: dict[str, set[int]] = {"ld": set(), "st": set()}
    for op, _qual, vec, _kind, bits in _ACCESS.findall(ptx):
        widths[op].add(int(vec or 1) * int(bits) // 8)
    return {op: sorted(w) for op, w in widths.items()}


def resource_usage(cubin: bytes, name: str) -> dict[str, int] | None:
    """REG, LOCAL, SHARED, STACK of the cubin's function, read by the cuobjdump that ships with Triton."""
    tool = getattr(getattr(triton.knobs, "nvidia", None), "cuobjdump", None)
    path = getattr(tool, "path", None)
    if not path or not Path(path).exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([path, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    m = re.search(rf"Function {re.escape(name)}:\s*\n\s*(.*)", text)
    if not m:
        return None
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", m.group(1))}


@dataclasses.dataclass
class Compiled:
    kernel: str
    constexprs: dict
    num_warps: int
    registers: int | None
    local_bytes: int | None
    shared_bytes: int
    load_bytes: list[int]
    store_bytes: list[int]
    layout_converts: int  # ttg.convert_layout ops: data reshuffled between register layouts via shared memory
    ptx_instructions: int  # static count in the kernel's PTX
    instructions_per_element: float | None  # ptx_instructions / elements per thread, where BLOCK is known
    problems: list[str]


_DATA_POINTERS = {"param", "grad", "param_out", "exp_avg", "exp_avg_sq", "buf", "x", "out"}


def _constexprs(compiled) -> dict:
    src = compiled.src
    names = src.fn.arg_names
    out = {}
    for key, value in src.constants.items():
        idx = key[0] if isinstance(key, tuple) else names.index(key)
        name = names[idx]
        if name.isupper():  # the kernels' own switches (BLOCK, SRC_DTYPE, ...), not specialized scalars
            out[name] = str(value)
    for name, ty in src.signature.items():  # data pointers other than fp32 (bf16 grads, int16 remainders...)
        name = name.removesuffix("_ptr")
        if name in _DATA_POINTERS and isinstance(ty, str) and ty != "*fp32":
            out[name] = ty[1:]
    return out


def problems(kernel: str, constexprs: dict, local_bytes: int | None, load_bytes: list[int],
             store_bytes: list[int], ptx: str = "") -> list[str]:
    """What is wrong with one compiled specialization (the rules in the module docstring)."""
    found = []
    if local_bytes:
        found.append(f"spills {local_bytes} bytes to local memory")
    if kernel in IEEE_F64:
        # (libdevice's pow, inlined where POW_IN_KERNEL, rounds as torch's CUDA pow does, fused multiply-adds
        # included: its own code, the same as torch's; the specialization without it holds the rest of the math)
        if re.search(r"\bfma\.|\.approx\b", ptx) and constexprs.get("POW_IN_KERNEL") != "True":
            found.append("a fused multiply-add or an approximate operation in float64 math compared bit for bit")
        if "div.rn.f64" not in ptx or "sqrt.rn.f64" not in ptx:
            found.append("no correctly rounded float64 division or square root")
    if kernel in IEEE_F32:
        if re.search(r"\bfma\.|\.approx\b|\bdiv\.full\b", ptx):
            found.append("a fused multiply-add or an approximate operation in fp32 math compared bit for bit")
        if "div.rn.f32" not in ptx:
            found.append("no correctly rounded fp32 division")
        if constexprs.get("SQRT") == "True" and "sqrt.rn.f32" not in ptx:
            found.append("no correctly rounded fp32 square root")
    if kernel in NOT_STREAMING or constexprs.get("ALIGNED") == "False":
        return found
    if 16 not in load_bytes:
        found.append("no 16-byte global load: the compiler could not prove the source's alignment")
    writes_data = kernel != "norm_pass" and not (kernel == "scale" and constexprs.get("WRITE") == "False")
    if writes_data and 16 not in store_bytes:
        found.append("no 16-byte global store: the compiler could not prove the destination's alignment")
    return found


_INSTRUCTION = re.compile(r"^\s*(?:@!?%p\d+\s+)?[a-z][\w.:]*\b[^;]*;", re.MULTILINE)


def ptx_instruction_count(ptx: str) -> int:
    """Instructions in ``ptx`` (lines ``[@pred] opcode ...;``; directives, labels and comments excluded)."""
    return len(_INSTRUCTION.findall(ptx))


def inspect_kernels() -> list[Compiled]:
    results = []
    for kname, fn in KERNELS.items():
        for _device, (cache, *_rest) in list(fn.device_caches.items()):
            for compiled in cache.values():
                ptx = compiled.asm["ptx"]
                access = global_access_bytes(ptx)
                usage = resource_usage(compiled.asm["cubin"], compiled.metadata.name) or {}
                constexprs = _constexprs(compiled)
                warps = compiled.metadata.num_warps
                count = ptx_instruction_count(ptx)
                block = int(constexprs["BLOCK"]) if constexprs.get("BLOCK", "").isdigit() else None
                per_element = round(count / (block / (32 * warps)), 1) if block else None
                results.append(Compiled(kname, constexprs, warps, usage.get("REG"),
                                        usage.get("LOCAL"), compiled.metadata.shared, access["ld"], access["st"],
                                        compiled.asm["ttgir"].count("ttg.convert_layout"), count, per_element,
                                        problems(kname, constexprs, usage.get("LOCAL"), access["ld"], access["st"],
                                                 ptx)))
    return results


# ------------------------------------------------------------------------------------------------ main


def run(arch: int) -> tuple[list[tuple[str, str]], list[Compiled], DryRunDriver]:
    if _dispatch.interpreter_enabled():
        raise SystemExit("benchmarks.compile_check compiles real kernels, but triton was imported with "
                         "TRITON_INTERPRET=1: run it with TRITON_INTERPRET unset")
    dry = DryRunDriver(GPUTarget("cuda", arch, 32))
    previous = driver._active  # None on a machine without a GPU (reset_active() would raise there)
    driver.set_active(dry)
    failures = []
    try:
        with _dispatch.compile_for_target():
            for i, (name, call) in enumerate(cases()):
                print(f"[{i + 1:2d}] {name}", file=sys.stderr, flush=True)
                try:
                    call()
                except Exception as e:  # noqa: BLE001 -- reported with its case, then the check fails
                    failures.append((name, f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"))
    finally:
        driver._active = previous
    return failures, inspect_kernels(), dry


def markdown(arch: int, failures, compiled: list[Compiled]) -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        rev = "unknown"
    lines = [f"# compile_check: sm_{arch}, triton {triton.__version__}, torch {torch.__version__}", "",
             f"`python -m benchmarks.compile_check --arch {arch}` at git {rev}, {time.strftime('%Y-%m-%d')}: "
             "compiled through ptxas by a dry-run driver, nothing executed (no GPU involved).", "",
             f"{len(compiled)} specializations compiled, {len(failures)} launches failed. Columns: registers per "
             "thread and local-memory (spill) bytes from `cuobjdump -res-usage`; layout converts = "
             "`ttg.convert_layout` ops in the TTGIR (shuffles through shared memory); bytes per global load/store "
             "instruction from the PTX (16 = 128-bit vector access); PTX instructions (static) and per element "
             "of a thread's share of a block.", "",
             "| kernel | specialization | warps | regs | local B | shared B | layout converts | ld B/instr "
             "| st B/instr | PTX instr | instr/element | problems |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(compiled, key=lambda c: (c.kernel, sorted(c.constexprs.items()))):
        spec = " ".join(f"{k}={v}" for k, v in sorted(c.constexprs.items()) if k != "BLOCK")
        lines.append(f"| {c.kernel} | {spec} | {c.num_warps} | {c.registers} | {c.local_bytes} | {c.shared_bytes} "
                     f"| {c.layout_converts} | {c.load_bytes} | {c.store_bytes} | {c.ptx_instructions} "
                     f"| {c.instructions_per_element} | {'; '.join(c.problems)} |")
    for name, err in failures:
        lines.append(f"\nFAILED to compile: {name}: {err}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability as an int: 80, 90 (default), 100")
    ap.add_argument("--out", type=Path, help="folder for compile_check.md and compile_check.json")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    failures, compiled, dry = run(args.arch)
    text = markdown(args.arch, failures, compiled)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "compile_check.md").write_text(text)
        (args.out / "compile_check.json").write_text(json.dumps({
            "arch": args.arch, "triton": triton.__version__, "torch": torch.__version__,
            "launches": dry.launches, "failures": failures,
            "compiled": [dataclasses.asdict(c) for c in compiled]}, indent=1))
    print(text)
    problems = sum(bool(c.problems) for c in compiled)
    print(f"{len(compiled)} specializations, {dry.launches} dry launches, {len(failures)} compile failures, "
          f"{problems} with problems, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 1 if failures or problems else 0


if __name__ == "__main__":
    sys.exit(main())
