"""A checkpoint directory cannot run code when it is loaded (issue 23, item 1).

DCP stores its ``.metadata`` as a pickle and reads it with ``pickle.load``: a crafted file ran its code, and the
load then succeeded (measured on the previous code, also through ``examples/train_gpt.py --resume``). tritonshard
now reads it through an unpickler that resolves only DCP's metadata types, torch's dtypes and paths. Each crafted
file here would create a marker file if its code ran; the load must raise tritonshard's own error (an Exception,
naming the file) and the marker must not exist.
"""

import io
import os
import pickle

import pytest
import torch

from tests.distributed import run_on_ranks
from tritonshard import ShardedAdamW
from tritonshard.checkpoint import (CheckpointError, UnsafeCheckpointError, _MetadataUnpickler, load_sharded,
                                    save_sharded)


class Payload:
    """What an attacker would put in the pickle: calls os.system when unpickled."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _optimizer():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(37)), torch.nn.Parameter(torch.randn(5, 7))]
    opt = ShardedAdamW(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


def _craft(path: str, marker: str, nested: bool) -> None:
    meta_file = os.path.join(path, ".metadata")
    if nested:  # a valid Metadata whose storage_meta carries the payload: the outer structure checks out
        with open(meta_file, "rb") as f:
            metadata = _MetadataUnpickler(f, meta_file).load()
        metadata.storage_meta.modules = [Payload(marker)]
        data = pickle.dumps(metadata)
    else:
        data = pickle.dumps(Payload(marker))
    with open(meta_file, "wb") as f:
        f.write(data)
    _refresh_checksums(path)


def _refresh_checksums(path: str) -> None:
    """What an attacker would do next: record the crafted file's checksum (checksums catch corruption, not
    intent), so the refusal tested here is the unpickler's."""
    from tritonshard.checkpoint import _META_DIGEST, _digest, atomic_save, load_file
    meta_path = os.path.join(path, "meta.pt")
    meta = load_file(meta_path)
    meta["checksums"][".metadata"] = _digest(os.path.join(path, ".metadata"))
    atomic_save(meta, meta_path)
    with open(os.path.join(path, _META_DIGEST), "w") as f:
        f.write(_digest(meta_path) + "\n")


@pytest.mark.parametrize("nested", [False, True], ids=["whole-file", "inside-valid-metadata"])
def test_a_crafted_metadata_runs_no_code(tmp_path, nested):
    opt = _optimizer()
    path = str(tmp_path / "ckpt")
    save_sharded(opt, path)
    marker = tmp_path / "pwned"
    _craft(path, str(marker), nested)
    pickle.loads(pickle.dumps(Payload(str(tmp_path / "control"))))  # the payload works when unpickled freely
    assert (tmp_path / "control").exists()
    before = [t.clone() for b in opt.buckets for t in (b.master, *b.state.values())]
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata asks to load posix\.system"):
        load_sharded(opt, path)
    assert not marker.exists(), "the checkpoint's code ran"
    after = [t for b in opt.buckets for t in (b.master, *b.state.values())]
    assert all(torch.equal(x, y) for x, y in zip(before, after)), "a refused load changed the optimizer"


def test_the_error_is_an_exception_and_a_checkpoint_error():
    # `except Exception` in a training loop must catch it (DCP's own CheckpointException is a BaseException)
    assert issubclass(UnsafeCheckpointError, CheckpointError) and issubclass(CheckpointError, Exception)


def test_a_truncated_metadata_is_a_checkpoint_error_naming_the_file(tmp_path):
    opt = _optimizer()
    path = str(tmp_path / "ckpt")
    save_sharded(opt, path)
    meta_file = os.path.join(path, ".metadata")
    with open(meta_file, "rb") as f:
        data = f.read()
    with open(meta_file, "wb") as f:
        f.write(data[:len(data) // 2])
    _refresh_checksums(path)
    with pytest.raises(CheckpointError, match=r"\.metadata is not readable checkpoint metadata"):
        load_sharded(opt, path)


def test_the_allowlist_reads_what_dcp_writes(tmp_path):
    # every global a real checkpoint's .metadata names is allowed (the loads in tests/test_checkpoint.py too)
    opt = _optimizer()
    path = str(tmp_path / "ckpt")
    save_sharded(opt, path)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        data = f.read()
    metadata = _MetadataUnpickler(io.BytesIO(data), "x").load()
    assert type(metadata).__name__ == "Metadata" and metadata.state_dict_metadata
    load_sharded(opt, path)


def _two_ranks(rank, world_size, path, marker):
    opt = _optimizer()
    save_sharded(opt, path)
    if rank == 0:
        _craft(path, marker, nested=True)
    torch.distributed.barrier()
    with pytest.raises(CheckpointError):
        load_sharded(opt, path)
    assert not os.path.exists(marker)


def test_two_ranks_both_refuse(tmp_path):
    run_on_ranks(_two_ranks, 2, str(tmp_path / "ckpt"), str(tmp_path / "pwned"))
