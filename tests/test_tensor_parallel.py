"""Tensor parallelism: TP=2 (gloo, two processes) gives the hidden states, logits and greedy tokens of TP=1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtp_train.models import ModelConfigError, load_model
from mtp_train.models.families import args_from_dir
from mtp_train.models.tensor_parallel import local_args, vocab_range

sys.path.insert(0, str(Path(__file__).parent))
from _tp_worker import run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
WORKER = Path(__file__).parent / "_tp_worker.py"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_tp2_equals_tp1(tiny_checkpoints, tmp_path, name):
    path = tiny_checkpoints[name][0]
    ref = run(load_model(path, dtype="float32", backend="torch"))
    out = tmp_path / "tp2.pt"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(WORKER), str(path), str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out)
    torch.testing.assert_close(got["hidden"], ref["hidden"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["logits"], ref["logits"], rtol=1e-5, atol=1e-5)
    assert got["tokens"] == ref["tokens"]


def test_local_shapes_and_vocabulary_shards(tiny_checkpoints):
    args = args_from_dir(tiny_checkpoints["llama"][0])
    loc = local_args(args, 2)
    assert (loc.num_heads, loc.num_kv_heads, loc.intermediate_size) == (2, 1, 64)
    assert loc.hidden_size == args.hidden_size and loc.head_dim == args.head_dim
    with pytest.raises(ModelConfigError, match="num_kv_heads=2"):
        local_args(args, 4)
    # an uneven vocabulary: every rank holds ceil(V / tp) rows, the last one padded
    assert [vocab_range(255, 2, r) for r in (0, 1)] == [(0, 128, 128), (128, 255, 128)]
