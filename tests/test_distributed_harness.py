"""The multi-process harness every distributed test relies on (tests/distributed.py): its kept processes must give
each call what a fresh process would, and a failure on any rank must fail the test, never hang or pass."""

import os
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.distributed import RankFailed, run_on_ranks


def _leave_things_behind(rank, world_size, path):
    # what a test may change in its processes: the RNG, the environment, warning filters, grad mode; and a subgroup
    # with a tritonshard optimizer on it (its gloo side group is made over the same ranks again in the next call)
    first_draw = torch.randn(4)
    torch.save(first_draw, os.path.join(path, f"draw-{rank}.pt"))
    os.environ["TESTS_DISTRIBUTED_LEFTOVER"] = "1"
    warnings.simplefilter("error")  # (so the step below must warn of nothing, but for the environment's warning:
    # Triton 3.6's interpreter, the GPU machine's version, warns under numpy >= 1.25 at launches with a 1-element
    # array argument)
    warnings.filterwarnings("ignore", "Conversion of an array with ndim > 0 to a scalar", DeprecationWarning)
    torch.set_grad_enabled(False)
    _optimizer_on_a_subgroup(rank, world_size)


def _optimizer_on_a_subgroup(rank, world_size):
    import tritonshard
    group = dist.new_group(list(range(world_size)))
    params = [torch.nn.Parameter(torch.randn(13))]
    opt = tritonshard.ShardedAdamW(params, lr=1e-3, process_group=group)
    params[0].grad = torch.ones(13, dtype=torch.bfloat16)
    opt.step()  # (its handshakes run on the side group)


def _see_a_fresh_process(rank, world_size, path):
    assert torch.equal(torch.randn(4), torch.load(os.path.join(path, f"draw-{rank}.pt"))), "the RNG was not reset"
    assert "TESTS_DISTRIBUTED_LEFTOVER" not in os.environ
    warnings.warn("a warning is not an error here", UserWarning)
    assert torch.is_grad_enabled()
    t = torch.full((1,), float(rank))
    dist.all_reduce(t)
    assert float(t) == sum(range(world_size))
    _optimizer_on_a_subgroup(rank, world_size)  # a new subgroup over the same ranks, and a new side group


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_call_starts_from_what_a_fresh_process_sees(tmp_path, world_size):
    run_on_ranks(_leave_things_behind, world_size, str(tmp_path))
    run_on_ranks(_see_a_fresh_process, world_size, str(tmp_path))


def _raise_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("rank 1 found something wrong")
    dist.barrier()  # rank 0 waits in a collective that rank 1 never joins: the harness must not hang on it


def _exit_on_rank_0(rank, world_size):
    if rank == 0:
        os._exit(3)
    dist.barrier()


def _all_reduce_sum(rank, world_size):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert float(t) == world_size


def test_a_rank_that_raises_fails_the_call_with_its_traceback_and_the_next_call_runs():
    with pytest.raises(RankFailed, match=r"(?s)rank 1 of 2: Traceback.*ValueError: rank 1 found something wrong"):
        run_on_ranks(_raise_on_rank_1, 2)
    run_on_ranks(_all_reduce_sum, 2)


def test_a_rank_that_dies_fails_the_call_and_the_next_call_runs():
    with pytest.raises(RankFailed, match="rank 0 of 2: its process died \\(exit code 3\\)"):
        run_on_ranks(_exit_on_rank_0, 2)
    run_on_ranks(_all_reduce_sum, 2)


def _hang_on_rank_1(rank, world_size):
    if rank == 1:
        dist.barrier()  # (rank 0 never joins it: the wait of a rank in a collective the others left)


def test_a_call_that_hangs_fails_after_its_timeout_and_the_next_call_runs():
    with pytest.raises(RankFailed, match=r"ranks \[1\] of 2 still running after 2 s \(a hang"):
        run_on_ranks(_hang_on_rank_1, 2, timeout_s=2)
    run_on_ranks(_all_reduce_sum, 2)


def _warn(rank, world_size):
    warnings.warn("deprecated", FutureWarning)


def test_warnings_as_errors_applies_to_that_call_only():
    with pytest.raises(RankFailed, match="FutureWarning: deprecated"):
        run_on_ranks(_warn, 2, warnings_as_errors=FutureWarning)
    run_on_ranks(_warn, 2)


def test_fresh_processes_on_request():
    run_on_ranks(_all_reduce_sum, 2, fresh=True)
