"""Checkpoints: exact resume, resharding across world sizes, torch.optim.AdamW import, mismatches, killed saves."""

import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from tests.distributed import run_on_ranks
from tests.helpers import assert_bitwise_equal
from tests.optim.training import LR, Reference, make_model, muon_groups, param_groups, schedule, train_step
from tritonshard import ShardedAdamW, ShardedLion, ShardedMuon, ShardedSGD
from tritonshard.checkpoint import (CheckpointMismatchError, atomic_save, latest_checkpoint, load_file,
                                    load_sharded, save_checkpoint, save_sharded)

K = 2  # steps before the checkpoint; the runs continue to 2K
SMALL_BUCKETS = 200 * 2 / 2 ** 20  # ~200 elements: several buckets, so bucket layouts differ from the default


def _setup(bucket_cap_mb=25.0):
    model = make_model(0)
    opt = ShardedAdamW(param_groups(model), lr=LR, bucket_cap_mb=bucket_cap_mb)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    return model, opt, sched


def _snapshot(opt):
    return {"params": [b.param_buffer.get_data().clone() for b in opt.buckets],
            "master": opt.state_dict()["state"]}


def _save(opt, sched, mode, path, step):
    if mode == "sharded":
        save_sharded(opt, path, extra={"step": step, "sched": sched.state_dict()})
    else:
        full = opt.state_dict()  # a collective: every rank takes part
        if opt.rank == 0:
            atomic_save({"opt": full, "sched": sched.state_dict(), "step": step}, path)
        if opt.world_size > 1:
            torch.distributed.barrier()


def _load(opt, sched, mode, path):
    if mode == "sharded":
        extra = load_sharded(opt, path)
    else:
        extra = load_file(path)
        opt.load_state_dict(extra["opt"])
    sched.load_state_dict(extra["sched"])
    return extra["step"]


def _save_after_k(rank, world_size, mode, path, bucket_cap_mb):
    model, opt, sched = _setup(bucket_cap_mb)
    for step in range(K):
        train_step(model, opt, sched, rank, step)
    _save(opt, sched, mode, path, K)


def _resume_and_compare(rank, world_size, mode, path, bucket_cap_mb, saved_world, rel_tol):
    model, opt, sched = _setup(bucket_cap_mb)
    start = _load(opt, sched, mode, path)
    assert start == K
    for step in range(K, 2 * K):
        train_step(model, opt, sched, rank, step)
    # reference: `saved_world` ranks for K steps, then `world_size` ranks
    ref = Reference(saved_world)
    for step in range(2 * K):
        if step == K:
            ref.world_size = world_size
        ref.step(step)
    ours = opt.state_dict()["state"]
    trainable = [p for g in param_groups(ref.fp32) for p in g["params"]]
    worst = max(float((ours[i]["master"].double() - p.detach().double()).abs().max()) for i, p in enumerate(trainable))
    scale = max(float(p.detach().abs().max()) for p in trainable)
    assert worst <= rel_tol * scale, f"master after resharding {saved_world}->{world_size}: {worst / scale:.2e}"


# Tolerances as in tests/optim/test_adamw_distributed.py: 1 and 2 ranks reproduce the reference's bf16 sums
# exactly (fp32 AdamW op order only: 1e-6); 3 and 4 ranks add bf16 contributions in ring order (1e-3).
@pytest.mark.parametrize("mode, before, after", [
    ("sharded", 4, 2), ("sharded", 2, 4), ("sharded", 1, 2), ("sharded", 3, 2), ("full", 2, 1),
])
def test_reshard_and_continue_matches_reference(tmp_path, mode, before, after):
    path = str(tmp_path / ("ckpt" if mode == "sharded" else "ckpt.pt"))
    run_on_ranks(_save_after_k, before, mode, path, SMALL_BUCKETS)
    rel_tol = 1e-3 if max(before, after) > 2 else 1e-6
    run_on_ranks(_resume_and_compare, after, mode, path, 25.0, before, rel_tol)  # other bucket layout too


