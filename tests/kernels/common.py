"""What the kernel tests share: the device under test and the sizes every kernel must handle."""

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# 0, 1, a small prime, a prime above every kernel's BLOCK (4096), and a multi-block size that is not a
# multiple of any BLOCK.
ODD_SIZES = [0, 1, 199, 4099, 3 * 4096 + 5]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(n, seed, dtype=torch.float32, scale=1.0):
    """Fresh random data on DEVICE (generated on the CPU so CPU and GPU runs see the same values)."""
    return (torch.randn(n, generator=gen(seed)) * scale).to(dtype).to(DEVICE)


def random_fp32_bits(n, seed):
    """fp32 values with uniformly random bit patterns: every exponent, subnormals, inf and NaN included."""
    bits = torch.randint(-2**31, 2**31, (n,), generator=gen(seed), dtype=torch.int64).to(torch.int32)
    return bits.view(torch.float32).to(DEVICE)
