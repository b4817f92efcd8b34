"""Sequence parallelism (train.sequence_parallel) and activation checkpointing (train.activation_checkpointing).

The equality test runs one packed batch (a 4096-token sample and a short one) through each head type's training
unroll on 2 gloo ranks, each holding half the rows: the sum of the two ranks' losses and of their gradients equals
the 1-rank loss and gradients (fp32). Checkpointing gives the same loss and gradients and keeps fewer saved bytes.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from mtp_train.cli.train import train_main
from mtp_train.config import ConfigError, HeadConfig, LossConfig, TrainConfig
from mtp_train.config.train import LoopConfig
from mtp_train.dist import sequence_groups
from mtp_train.heads import build_head
from mtp_train.heads.sequence import SequenceShard, ulysses_heads
from mtp_train.models.families import args_from_dir
from mtp_train.precompute.synthetic import make_folder
from mtp_train.train.losses import step_token_counts, unrolled_loss
from mtp_train.train.sequence_parallel import SequenceParallel, check_sequence_parallel
from tests._family import save_random
from tests.conftest import compose_config, make_tiny_checkpoint, metrics_by_step

pytestmark = pytest.mark.usefixtures("one_thread")

LONG, SHORT = 4096, 37  # the batch: a long sample and a short one (4133 rows: one pad row under SP = 2)
# name → (head settings, loss settings, the target's KV heads, activation checkpointing): eagle3 over a single KV
# head repeats it for 2 ranks
CASES: dict[str, tuple[dict, dict, int, bool]] = {
    "mtp": ({"type": "mtp"}, {"steps": 3}, 2, False),
    "mtp-causal": ({"type": "mtp"}, {"steps": 2, "unroll_attention": "causal"}, 2, False),
    "eagle3": ({"type": "eagle3", "aux_layers": [1, 2, 3], "draft_vocab_size": 200}, {"steps": 3}, 1, False),
    "eagle3-recomputed": ({"type": "eagle3", "aux_layers": [1, 2, 3], "draft_vocab_size": 200}, {"steps": 3}, 2,
                          True),
    "eagle3-masked-dpace": ({"type": "eagle3", "aux_layers": [1, 2, 3], "draft_vocab_size": 200},
                            {"steps": 3, "mask_out_of_draft": True, "position_weights": "dpace"}, 2, False),
    "dflash": ({"type": "dflash", "aux_layers": [1, 2, 3], "block_size": 4, "layers": 2, "max_anchors": 64},
               {"steps": 3}, 2, False),
    "dspark-recomputed": ({"type": "dspark", "aux_layers": [1, 2, 3], "block_size": 4, "layers": 2,
                           "max_anchors": 64}, {"steps": 4}, 2, True),
}
DP_SP_CASES = ["mtp", "dflash"]  # also on 4 ranks: 2 groups of 2


def _target(root: Path, kv_heads: int) -> Path:
    path = root / f"llama-kv{kv_heads}"
    if not (path / "config.json").is_file():
        make_tiny_checkpoint("llama", path, num_key_value_heads=kv_heads, max_position_embeddings=8192)
    return path


def _batch(width: int, hidden_size: int) -> dict:
    """A packed batch of a LONG and a SHORT sample: tokens, a loss mask with gaps, hidden and aux states."""
    g = torch.Generator().manual_seed(0)
    rows = LONG + SHORT
    mask = (torch.rand(rows, generator=g) < 0.7).to(torch.uint8)
    mask[:5] = 0  # a prompt
    return {"input_ids": torch.randint(0, 255, (rows,), generator=g), "loss_mask": mask,
            "hidden": torch.randn(rows, hidden_size, generator=g),
            "aux_hidden": torch.randn(rows, width, generator=g) if width else None, "seq_lens": [LONG, SHORT]}


def _head(path: Path, head_kw: dict):
    torch.manual_seed(0)
    head = build_head(HeadConfig.of(**head_kw), path, dtype="float32")
    head.train()
    return head


def _loss_and_grads(head, batch: dict, loss_cfg: LossConfig, shard: SequenceShard | None = None,
                    counts: torch.Tensor | None = None, checkpoint: bool = False):
    head.zero_grad(set_to_none=True)
    aux = batch["aux_hidden"] if head.aux_layers else None
    loss, _ = unrolled_loss(head, batch["hidden"], batch["input_ids"], batch["loss_mask"], batch["seq_lens"],
                            loss_cfg, num_tokens=counts, aux_hidden=aux, shard=shard, checkpoint=checkpoint)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}


def _worker(rank: int, world: int, size: int, names: list[str], root: str) -> None:
    """One rank of a run of `world` ranks in groups of `size`: the listed cases' local loss and gradients, saved
    to root/w{world}-rank{rank}.pt. Every group holds the same batch (what its data-parallel rank would read)."""
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"file://{root}/store-w{world}", rank=rank, world_size=world)
    try:
        sp = SequenceParallel.setup(size, rank, world, torch.device("cpu"))
        results = {}
        for name in names:
            head_kw, loss_kw, kv, recompute = CASES[name]
            head = _head(_target(Path(root), kv), head_kw)
            batch = _batch(head.input_width if head.aux_layers else 0, head.args.hidden_size)
            loss_cfg = LossConfig(**loss_kw)
            shard = sp.shard(LONG + SHORT)
            rows = head.loss_rows(batch["input_ids"], batch["loss_mask"], batch["seq_lens"])
            counts = step_token_counts(batch["loss_mask"], batch["seq_lens"], loss_cfg.steps, rows, shard)
            tdist.all_reduce(counts, group=sp.groups.group)  # each row counted once, by the rank that holds it
            results[name] = _loss_and_grads(head, batch, loss_cfg, shard, counts, checkpoint=recompute)
        torch.save(results, Path(root) / f"w{world}-rank{rank}.pt")
    finally:
        tdist.destroy_process_group()


def _spawn(root: Path, world: int, size: int, names: list[str]) -> list[dict]:
    for name in names:  # the targets are made once, before the ranks read them
        _target(root, CASES[name][2])
    mp.start_processes(_worker, args=(world, size, names, str(root)), nprocs=world, start_method="spawn")
    return [torch.load(root / f"w{world}-rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def sp2_results(tmp_path_factory) -> list[dict]:
    """Every case on 2 gloo ranks with train.sequence_parallel = 2 (one spawn for all cases)."""
    return _spawn(tmp_path_factory.mktemp("sp"), 2, 2, list(CASES))


def _reference(root: Path, name: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The case's loss and gradients on one rank, without sequence parallelism (or checkpointing)."""
    head_kw, loss_kw, kv, _ = CASES[name]
    head = _head(_target(root, kv), head_kw)
    batch = _batch(head.input_width if head.aux_layers else 0, head.args.hidden_size)
    loss_cfg = LossConfig(**loss_kw)
    rows = head.loss_rows(batch["input_ids"], batch["loss_mask"], batch["seq_lens"])
    counts = step_token_counts(batch["loss_mask"], batch["seq_lens"], loss_cfg.steps, rows)
    return _loss_and_grads(head, batch, loss_cfg, counts=counts)