def _exact_resume(rank, world_size, tmp):
    # uninterrupted run
    model, opt, sched = _setup(SMALL_BUCKETS)
    for step in range(2 * K):
        train_step(model, opt, sched, rank, step)
    want = _snapshot(opt)
    for mode in ("sharded", "full"):
        path = os.path.join(tmp, f"{mode}-ckpt")
        model, opt, sched = _setup(SMALL_BUCKETS)
        for step in range(K):
            train_step(model, opt, sched, rank, step)
        _save(opt, sched, mode, path, K)
        model, opt, sched = _setup(SMALL_BUCKETS)  # a fresh process's view: new model, new optimizer
        start = _load(opt, sched, mode, path)
        for step in range(start, 2 * K):
            train_step(model, opt, sched, rank, step)
        got = _snapshot(opt)
        for a, b in zip(got["params"], want["params"]):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{mode}: bf16 params differ"
        for i in want["master"]:
            for name in ("master", "exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(got["master"][i][name], want["master"][i][name]), f"{mode}: {name} of {i}"


@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_is_bit_exact_at_the_same_world_size(tmp_path, world_size):
    run_on_ranks(_exact_resume, world_size, str(tmp_path))


#: every optimizer and state format a sharded checkpoint holds: its own state names, dtypes and counts
RESHARD_KINDS = {
    "sgd": lambda model, cap: ShardedSGD(param_groups(model), lr=0.05, momentum=0.9, nesterov=True,
                                         bucket_cap_mb=cap),
    "lion": lambda model, cap: ShardedLion(param_groups(model), lr=1e-3, weight_decay=0.1, bucket_cap_mb=cap),
    "muon": lambda model, cap: ShardedMuon(muon_groups(model), lr=0.02, bucket_cap_mb=cap),
    # (the fp32 master as the bf16 weight plus an int16 remainder; bf16 moments, rounded to nearest: stochastic
    # rounding draws by bucket, so its bits depend on the layout, which a resharded run changes)
    "adamw, remainders": lambda model, cap: ShardedAdamW(param_groups(model), lr=LR, bucket_cap_mb=cap,
                                                         store_param_remainders=True),
    "adamw, bf16 states": lambda model, cap: ShardedAdamW(param_groups(model), lr=LR, bucket_cap_mb=cap,
                                                          state_dtype=torch.bfloat16, state_rounding="nearest"),
}


def _save_every_kind(rank, world_size, root):
    for name, make in RESHARD_KINDS.items():
        model = make_model(0)
        opt = make(model, SMALL_BUCKETS)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        for step in range(K):
            train_step(model, opt, sched, rank, step)
        save_sharded(opt, os.path.join(root, name), extra={"sched": sched.state_dict()})
        full = opt.state_dict()  # (a collective)
        if rank == 0:
            torch.save({"opt": full, "sched": sched.state_dict(), "weights": [p.detach() for p in model.parameters()]},
                       os.path.join(root, name + ".pt"))


def _load_every_kind(rank, world_size, root):
    for name, make in RESHARD_KINDS.items():
        saved = torch.load(os.path.join(root, name + ".pt"))
        runs = {}
        for how in ("load_sharded", "load_state_dict"):
            model = make_model(0)
            opt = make(model, 25.0)  # (another bucket layout too)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
            if how == "load_sharded":
                sched.load_state_dict(load_sharded(opt, os.path.join(root, name))["sched"])
            else:
                opt.load_state_dict(saved["opt"])
                sched.load_state_dict(saved["sched"])
            for p, want in zip(model.parameters(), saved["weights"]):
                assert_bitwise_equal(p, want, f"{name}, {how}: a weight as saved")
            loaded = opt.state_dict()
            for i, entry in saved["opt"]["state"].items():
                assert set(loaded["state"][i]) == set(entry), (name, how, i)
                for key, value in entry.items():
                    assert_bitwise_equal(loaded["state"][i][key], value, f"{name}, {how}: {key} of parameter {i}")
            for step in range(K, 2 * K):
                train_step(model, opt, sched, rank, step)
            runs[how] = [p.detach().clone() for p in model.parameters()], opt.state_dict()["state"]
        (weights, state), (weights_too, state_too) = runs.values()
        for a, b in zip(weights, weights_too):
            assert_bitwise_equal(a, b, f"{name}: a weight trained on from the sharded checkpoint and the state dict")
        for i, entry in state.items():
            for key, value in entry.items():
                assert_bitwise_equal(value, state_too[i][key], f"{name}: {key} of {i}, trained on from both")


@pytest.mark.parametrize("before, after", [(2, 1), (1, 3)])
def test_every_optimizer_and_state_format_reshards_as_saved(tmp_path, before, after):
    """A sharded checkpoint of each optimizer and state format (ShardedSGD's momentum, Lion's, Muon's matrices
    owned by one rank each, AdamW's int16 remainders and bf16 moments), loaded at another world size and bucket
    layout, holds every state tensor and weight bit for bit as the full state dict saved beside it had them, and
    trains on as the same state loaded through load_state_dict does (test_reshard_and_continue_matches_reference
    checks AdamW's fp32 states against the reference)."""
    run_on_ranks(_save_every_kind, before, str(tmp_path))
    run_on_ranks(_load_every_kind, after, str(tmp_path))


def test_plain_torch_adamw_state_dict_loads():
    model = make_model(0)
    params = [p for g in param_groups(model) for p in g["params"]]
    torch_opt = torch.optim.AdamW(param_groups(model), lr=LR)
    for step in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
        torch_opt.step()
    sd = torch_opt.state_dict()
    fp32_weights = [p.detach().clone() for p in params]
    opt = ShardedAdamW(param_groups(model), lr=1.0)  # hyper-parameters come from the dict
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == LR and opt.param_groups[1]["lr"] == LR / 2
    ours = opt.state_dict()["state"]
    for i, p in enumerate(params):
        torch_state = sd["state"][i]
        assert torch.equal(ours[i]["exp_avg"], torch_state["exp_avg"])
        assert torch.equal(ours[i]["exp_avg_sq"], torch_state["exp_avg_sq"])
        assert float(ours[i]["step"]) == float(torch_state["step"]) == 2
        assert torch.equal(ours[i]["master"], fp32_weights[i]), "master: the model's weights at construction"


def test_our_state_dict_loads_into_torch_adamw_which_carries_on():
    """The way off tritonshard: an fp32 model given the masters, torch.optim.AdamW given our state_dict. torch's
    load takes our groups (and fills in its own switches), our moments and counts as they are, and steps."""
    model = make_model(0)
    opt = ShardedAdamW(param_groups(model), lr=LR)
    params = [p for g in param_groups(model) for p in g["params"]]
    for step in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step)).to(p.dtype)
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    fp32 = make_model(1)
    fp32_params = [p for g in param_groups(fp32) for p in g["params"]]
    with torch.no_grad():
        for i, p in enumerate(fp32_params):
            p.copy_(sd["state"][i]["master"])
    torch_opt = torch.optim.AdamW(param_groups(fp32), lr=1.0)
    torch_opt.load_state_dict(sd)
    assert torch_opt.param_groups[0]["lr"] == LR and torch_opt.param_groups[1]["lr"] == LR / 2
    for i, p in enumerate(fp32_params):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch_opt.state[p][key], sd["state"][i][key]), (i, key)
        p.grad = torch.ones_like(p)
    torch_opt.step()
    assert float(torch_opt.state[fp32_params[0]]["step"]) == 3


