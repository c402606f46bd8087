"""Prove that sharded optimizer steps never wait on the host: run them under torch.cuda.set_sync_debug_mode("error").

    python -m benchmarks.sync_check        # on CUDA: the check; on CPU: the same steps, nothing to detect

Backward, clip_grad_norm_, step and zero_grad of a small model run with synchronizing CUDA calls turned into
errors, after one warm-up step (which fills the flatten kernel's device-side tables and compiles the kernels), for
each configuration below: the default ShardedAdamW, bf16 optimizer states with stochastic rounding plus the
remainder-stored master, fp16 parameters with dynamic loss scaling (where an overflow must skip a step without a
host read), ShardedSGD and ShardedLion, and the communicating paths: overlap_comm with attach() (reduce-scatters
launched from backward hooks, all-gathers waited for in forward pre-hooks) with bf16 states, and clipping through
torch.nn.utils.clip_grad_norm_ on param.grad placeholders. main() starts a 1-rank process group (NCCL on CUDA,
gloo on CPU) when none exists, so the collectives really run. On CPU (CI) the steps run without the detector,
which keeps this script from rotting between GPU runs; only a CUDA run proves anything.

It also checks the streams' rule 4 (optim/base.py): gradients made on a side stream and flushed on another one are
read before their memory is reused (:func:`side_stream_check`, with and without overlap_comm), after a control that
shows the scenario catches an unprotected read on this machine (:func:`race_reproduces`).

And ``cuda_graph=True`` (:func:`graph_check`, CUDA only here): real CUDA graphs and NCCL against eager steps, bit
for bit, through a changing lr, a skipped step, a recapture and three ways of clipping, with the captures and
replays counted and the last replayed steps under the sync detector; and across an unfreeze
(:func:`unfreeze_graph_check`). tests/optim/test_cuda_graph.py runs the same functions on the CPU with emulated
graphs.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable

import torch
import torch.distributed as dist

import tritonshard
from tritonshard import comm
from tritonshard.comm import local_device

CONFIGS: dict[str, Callable] = {
    "ShardedAdamW": lambda ps: tritonshard.ShardedAdamW(ps, lr=1e-3),
    "ShardedAdamW bf16 states + remainders": lambda ps: tritonshard.ShardedAdamW(
        ps, lr=1e-3, state_dtype=torch.bfloat16, store_param_remainders=True),
    "ShardedAdamW fp16 + loss scaling": lambda ps: tritonshard.ShardedAdamW(ps, lr=1e-3, param_dtype=torch.float16),
    "ShardedAdamW fp32 gradients": lambda ps: tritonshard.ShardedAdamW(ps, lr=1e-3, grad_dtype=torch.float32),
    "ShardedSGD momentum": lambda ps: tritonshard.ShardedSGD(ps, lr=1e-2, momentum=0.9),
    "ShardedLion": lambda ps: tritonshard.ShardedLion(ps, lr=1e-4),
    "ShardedAdamW overlap_comm + attach, bf16 states": lambda ps: tritonshard.ShardedAdamW(
        ps, lr=1e-3, overlap_comm=True, state_dtype=torch.bfloat16, bucket_cap_mb=0.05),
    "ShardedAdamW, torch.nn.utils.clip_grad_norm_": lambda ps: tritonshard.ShardedAdamW(ps, lr=1e-3),
    # the weight matrices in Muon (Newton-Schulz in the step), the biases in AdamW
    "ShardedMuon + AdamW groups": lambda ps: tritonshard.ShardedMuon(
        [{"params": [p for p in ps if p.ndim == 2]}, {"params": [p for p in ps if p.ndim != 2], "use_muon": False}],
        lr=0.02),
}
# how each configuration's loop differs from the plain one
ATTACH = {"ShardedAdamW overlap_comm + attach, bf16 states"}
TORCH_CLIP = {"ShardedAdamW, torch.nn.utils.clip_grad_norm_"}


def _model(device: torch.device) -> torch.nn.Module:
    """The small model every check trains (odd sizes: no dimension a multiple of a block)."""
    return torch.nn.Sequential(torch.nn.Linear(257, 129), torch.nn.GELU(), torch.nn.Linear(129, 61)).to(device)


def check(name: str, make: Callable, device: torch.device, steps: int = 3) -> str:
    torch.manual_seed(0)
    model = _model(device)
    opt = make(list(model.parameters()))
    if name in ATTACH:
        opt.attach(model)
    dtype = next(model.parameters()).dtype
    x = torch.randn(32, 257, device=device, dtype=dtype)

    def one_step(poison: bool = False):
        loss = model(x).float().square().mean()
        if poison:  # an overflowing backward: with loss scaling the step must be skipped on the device
            loss = loss * float("inf")
        opt.scale_loss(loss).backward()
        if name in TORCH_CLIP:  # the placeholders' per-parameter global norms, the multiply folded into step()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            norm = opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        return norm

    scaled = opt.loss_scale is not None
    one_step()  # warm-up: compiles kernels, uploads the flatten schedule
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(steps):
            norm = one_step(poison=i == 1 and scaled)
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
    skipped = int(opt.skipped_steps)
    if not torch.isfinite(norm):
        raise AssertionError(f"{name}: last grad norm is {float(norm)}")
    if skipped != int(scaled):  # the poisoned step, and only it, is skipped
        raise AssertionError(f"{name}: {skipped} skipped steps, expected {int(scaled)}")
    return f"{name}: {steps} steps{' under set_sync_debug_mode(error)' if cuda else ''}, last grad norm " \
           f"{float(norm):.4f}, skipped steps {skipped}"


#: cuda_graph=True against the same optimizer without it (graph_check): every update rule that can be captured, the
#: stochastically rounded states (per-step Philox seeds) and fp16 with its loss scale (updated inside the graph)
GRAPH_CONFIGS: dict[str, Callable] = {
    "ShardedAdamW": lambda ps, **kw: tritonshard.ShardedAdamW(ps, lr=1e-3, **kw),
    "ShardedAdamW bf16 states": lambda ps, **kw: tritonshard.ShardedAdamW(ps, lr=1e-3, state_dtype=torch.bfloat16,
                                                                          **kw),
    "ShardedAdamW fp16 + loss scaling": lambda ps, **kw: tritonshard.ShardedAdamW(ps, lr=1e-3,
                                                                                  param_dtype=torch.float16, **kw),
    "ShardedAdamW fp32 gradients": lambda ps, **kw: tritonshard.ShardedAdamW(ps, lr=1e-3, grad_dtype=torch.float32,
                                                                             **kw),
    "ShardedSGD momentum": lambda ps, **kw: tritonshard.ShardedSGD(ps, lr=1e-2, momentum=0.9, **kw),
    "ShardedLion": lambda ps, **kw: tritonshard.ShardedLion(ps, lr=1e-4, **kw),
    # (one rank: overlap_comm's machinery is out, and the step is captured as without it; graph_check attaches)
    "ShardedAdamW overlap_comm, one rank": lambda ps, **kw: tritonshard.ShardedAdamW(ps, lr=1e-3, overlap_comm=True,
                                                                                     **kw),
}
#: graph_check's loop, step by step: how the gradients are clipped (opt: opt.clip_grad_norm_, torch:
#: torch.nn.utils.clip_grad_norm_, none), and what else happens ("sync": on CUDA, under
#: torch.cuda.set_sync_debug_mode("error"): replayed steps never wait on the host either). Each change of what a
#: capture freezes (the clip mode, a weight decay) runs one step eagerly, captures on the next and replays after
GRAPH_STEPS = (["opt"] * 4 + ["opt inf"] + ["opt"] * 2 + ["opt wd"] + ["opt"] * 2 + ["torch"] * 3 + ["none"] * 3
               + ["none sync"] * 2)
#: (captures, replays) graph_check's loop makes: the reduction captured at step 1 and replayed after; the update
#: captured once per key (clip + weight decay 0.01, clip + 0.05, torch's clip, none) and replayed on the rest
GRAPH_EXPECTED = (1 + 4, (len(GRAPH_STEPS) - 2) + (len(GRAPH_STEPS) - 2 * 4))


@contextlib.contextmanager
def _sync_detector(active: bool):
    """Inside, on CUDA when ``active``, a synchronizing CUDA call raises."""
    if not active:
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def graph_check(name: str, make: Callable, device: torch.device, model: Callable = None, width: int = 257,
                bucket_cap_mb: float = 0.05) -> str:
    """cuda_graph=True gives the bits of the same optimizer without it (issue 20.6): two runs of the same model,
    data and seed through GRAPH_STEPS, with a LambdaLR that changes the lr every step (the value the host writes
    before each replay), a step with inf/NaN gradients (skipped inside the graph), a weight decay changed mid-run
    (a recapture) and three ways of clipping. Every weight after every step, every norm returned and the final
    optimizer state must be equal, and the graphs must have been captured and replayed as GRAPH_EXPECTED says.
    ``model(device)`` (default: the small model every check trains) takes inputs of ``width`` features; its
    parameters make several buckets of ``bucket_cap_mb`` (the coalesced collectives, the merged launches)."""
    model_fn = model or _model
    runs = []
    for graphed in (False, True):
        torch.manual_seed(0)
        model = model_fn(device)
        decay = [p for p in model.parameters() if p.ndim == 2]
        rest = [p for p in model.parameters() if p.ndim != 2]
        opt = make([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                   cuda_graph=graphed, bucket_cap_mb=bucket_cap_mb)
        opt.attach(model)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.5 * s))
        data = torch.Generator(device=device).manual_seed(1)
        weights, norms = [], []
        for what in GRAPH_STEPS:
            x = torch.randn(16, width, device=device, generator=data)
            with _sync_detector("sync" in what and device.type == "cuda"):
                loss = model(x).float().square().mean()
                if "inf" in what:
                    loss = loss * float("inf")
                opt.scale_loss(loss).backward()
                if what.startswith("opt"):
                    norms.append(opt.clip_grad_norm_(0.5))
                elif what.startswith("torch"):
                    norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
                if "wd" in what:
                    opt.param_groups[0]["weight_decay"] = 0.05
                opt.step()
                schedule.step()
                opt.zero_grad()
            weights.append([p.detach().clone() for p in model.parameters()])
        state = opt.state_dict()["state"]
        runs.append((weights, norms, state, opt))
    (w0, n0, s0, eager), (w1, n1, s1, graphed) = runs
    for step, (a, b) in enumerate(zip(w0, w1)):
        for i, (x, y) in enumerate(zip(a, b)):
            if not torch.equal(x, y):
                raise AssertionError(f"{name}: after step {step} ({GRAPH_STEPS[step]}), parameter {i} differs with "
                                     f"cuda_graph=True by up to {float((x.float() - y.float()).abs().max()):.3g}")
    for step, (x, y) in enumerate(zip(n0, n1)):
        if not torch.equal(x, y) and not (x.isnan() and y.isnan()):  # (the inf step's norm is NaN in both)
            raise AssertionError(f"{name}: clip norm {step} differs: {float(x)} eagerly, {float(y)} with graphs")
    for key in s0:
        for field, value in s0[key].items():
            if isinstance(value, torch.Tensor) and not torch.equal(value, s1[key][field]):
                raise AssertionError(f"{name}: optimizer state {key}.{field} differs with cuda_graph=True")
    if int(eager.skipped_steps) != 1 or int(graphed.skipped_steps) != 1:
        raise AssertionError(f"{name}: skipped steps {int(eager.skipped_steps)} eagerly, "
                             f"{int(graphed.skipped_steps)} with graphs; expected 1 (the inf step)")
    if eager.reduce_scatters_launched != graphed.reduce_scatters_launched:  # (set by the replays' bookkeeping)
        raise AssertionError(f"{name}: {graphed.reduce_scatters_launched} reduce-scatters counted with graphs, "
                             f"{eager.reduce_scatters_launched} eagerly")
    if len(graphed.buckets) < 3:
        raise AssertionError(f"{name}: {len(graphed.buckets)} buckets; the check wants several")
    made = (graphed._graphs.captures, graphed._graphs.replays)
    if made != GRAPH_EXPECTED:
        raise AssertionError(f"{name}: (captures, replays) = {made}, expected {GRAPH_EXPECTED}")
    return f"{name}, cuda_graph=True: {len(GRAPH_STEPS)} steps bit for bit equal to eager ({made[0]} captures, " \
           f"{made[1]} replays)"


def unfreeze_graph_check(device: torch.device, model: Callable = None, width: int = 257,
                         bucket_cap_mb: float = 0.05, steps: int = 8, unfrozen_at: int = 2) -> str:
    """cuda_graph=True across an unfreeze: the first layer frozen when ShardedAdamW is built and unfrozen before
    step ``unfrozen_at`` (laid out in new buckets with a step counter of their own: session 14). The steps after it
    must be captured and replayed (the update phase included) and give the eager bits, weights and state."""
    model_fn = model or _model
    runs = []
    for graphed in (False, True):
        torch.manual_seed(0)
        net = model_fn(device).to(torch.bfloat16)  # (a frozen parameter keeps its dtype: bf16 from the start)
        first = list(net[0].parameters())
        for p in first:
            p.requires_grad_(False)
        opt = tritonshard.ShardedAdamW(net.parameters(), lr=1e-3, weight_decay=0.01, cuda_graph=graphed,
                                       bucket_cap_mb=bucket_cap_mb)
        opt.attach(net)
        data = torch.Generator(device=device).manual_seed(1)
        weights = []
        for step in range(steps):
            if step == unfrozen_at:
                for p in first:
                    p.requires_grad_(True)
            x = torch.randn(16, width, device=device, generator=data)
            net(x).float().square().mean().backward()
            opt.clip_grad_norm_(0.5)
            replays = opt._graphs.replays if graphed else 0
            opt.step()
            opt.zero_grad()
            # the reduction replayed from the step after the unfreeze (captured at it), the update from the one
            # after that: both phases replayed in every later step
            if graphed and step >= unfrozen_at + 2 and opt._graphs.replays < replays + 1:
                raise AssertionError(f"unfreeze: step {step}'s update ran eagerly after the unfreeze")
            weights.append([p.detach().clone() for p in net.parameters()])
        runs.append((weights, opt.state_dict()["state"], opt))
    (w0, s0, _), (w1, s1, graphed_opt) = runs
    for step, (a, b) in enumerate(zip(w0, w1)):
        for i, (x, y) in enumerate(zip(a, b)):
            if not torch.equal(x, y):
                raise AssertionError(f"unfreeze: after step {step}, parameter {i} differs with cuda_graph=True")
    for key in s0:
        for field, value in s0[key].items():
            if isinstance(value, torch.Tensor) and not torch.equal(value, s1[key][field]):
                raise AssertionError(f"unfreeze: optimizer state {key}.{field} differs with cuda_graph=True")
    if float(s1[0]["step"]) != steps - unfrozen_at or float(s1[2]["step"]) != steps:
        raise AssertionError(f"unfreeze: step counts {float(s1[0]['step'])}, {float(s1[2]['step'])}")
    made = (graphed_opt._graphs.captures, graphed_opt._graphs.replays)
    return f"ShardedAdamW, a layer unfrozen at step {unfrozen_at}, cuda_graph=True: {steps} steps bit for bit " \
           f"equal to eager ({made[0]} captures, {made[1]} replays)"


def race_reproduces(device: torch.device) -> bool:
    """The control for :func:`side_stream_check`: in the same scenario, a copy of a side-stream tensor enqueued late
    on the default stream, the tensor then freed without any stream action, and a new tensor of its size filled on
    the side stream. True when the copy read the fill (the allocator reused the memory before the copy ran): the
    scenario does catch an unprotected flush on this machine, so the optimizer's passing it means something."""
    side = torch.cuda.Stream(device)
    n = 129 * 257
    with torch.cuda.stream(side):
        g = torch.randn(n, device=device).to(torch.bfloat16)
    out = torch.empty(n, device=device, dtype=torch.bfloat16)
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda._sleep(100_000_000)
    out.copy_(g)
    del g
    with torch.cuda.stream(side):
        junk = torch.full((n,), 1e4, device=device, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    del junk
    return bool((out == 1e4).any())


def side_stream_check(overlap: bool, device: torch.device) -> str:
    """Streams, rule 4 (optim/base.py): gradients that autograd makes on a side stream while the flush runs on
    another one must be read by the flatten before the caching allocator hands their memory to new work there.

    The forward (so the backward) runs on a side stream and backward() is called from the default stream, which a
    sleep holds back: without overlap_comm the end-of-backward flush is enqueued on the default stream behind the
    sleep, while the side stream runs on. Right after backward, new tensors of the gradients' sizes are filled with
    1e4 on the side stream: where the allocator reused a gradient's memory before the flatten read it, the grad
    buffer holds 1e4s. With overlap_comm the flush runs in the hook on the side stream itself. The grad buffer
    must hold the gradients a separate copy of the model gets on the default stream. On CPU the same steps run
    without streams (nothing to race): it keeps the check working between GPU runs."""
    torch.manual_seed(0)
    model = _model(device)
    reference = _model(device)
    opt = tritonshard.ShardedAdamW(model.parameters(), lr=1e-3, overlap_comm=overlap, bucket_cap_mb=0.05)
    reference = reference.to(torch.bfloat16)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(32, 257, device=device, dtype=torch.bfloat16)
    cuda = device.type == "cuda"
    side = torch.cuda.Stream(device) if cuda else None
    on_side = (lambda: torch.cuda.stream(side)) if cuda else contextlib.nullcontext
    reference(x).float().square().mean().backward()
    want = {id(p): r.grad for p, r in zip(model.parameters(), reference.parameters())}
    shapes = [p.shape for p in model.parameters()]
    for step in range(3):
        if cuda:
            side.wait_stream(torch.cuda.current_stream(device))
        with on_side():
            loss = model(x).float().square().mean()
        if cuda:
            torch.cuda._sleep(100_000_000)  # ~50 ms at 2 GHz: the default stream's flush runs late
        loss.backward()
        with on_side():
            junk = [torch.full(shape, 1e4, device=device, dtype=torch.bfloat16) for shape in shapes]
        if cuda:
            torch.cuda.synchronize()
        for b in opt.buckets:
            for p, view in zip(b.params, b.grad_buffer.get_views()):
                # the same bf16 gradients, up to the order of the matmuls' sums (a second model, other launches);
                # a reused gradient's memory would hold 1e4s
                if not torch.allclose(view.float(), want[id(p)].float(), rtol=1e-2, atol=1e-3):
                    worst = float((view.float() - want[id(p)].float()).abs().max())
                    raise AssertionError(f"step {step}: a gradient in bucket {b.index} differs from the reference "
                                         f"by up to {worst:.3g} (1e4 = memory reused before the flatten read it)")
        del junk
        opt.zero_grad()  # (no step: the model's weights stay those of the reference)
    where = "forward and backward on a side stream, flush " + ("in the hooks" if overlap else "on the default stream")
    return f"side-stream gradients{', overlap_comm' if overlap else ''}: 3 backwards ({where if cuda else 'no CUDA'})" \
           ", grad buffers equal the reference"


def batchnorm_dtype_probe(device: torch.device) -> tuple[bool, str]:
    """What torch's batch_norm does with a bf16 weight beside float32 running statistics on ``device``: attach()
    raises a ValueError for such a module (ShardedOptimizer._check_norm_statistics) on the reading that training
    with it fails there as on the CPU. (holds, line). The H200 run of 2026-12-04 found that a training forward with
    a bf16 input RUNS on CUDA; relaxing the check needs the whole loop to run, so this tries each part: a training
    forward and backward, an eval forward, with bf16 and with float32 inputs, and whether the statistics stay
    float32 and move. The line names every part that raised: none raising means the check is too strict there."""
    raised, ran = [], []
    for input_dtype in (torch.bfloat16, torch.float32):
        norm = torch.nn.BatchNorm1d(6).to(device)
        norm.weight.data, norm.bias.data = norm.weight.data.bfloat16(), norm.bias.data.bfloat16()
        x = torch.randn(8, 6, device=device, dtype=input_dtype, requires_grad=True)
        tag = str(input_dtype).removeprefix("torch.")
        for part in ("train forward", "backward", "eval forward"):
            try:
                if part == "train forward":
                    before = norm.running_mean.clone()
                    y = norm(x)
                    if norm.running_mean.dtype != torch.float32 or torch.equal(norm.running_mean, before):
                        raise RuntimeError("the running statistics did not move in float32")
                elif part == "backward":
                    y.float().square().sum().backward()
                    if norm.weight.grad is None or x.grad is None:
                        raise RuntimeError("no gradient reached the weight or the input")
                else:
                    norm.eval()
                    norm(x.detach())
                ran.append(f"{part} ({tag} input)")
            except RuntimeError as exc:
                raised.append(f"{part} ({tag} input): {str(exc).splitlines()[0][:120]}")
                if part == "train forward":
                    break
    if raised:
        return True, (f"BatchNorm with a bf16 weight and float32 statistics on {device.type} fails, as attach() "
                      f"assumes, in {len(raised)} of the parts: " + "; ".join(raised)
                      + (f" (ran: {', '.join(ran)})" if ran else ""))
    return False, (f"BatchNorm with a bf16 weight and float32 statistics RUNS on {device.type} (training forward "
                   "and backward, eval forward; bf16 and float32 inputs): attach()'s check "
                   "(_check_norm_statistics) is too strict here")


def main() -> int:
    device = local_device()  # indexed on CUDA: torch 2.11's init_process_group(device_id=) needs the index
    if device.type == "cuda":
        torch.cuda.set_device(device)
    owned_group = not dist.is_initialized()
    if owned_group:  # a real process group: the collectives run (NCCL) instead of being skipped
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1, device_id=device if device.type == "cuda" else None)
    try:
        return _check_all(device)
    finally:
        if owned_group:
            comm.destroy_process_group()  # (a collection first: see there)