def _assert_group_equals(group: list[dict], name: str, ref_loss: torch.Tensor,
                         ref_grads: dict[str, torch.Tensor]) -> None:
    """The group's ranks' losses and gradients, summed, equal the 1-rank ones; every rank held counted rows."""
    losses = [r[name][0] for r in group]
    assert all(bool(x != 0) for x in losses)
    torch.testing.assert_close(sum(losses), ref_loss, rtol=1e-5, atol=1e-6)
    grads = [r[name][1] for r in group]
    assert all(set(g) == set(ref_grads) for g in grads)
    for n, ref in ref_grads.items():
        torch.testing.assert_close(sum(g[n] for g in grads), ref, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("name", list(CASES))
def test_sp2_loss_and_gradients_equal_sp1(sp2_results, tmp_path_factory, name):
    ref_loss, ref_grads = _reference(Path(str(tmp_path_factory.getbasetemp())) / "sp0", name)
    _assert_group_equals(sp2_results, name, ref_loss, ref_grads)


@pytest.mark.slow
def test_two_groups_of_two_ranks_each_equal_sp1(tmp_path):
    """4 ranks, train.sequence_parallel = 2: groups [0, 1] and [2, 3] (data parallel over them), each exact."""
    results = _spawn(tmp_path, 4, 2, DP_SP_CASES)
    for name in DP_SP_CASES:
        ref_loss, ref_grads = _reference(tmp_path, name)
        for group in (results[:2], results[2:]):
            _assert_group_equals(group, name, ref_loss, ref_grads)


# -- activation checkpointing --

def _saved_bytes(fn) -> int:
    """Bytes of the distinct tensors autograd saves for the backward while `fn` runs."""
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor):
        if t.device.type == "cpu" and t.untyped_storage().nbytes():
            seen[(t.untyped_storage().data_ptr(),)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("name", ["mtp", "eagle3", "dflash"])
def test_activation_checkpointing_same_loss_and_gradients_fewer_saved_bytes(tmp_path, name):
    head_kw, loss_kw, kv, _ = CASES[name]
    head = _head(_target(tmp_path, kv), head_kw)
    batch = _batch(head.input_width if head.aux_layers else 0, head.args.hidden_size)
    batch = {**batch, **{k: batch[k][:1024] for k in ("input_ids", "loss_mask", "hidden")}, "seq_lens": [1000, 24],
             "aux_hidden": None if batch["aux_hidden"] is None else batch["aux_hidden"][:1024]}
    loss_cfg = LossConfig(**loss_kw)
    ref_loss, ref_grads = _loss_and_grads(head, batch, loss_cfg)
    loss, grads = _loss_and_grads(head, batch, loss_cfg, checkpoint=True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    for n, ref in ref_grads.items():
        torch.testing.assert_close(grads[n], ref, rtol=1e-5, atol=1e-7, msg=n)
    plain = _saved_bytes(lambda: _loss_and_grads(head, batch, loss_cfg))
    recomputed = _saved_bytes(lambda: _loss_and_grads(head, batch, loss_cfg, checkpoint=True))
    assert recomputed < plain, (recomputed, plain)


# -- refusals, before any work --

def _train_cfg(path: Path, head_type: str, n: int, **train) -> TrainConfig:
    cfg = TrainConfig(head=HeadConfig(type=head_type), train=LoopConfig(sequence_parallel=n, **train))
    cfg.model.path = str(path)
    return cfg


def test_refusals_name_the_setting(tmp_path):
    path = _target(tmp_path, 2)  # 4 query heads, 2 KV heads
    with pytest.raises(ConfigError, match=r"train.sequence_parallel=2 does not divide the world size 3"):
        check_sequence_parallel(_train_cfg(path, "mtp", 2), world=3)
    with pytest.raises(ConfigError, match=r"train.sequence_parallel=8 .* num_attention_heads=4"):
        check_sequence_parallel(_train_cfg(path, "mtp", 8), world=8)
    with pytest.raises(ConfigError, match="train.sequence_parallel=0"):
        LoopConfig(sequence_parallel=0)
    with pytest.raises(ConfigError, match="train.sequence_parallel=3 does not divide the world size 4"):
        sequence_groups(3, 0, 4)
    check_sequence_parallel(_train_cfg(path, "dflash", 8), world=8)  # block drafters split no heads
    check_sequence_parallel(_train_cfg(path, "mtp", 4), world=4)  # 2 KV heads repeated for 4 ranks


def test_ulysses_heads_repeat_kv_heads_only_as_needed(tmp_path):
    args = args_from_dir(_target(tmp_path, 2))  # Hq 4, Hkv 2
    assert [(a.num_heads, a.num_kv_heads, r) for a, r in (ulysses_heads(args, n) for n in (1, 2, 4))] == [
        (4, 2, 1), (2, 1, 1), (1, 1, 2)]


def test_refuses_mla(tmp_path):
    import transformers

    from tests.test_deepseek_v2 import BASE, CONFIGS

    path = tmp_path / "ds"
    save_random(transformers.DeepseekV2Config(**{**BASE, **CONFIGS["lite"]}), path)
    with pytest.raises(ConfigError, match=r"train.sequence_parallel=2: .*latent KV row"):
        check_sequence_parallel(_train_cfg(path, "mtp", 2), world=2)
    check_sequence_parallel(_train_cfg(path, "mtp", 1), world=2)  # N = 1: nothing to split


def test_world_of_one_changes_nothing():
    groups = sequence_groups(1, 0, 1)
    assert (groups.size, groups.index, groups.dp_rank, groups.dp_world, groups.group) == (1, 0, 0, 1, None)
    assert SequenceParallel(groups).shard(100) is None
    assert not tdist.is_initialized()  # no group was made


# -- the trainer --

ROOT = Path(__file__).resolve().parents[1]


def _run_overrides(target: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [f"model.path={target}", "model.device=cpu", "model.backend=torch", f"data.dir={data}", f"out={out}",
            "wandb.mode=disabled", "train.progress=false", "train.micro_batch_tokens=1024", "train.log_every=1",
            "train.eval_every=2", "train.eval_batches=1", "train.save_every=0", "train.max_steps=2",
            "optim.lr=1e-2", "optim.warmup_steps=1", "spec_eval.prompts=[]", "deepspeed=zero2", *extra]


def _torchrun(overrides: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "mtp_train.cli.train", *overrides]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("head", ["mtp", "dflash"])
def test_two_rank_sequence_parallel_run_equals_one_rank(tmp_path, head):
    target = _target(tmp_path, 2)
    data = tmp_path / "pc"
    make_folder(data, 24, target=target, aux_layers=[1, 2, 3], min_len=100, max_len=700, val_fraction=0.2)
    kind = ["head=mtp", "loss.steps=2", "loss.noise_std=0.05"] if head == "mtp" else [
        "head=dflash", "head.aux_layers=[1,2,3]", "head.block_size=4", "loss.steps=3"]
    one = tmp_path / "one"
    train_main(compose_config("train", _run_overrides(target, data, one, *kind)))
    two = tmp_path / "two"
    # the mtp run also recomputes its steps (train.activation_checkpointing): the same numbers again
    recompute = ["train.activation_checkpointing=true"] if head == "mtp" else []
    _torchrun(_run_overrides(target, data, two, *kind, "train.sequence_parallel=2", *recompute))
    a, b = metrics_by_step(one), metrics_by_step(two)
    for s in (1, 2):
        for key in ("train/num_tokens", "train/samples_seen", "train/tokens_seen"):
            assert b[s][key] == a[s][key], (s, key)
        for key in ("train/loss", "train/step1/loss", "train/grad_norm", "train/top1"):
            assert b[s][key] == pytest.approx(a[s][key], rel=1e-4, abs=1e-6), (s, key)
    assert b[2]["eval/num_tokens"] == a[2]["eval/num_tokens"]
    assert b[2]["eval/loss"] == pytest.approx(a[2]["eval/loss"], rel=1e-4)  # sharded unroll = inference path


@pytest.mark.slow
def test_eagle3_trains_on_16k_and_32k_token_samples_over_two_ranks(tmp_path):
    """The acceptance run: a tiny random Qwen3 target (q/k norms) of 32768 positions, eagle3 with the chain
    attention, two steps on 16k-token samples and two on 32k-token ones, each sample split over 2 ranks."""
    target = tmp_path / "qwen3"
    make_tiny_checkpoint("qwen3", target, max_position_embeddings=32768, head_dim=16, hidden_size=32,
                         intermediate_size=64)
    for tokens in (16384, 32768):
        data, out = tmp_path / f"pc{tokens}", tmp_path / f"run{tokens}"
        make_folder(data, 2, target=target, aux_layers=[1, 2, 3], min_len=tokens, max_len=tokens, val_fraction=0.0)
        _torchrun([*_run_overrides(target, data, out, "head=eagle3", "head.aux_layers=[1,2,3]", "loss.steps=3",
                                   "train.sequence_parallel=2", "train.eval_batches=0", "train.eval_every=0"),
                   f"train.micro_batch_tokens={tokens}"])
        m = metrics_by_step(out)
        assert sorted(m) == [1, 2]
        assert all(math.isfinite(m[s]["train/loss"]) and math.isfinite(m[s]["train/grad_norm"]) for s in m)
        assert m[2]["train/tokens_seen"] == 2 * tokens  # one sample a step, counted once per group


def test_a_shard_pads_the_batch_to_equal_contiguous_rows():
    shards = [SequenceShard.split(None, 4, k, 4133) for k in range(4)]  # type: ignore[arg-type]
    assert [(s.rows, s.pad, s.lo, s.hi) for s in shards] == [
        (4136, 3, 0, 1034), (4136, 3, 1034, 2068), (4136, 3, 2068, 3102), (4136, 3, 3102, 4136)]
    s = shards[3]
    assert s.padded_lens([4096, 37]) == [4096, 37, 3]
    mask = s.padded(torch.ones(4133, dtype=torch.uint8))
    assert mask.shape == (4136,) and int(mask[4133:].sum()) == 0  # the pad sequence is never counted
    counts = [step_token_counts(torch.ones(4133), [4096, 37], 2, shard=x) for x in shards]
    assert torch.equal(sum(counts), step_token_counts(torch.ones(4133), [4096, 37], 2))  # each row counted once
    even = SequenceShard.split(None, 2, 1, 10)  # type: ignore[arg-type]
    assert (even.pad, even.padded_lens([10]), even.lo, even.hi) == (0, [10], 5, 10)