def _other_models():
    class Fewer(torch.nn.Module):  # one parameter missing
        def __init__(self):
            super().__init__()
            m = make_model(0)
            self.fc1, self.norm, self.fc2 = m.fc1, m.norm, m.fc2
    wrong_shape = make_model(0)
    wrong_shape.fc2 = torch.nn.Linear(11, 6)
    m = make_model(0)
    fewer = Fewer()
    return [
        ("missing parameter", lambda: ShardedAdamW(fewer.parameters(), lr=LR), "parameters"),
        ("wrong shape", lambda: ShardedAdamW(param_groups(wrong_shape), lr=LR), r"shape is \[5, 11\] in the "
         r"checkpoint but \[6, 11\]"),
        ("one group", lambda: ShardedAdamW([p for g in param_groups(m) for p in g["params"]], lr=LR),
         "param groups"),
    ]


@pytest.mark.parametrize("case", range(3))
def test_mismatched_checkpoints_are_named(tmp_path, case):
    model, opt, sched = _setup()
    train_step(model, opt, sched, 0, 0)
    save_sharded(opt, str(tmp_path / "ckpt"))
    full = opt.state_dict()
    name, make, match = _other_models()[case]
    with pytest.raises(CheckpointMismatchError, match=match):
        load_sharded(make(), str(tmp_path / "ckpt"))
    with pytest.raises(ValueError):  # the gathered format names it too
        make().load_state_dict(full)
    with pytest.raises(FileNotFoundError, match="not a tritonshard"):
        load_sharded(opt, str(tmp_path))


