"""Long runs of tests/optim/test_loop_fuzz.py's random training loops (the suite runs 40 per machine) and of
tests/optim/test_loop_fuzz_ranks.py's two-rank programs (the suite runs 12 per machine):

    .venv/bin/python -m tests.optim.loop_fuzz_long --examples 1000 --steps 30
    .venv/bin/python -m tests.optim.loop_fuzz_long --examples 200 --machines ranks-adamw,ranks-adamw-overlap,ranks-sgd
    .venv/bin/python -m tests.optim.loop_fuzz_long --examples 400 --machines ranks-after-clip

Random (not derandomized) examples; a failure prints hypothesis's shrunk loop, a call per line. Session 18 ran
1,000 loops of 30 calls per machine at f67b4d2 on the 2-core VM in about 10 minutes, without a failure. (The
two-rank programs have at most 14 calls: ``--steps`` does not apply to them.)"""

import argparse
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (as tests/conftest.py: before triton is imported)

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402

from tests import interpreter_speed  # noqa: E402
from tests.optim import test_loop_fuzz  # noqa: E402

MACHINES = {m.__name__: m for m in (test_loop_fuzz.TrainingLoop, test_loop_fuzz.OverlappedTrainingLoop,
                                    test_loop_fuzz.OneRankOverlappedTrainingLoop, test_loop_fuzz.SGDTrainingLoop,
                                    test_loop_fuzz.ScaledTrainingLoop, test_loop_fuzz.CompiledTrainingLoop,
                                    test_loop_fuzz.TracedTrainingLoop, test_loop_fuzz.GraphedTrainingLoop,
                                    test_loop_fuzz.LionTrainingLoop, test_loop_fuzz.MuonTrainingLoop,
                                    test_loop_fuzz.MuonOverlappedTrainingLoop, test_loop_fuzz.SGDGraphedTrainingLoop,
                                    test_loop_fuzz.LionGraphedTrainingLoop,
                                    test_loop_fuzz.OverlappedGraphedTrainingLoop,
                                    test_loop_fuzz.RemaindersTrainingLoop, test_loop_fuzz.BF16StateTrainingLoop,
                                    test_loop_fuzz.FP32GradsTrainingLoop, test_loop_fuzz.FP32ScaledTrainingLoop,
                                    test_loop_fuzz.FP32OverlappedTrainingLoop, test_loop_fuzz.FP16TrainingLoop,
                                    test_loop_fuzz.FP16OverlappedTrainingLoop,
                                    test_loop_fuzz.FP16ScaledTrainingLoop,
                                    test_loop_fuzz.FP16ScaledOverlappedTrainingLoop,
                                    test_loop_fuzz.FP16ScaledGraphedTrainingLoop,
                                    test_loop_fuzz.FP16ScaledTracedTrainingLoop)}


def _ranks_machine(machine: str, examples: int) -> None:
    """``machine``: one of test_loop_fuzz_ranks.MACHINES, or "after-clip" (its CHANGED_AFTER_CLIP programs, on each
    machine in turn)."""
    from hypothesis import given
    from hypothesis import strategies as st

    from tests.optim import test_loop_fuzz_ranks as ranks
    ranks.HANG_S = 15  # (shrinking a hang re-runs it many times)
    after_clip = machine == "after-clip"

    @settings(max_examples=examples, deadline=None, derandomize=False, database=None,
              suppress_health_check=list(HealthCheck))
    @given(program=st.one_of(ranks.CHANGED_AFTER_CLIP, ranks.DROPPED_ON_ONE_RANK) if after_clip else st.one_of(ranks.PROGRAMS, ranks.RECIPES)
           if machine.startswith(ranks.SCALED) else ranks.PROGRAMS,
           on=st.sampled_from(sorted(ranks.MACHINES)) if after_clip else st.just(machine))
    def run(program, on):
        ranks._check(on, program)
    run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=1000, help="loops per machine")
    parser.add_argument("--steps", type=int, default=30, help="calls per loop (at most)")
    from tests.optim import test_loop_fuzz_ranks
    ranks = ["ranks-" + m for m in (*test_loop_fuzz_ranks.MACHINES, "after-clip")]
    parser.add_argument("--machines", default=",".join(MACHINES),
                        help="comma-separated: " + ", ".join([*MACHINES, *ranks]))
    args = parser.parse_args()
    interpreter_speed.install()
    for name in args.machines.split(","):
        if name.startswith("ranks-"):
            _ranks_machine(name[len("ranks-"):], args.examples)
            print(f"{name}: {args.examples} two-rank programs, no failure", flush=True)
            continue
        run_state_machine_as_test(MACHINES[name], settings=settings(
            max_examples=args.examples, stateful_step_count=args.steps, deadline=None, derandomize=False,
            suppress_health_check=list(HealthCheck)))
        print(f"{name}: {args.examples} loops of up to {args.steps} calls, no failure", flush=True)


if __name__ == "__main__":
    main()
