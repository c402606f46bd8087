"""``torchrun --standalone`` for the examples' make targets, with a clean Ctrl-C.

    python examples/launch.py --nproc-per-node 2 examples/train_gpt.py [args]

Ctrl-C in a terminal signals the whole foreground process group: the training workers (which finish their step,
save a checkpoint and exit 0), and torchrun itself, whose agent then raises a SignalException and prints a
25-line traceback while it kills the workers, whatever they were doing. Here torchrun runs in a session of its own,
so the terminal's Ctrl-C reaches only this launcher, which forwards it to the workers alone; torchrun sees them
exit 0 and exits 0. A second Ctrl-C kills everything. (``make`` itself still says "Interrupt": it got the signal.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def _children(pid: int) -> list[int]:
    """The direct children of ``pid`` (torchrun's workers): from every thread's /proc children list (torchrun may
    start the workers from another thread than its main one, and each thread lists only its own), else ``pgrep``."""
    tasks = f"/proc/{pid}/task"
    if os.path.isdir(tasks):
        found = set()
        for tid in os.listdir(tasks):
            try:
                with open(os.path.join(tasks, tid, "children")) as f:
                    found.update(int(c) for c in f.read().split())
            except OSError:  # the thread ended meanwhile, or a kernel without children lists
                continue
        if found:
            return sorted(found)
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(c) for c in out.stdout.split()]


def main(argv: list[str]) -> int:
    # Ctrl-C must reach this process as KeyboardInterrupt even where it was started with SIGINT ignored (a
    # background job of a non-interactive shell inherits SIG_IGN, and so would every process it starts)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", *argv],
                            start_new_session=True)
    interrupts = 0
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:
            interrupts += 1
            if interrupts == 1:
                print("\nCtrl-C: the workers stop after this step and save a checkpoint (Ctrl-C again kills them)",
                      file=sys.stderr, flush=True)
                for child in _children(proc.pid):
                    os.kill(child, signal.SIGINT)
            else:
                os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
