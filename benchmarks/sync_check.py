"""Prove that a ShardedAdamW step never waits on the host: run it under torch.cuda.set_sync_debug_mode("error").

    python -m benchmarks.sync_check        # CUDA only

Backward, clip_grad_norm_, step and zero_grad of a small model run with synchronizing CUDA calls turned into
errors, after one warm-up step (which fills the flatten kernel's device-side tables and compiles the kernels).
"""

import sys

import torch

import tritonshard


def main() -> int:
    if not torch.cuda.is_available():
        print("sync_check: no CUDA device, nothing to check")
        return 0
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(257, 129), torch.nn.GELU(), torch.nn.Linear(129, 61)).cuda()
    opt = tritonshard.ShardedAdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, 257, device="cuda", dtype=torch.bfloat16)

    def one_step():
        model(x).float().square().mean().backward()
        norm = opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        return norm

    one_step()  # warm-up: compiles kernels, uploads the flatten schedule
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            norm = one_step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    print(f"sync_check: 3 steps under set_sync_debug_mode('error') passed; last grad norm {float(norm):.4f}, "
          f"skipped steps {int(opt.skipped_steps)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