def _check_all(device: torch.device) -> int:
    if device.type != "cuda":
        print("sync_check: no CUDA device; running the steps without the sync detector (proves nothing about syncs)")
    failed = 0
    for name, make in CONFIGS.items():
        try:
            print("sync_check: " + check(name, make, device), flush=True)
        except Exception as exc:  # noqa: BLE001 -- one configuration's failure must not hide the others
            failed += 1
            print(f"sync_check: FAILED {name}: {type(exc).__name__}: {exc}", flush=True)
    if device.type == "cuda":
        print("sync_check: side-stream control: an unprotected copy "
              + ("read reused memory (the check below can fail)" if race_reproduces(device)
                 else "did NOT read reused memory: the side-stream check below proves nothing here"), flush=True)
    for name, make in GRAPH_CONFIGS.items():
        if device.type != "cuda":  # (tests/optim/test_cuda_graph.py runs it on the CPU with emulated graphs)
            print(f"sync_check: {name}, cuda_graph=True: needs CUDA, not run", flush=True)
            continue
        try:
            print("sync_check: " + graph_check(name, make, device), flush=True)
        except Exception as exc:  # noqa: BLE001
            failed += 1
            print(f"sync_check: FAILED {name}, cuda_graph=True: {type(exc).__name__}: {exc}", flush=True)
    if device.type != "cuda":
        print("sync_check: unfreeze, cuda_graph=True: needs CUDA, not run", flush=True)
    else:
        try:
            print("sync_check: " + unfreeze_graph_check(device), flush=True)
        except Exception as exc:  # noqa: BLE001
            failed += 1
            print(f"sync_check: FAILED unfreeze, cuda_graph=True: {type(exc).__name__}: {exc}", flush=True)
    for overlap in (False, True):
        try:
            print("sync_check: " + side_stream_check(overlap, device), flush=True)
        except Exception as exc:  # noqa: BLE001
            failed += 1
            print(f"sync_check: FAILED side-stream gradients (overlap_comm={overlap}): {type(exc).__name__}: {exc}",
                  flush=True)
    holds, line = batchnorm_dtype_probe(device)
    failed += not holds
    print("sync_check: " + ("" if holds else "FAILED ") + line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