_SAVER = textwrap.dedent("""
    import sys, torch
    from tritonshard import ShardedAdamW
    from tritonshard.checkpoint import save_checkpoint
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (1_000_003, 524_287, 3)]
    opt = ShardedAdamW(params)
    step = 0
    while True:
        step += 1
        for b in opt.buckets:  # every value in checkpoint k is k: a torn checkpoint cannot look whole
            b.master.fill_(step); b.step.fill_(step)
            for t in b.state.values():
                t.fill_(step)
        save_checkpoint(opt, sys.argv[1], step, extra={"step": step}, keep=2)
        print(step, flush=True)
""")


def test_a_save_killed_part_way_leaves_the_previous_checkpoint_loadable(tmp_path):
    rng = random.Random(0)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    # four savers in two rounds: two directories, a saver in each started together (each spends ~5 s importing
    # torch before its first save: one after the other the four took 24 s), each killed at its own arbitrary point
    # of a later save; the second round's savers start over in the directories the first round's left (a restart
    # after a crash: a torn checkpoint there, and `latest` at a later step than the new run's first saves)
    directories = [str(tmp_path / f"ckpts{i}") for i in range(2)]
    for _ in range(2):
        procs = [subprocess.Popen([sys.executable, "-c", _SAVER, directory], stdout=subprocess.PIPE, env=env,
                                  text=True) for directory in directories]
        try:
            for proc in procs:
                assert proc.stdout.readline().strip(), "the saver completes at least one checkpoint"
                time.sleep(rng.uniform(0.0, 0.4))  # then dies at an arbitrary point of a later save
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
                proc.stdout.close()
        for directory in directories:
            _check_latest_loads(directory)


def _check_latest_loads(directory: str) -> None:
    """``latest`` in ``directory`` names a whole checkpoint: every value in it is its step."""
    path = latest_checkpoint(directory)
    assert path is not None
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (1_000_003, 524_287, 3)]
    opt = ShardedAdamW(params)
    extra = load_sharded(opt, path)
    k = extra["step"]
    for b in opt.buckets:
        assert float(b.step) == k
        for piece in b.param_buffer.shard_pieces():
            sl = slice(piece.shard_start, piece.shard_end)
            assert bool((b.master[sl] == k).all()) and all(bool((t[sl] == k).all()) for t in b.state.values())


def test_importing_the_checkpoint_module_leaves_dcp_until_the_first_sharded_save(tmp_path):
    # torch.distributed.checkpoint costs ~2 s of CPU per process to import: every rank of the example paid it at
    # start-up, before it had anything to save (measured 4.35 s for `import tritonshard.checkpoint`, 2.3 s without)
    code = ("import sys, tritonshard.checkpoint as c; assert 'torch.distributed.checkpoint' not in sys.modules, "
            "'imported at start-up'; import torch, tritonshard; m = torch.nn.Linear(3, 2); "
            "o = tritonshard.ShardedAdamW(m.parameters()); c.save_sharded(o, sys.argv[1]); "
            "assert 'torch.distributed.checkpoint' in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ckpt")], capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]


def _numpy_rng_state():
    import numpy as np
    return {"numpy": np.random.default_rng(0).bit_generator.state, "legacy": np.random.get_state()}


@pytest.mark.parametrize("extra,where,kind", [
    (lambda np: {"step": 3, "best": np.float64(0.5)}, "extra['best']", "numpy.float64"),  # a np.mean of losses
    (lambda np: {"rng": _numpy_rng_state()}, "extra['rng']['legacy'][1]", "numpy.ndarray"),
    (lambda np: {"runs": [1, {"out": __import__("pathlib").PurePosixPath("/x")}]}, "extra['runs'][1]['out']",
     "pathlib.PurePosixPath"),
    (lambda np: {"fn": lambda: 0}, "extra['fn']", "builtins.function"),
])
def test_an_extra_that_could_not_be_loaded_is_refused_before_anything_is_written(tmp_path, extra, where, kind):
    """meta.pt is read with torch.load(weights_only=True): these used to save without a word and make the
    checkpoint unloadable (an UnpicklingError at load_sharded)."""
    import numpy as np
    model, opt, sched = _setup()
    train_step(model, opt, sched, 0, 0)
    path = str(tmp_path / "ckpt")
    with pytest.raises(TypeError, match=rf"{re.escape(where)} is a {re.escape(kind)}, which load_sharded cannot "
                                        r"read back"):
        save_sharded(opt, path, extra=extra(np))
    assert os.listdir(tmp_path) == []
    with pytest.raises(TypeError, match="extra must be a dict"):
        save_sharded(opt, path, extra=[1, 2])


def test_bad_arguments_to_the_checkpoint_calls_are_named_before_anything_is_written(tmp_path):
    """Until session 49 a model or a torch.optim optimizer passed as ``opt`` failed on a private attribute ("'Linear'
    object has no attribute '_entry'"), a path of None inside ``os``, and a float step after the directory was made
    ("Unknown format code 'd'")."""
    model, opt, sched = _setup()
    train_step(model, opt, sched, 0, 0)
    torch_opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])  # (not the model's: it would take them over)
    for call in (lambda o: save_sharded(o, str(tmp_path / "a")), lambda o: load_sharded(o, str(tmp_path / "a")),
                 lambda o: save_checkpoint(o, str(tmp_path), 1)):
        with pytest.raises(TypeError, match=r"\(\) takes a tritonshard optimizer \(ShardedAdamW, ShardedSGD, \.\.\.\) "
                                            rf"as its first argument, got {type(model).__name__}$"):
            call(model)
        with pytest.raises(TypeError, match=r"got AdamW: save a torch.optim optimizer with torch.save\(opt"):
            call(torch_opt)
    with pytest.raises(TypeError, match=r"save_sharded\(\): path must be a str or an os.PathLike, got NoneType"):
        save_sharded(opt, None)
    with pytest.raises(TypeError, match=r"load_sharded\(\): path must be a str or an os.PathLike, got int"):
        load_sharded(opt, 3)
    with pytest.raises(TypeError, match=r"save_checkpoint\(\): directory must be a str or an os.PathLike"):
        save_checkpoint(opt, None, 1)
    for step, exc, match in ((2.0, TypeError, "step must be an int, got float"),
                             (True, TypeError, "step must be an int, got bool"),
                             (-1, ValueError, "step must be >= 0, got -1")):
        with pytest.raises(exc, match=rf"save_checkpoint\(\): {match}"):
            save_checkpoint(opt, str(tmp_path / "ckpts"), step)
    assert os.listdir(tmp_path) == []
    # what an int is, in the loop's hands: numpy's, a 0-d integer tensor (a step counter kept on the host)
    import numpy as np
    assert save_checkpoint(opt, str(tmp_path / "ckpts"), np.int64(3)).endswith("step_00000003")
    assert save_checkpoint(opt, tmp_path / "ckpts", torch.tensor(4)).endswith("step_00000004")
    assert latest_checkpoint(str(tmp_path / "ckpts")).endswith("step_00000004")


def test_rng_states_and_nested_values_in_extra_come_back_from_the_load(tmp_path):
    import numpy as np
    model, opt, sched = _setup()
    train_step(model, opt, sched, 0, 0)
    legacy = np.random.get_state()
    extra = {"step": 1, "torch": torch.get_rng_state(), "python": random.getstate(), "loss": 0.25,
             "numpy": {"keys": torch.from_numpy(legacy[1].copy()), "pos": int(legacy[2])},
             "tags": ("a", None, True), "ids": {3, 5}, "nested": [{"x": torch.arange(3)}]}
    save_sharded(opt, str(tmp_path / "ckpt"), extra=extra)
    got = load_sharded(opt, str(tmp_path / "ckpt"))
    assert got.keys() == extra.keys()
    assert torch.equal(got["torch"], extra["torch"]) and got["python"] == extra["python"]
    assert torch.equal(got["numpy"]["keys"], extra["numpy"]["keys"]) and got["numpy"]["pos"] == extra["numpy"]["pos"]
    assert (got["loss"], got["tags"], got["ids"], got["step"]) == (0.25, ("a", None, True), {3, 5}, 1)
    assert torch.equal(got["nested"][0]["x"], torch.arange(3))
