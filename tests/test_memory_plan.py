"""The training memory plan (`mtp_train.train.memory_plan`, `mtp-train plan=true`): its terms, the refusal of a run
over the device's memory, and the plan against the measured peak of real runs (`bench.train_memory`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from mtp_train.cli.train import train_main
from mtp_train.config import ConfigError, HeadConfig
from mtp_train.models.families import args_from_hf_config
from mtp_train.train.memory_plan import (
    CONTEXT_GRAD_COPIES,
    GIB,
    PlanSettings,
    check_plan,
    longest_sample,
    plan_memory,
)
from tests.conftest import compose_config

# Llama-3.1-8B's public config.json shapes (the plan needs no weights)
LLAMA31_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5,
                  rope_theta=500000.0, tie_word_embeddings=False, max_position_embeddings=131072)


def llama_args():
    return args_from_hf_config(LLAMA31_8B, source="Llama-3.1-8B (public config.json values)")


def settings(head_type: str = "eagle3", **changes) -> PlanSettings:
    """Plan settings of an 8-rank bf16 ZeRO-2 run of a `head_type` head at 8k tokens on Llama-3.1-8B's shapes."""
    head = HeadConfig(type=head_type, draft_vocab_size=32000 if head_type == "eagle3" else 0)
    base = PlanSettings(head=head.resolved(32), steps=3 if head_type != "dflash" else 7, chunk_size=1024,
                        ce_impl="checkpoint", w_feat=0.0, length=8192, micro_batch_tokens=8192, sequence_parallel=1,
                        activation_checkpointing=False, world=8, zero_stage=2, reduce_bucket_size=500_000_000,
                        device="cuda", runtime=int(1.5 * GIB))
    return dataclasses.replace(base, **changes)


def term(plan, name: str) -> int:
    return next(t.bytes for t in plan.terms if t.name == name)


def test_zero2_partitions_the_optimizer_state_by_world():
    """AdamW's moments and the fp32 master weights are split over the ranks under ZeRO 1/2, whole under ZeRO-0."""
    one, eight = plan_memory(settings(world=1), llama_args()), plan_memory(settings(world=8), llama_args())
    assert term(one, "optimizer") == pytest.approx(8 * term(eight, "optimizer"), rel=1e-6)
    assert term(one, "optimizer") == 2 * 4 * one.head_params
    zero0 = plan_memory(settings(world=8, zero_stage=0), llama_args())
    assert term(zero0, "optimizer") == term(one, "optimizer")
    # the gradients: a partition plus the reduction bucket under ZeRO-2 (CUDA allocates the bucket whole)
    assert term(eight, "gradients") == 4 * eight.head_params // 8 + 500_000_000 * 2


def test_muon_keeps_one_momentum_per_matrix_and_adamw_moments_on_the_own_lm_head():
    """train.optimizer=muon (ZeRO 0): one fp32 momentum per matrix parameter; the head's own vocabulary-indexed
    lm_head (eagle3's draft rows) stays on AdamW, two moments."""
    mtp = plan_memory(settings("mtp", zero_stage=0, optimizer="muon"), llama_args())
    assert term(mtp, "optimizer") == 4 * mtp.head_params
    eagle3 = plan_memory(settings("eagle3", zero_stage=0, optimizer="muon"), llama_args())
    adamw = plan_memory(settings("eagle3", zero_stage=0), llama_args())
    own = 32000 * 4096  # the draft vocabulary's lm_head rows
    assert term(eagle3, "optimizer") == 4 * (eagle3.head_params + own) < term(adamw, "optimizer")


def test_a_frozen_draft_lm_head_is_weights_only():
    """head.train_lm_head=false (speculators' recipe): the draft lm_head's rows are counted as weights, with no
    gradient, optimiser state or gradient of its own in the loss."""
    trained = plan_memory(settings("eagle3"), llama_args())
    frozen_head = HeadConfig.of(type="eagle3", draft_vocab_size=32000, train_lm_head=False)
    frozen = plan_memory(settings("eagle3", head=frozen_head.resolved(32)), llama_args())
    rows = 32000 * 4096
    assert frozen.head_params == trained.head_params - rows
    assert term(trained, "weights") - term(frozen, "weights") == rows * 4 // 8  # bf16 rows kept, no fp32 master
    assert term(frozen, "optimizer") < term(trained, "optimizer")
    assert term(frozen, "loss chunk") < term(trained, "loss chunk")  # no own lm_head gradient


def test_sequence_parallel_halves_the_activations_and_keeps_the_batch_whole():
    """SP = 2 halves the activation term (each rank runs half the rows); every SP rank still holds the batch."""
    for head in ("mtp", "eagle3"):
        one = plan_memory(settings(head, sequence_parallel=1), llama_args())
        two = plan_memory(settings(head, sequence_parallel=2), llama_args())
        assert term(two, "activations") == pytest.approx(term(one, "activations") / 2, rel=0.01)
        assert term(two, "batch") == term(one, "batch")
        assert two.total < one.total
        # a chain head's rank adds the Ulysses exchange over its share of the rows (none without SP, none for a
        # block drafter, whose context K/V are gathered instead)
        assert not any(t.name == "exchange" for t in one.terms)
        four = plan_memory(settings(head, sequence_parallel=4), llama_args())
        assert term(two, "exchange") == pytest.approx(2 * term(four, "exchange"), rel=0.01)
    block = plan_memory(settings("dflash", sequence_parallel=2), llama_args())
    assert not any(t.name == "exchange" for t in block.terms)


def test_activation_checkpointing_shrinks_the_activations():
    """Only each step's input and K/V stay, plus one step recomputed at a time: a 3-step unroll keeps well under
    half; a block drafter keeps one draft layer's activations instead of all of them."""
    plain = plan_memory(settings("eagle3"), llama_args())
    ckpt = plan_memory(settings("eagle3", activation_checkpointing=True), llama_args())
    assert term(ckpt, "activations") < 0.5 * term(plain, "activations")
    block = HeadConfig.of(type="dflash", layers=4).resolved(32)
    plain = plan_memory(settings("dflash", head=block), llama_args())
    ckpt = plan_memory(settings("dflash", head=block, activation_checkpointing=True), llama_args())
    assert term(ckpt, "activations") < term(plain, "activations")


def test_the_activations_grow_linearly_with_the_tokens_and_the_steps():
    a = plan_memory(settings("eagle3", length=8192, micro_batch_tokens=8192), llama_args())
    b = plan_memory(settings("eagle3", length=32768, micro_batch_tokens=32768), llama_args())
    assert term(b, "activations") == pytest.approx(4 * term(a, "activations"), rel=0.01)
    one, two, three = (plan_memory(settings("mtp", steps=n), llama_args()) for n in (1, 2, 3))
    # every step adds the same kept values; the backward's temporaries are one layer's, once
    per_step = term(two, "activations") - term(one, "activations")
    assert term(three, "activations") - term(two, "activations") == per_step
    assert 0 < term(one, "activations") - per_step < per_step


def test_cpu_plans_fp32_and_the_loss_chunk_follows_chunk_size():
    cuda, cpu = plan_memory(settings(), llama_args()), plan_memory(settings(device="cpu"), llama_args())
    assert term(cpu, "frozen") == 2 * term(cuda, "frozen") == 2 * 2 * 128256 * 4096 * 2
    full, half = plan_memory(settings("mtp"), llama_args()), plan_memory(settings("mtp", chunk_size=512), llama_args())
    assert term(half, "loss chunk") * 2 == term(full, "loss chunk")
    # eagle3 trains its own lm_head rows: their gradient builds up in the loss's backward
    assert term(cuda, "loss chunk") - 2 * 32000 * 4096 * 4 == pytest.approx(term(full, "loss chunk") * 32000 / 128256,
                                                                             rel=1e-6)


def test_the_refusal_names_the_largest_term_and_the_setting():
    plan = plan_memory(settings("eagle3", length=65536, micro_batch_tokens=65536), llama_args())
    assert plan.largest().name == "activations"
    with pytest.raises(ConfigError) as e:
        check_plan(plan, 40 * GIB, "memory_limit_gib=40")
    msg = str(e.value)
    assert "activations" in msg and "train.sequence_parallel" in msg and "train.activation_checkpointing" in msg
    assert "memory_check=false" in msg and "plan=true" in msg
    check_plan(plan, plan.total, "exactly enough")  # at the limit: accepted


def plan_cfg(model_dir: Path, out: Path, *extra: str):
    return compose_config("train", [f"model.path={model_dir}", "head=eagle3", f"out={out}", "wandb.mode=disabled",
                                    "spec_eval.prompts=[]", "data.dir=/nonexistent", *extra])


def test_plan_true_for_llama_8b_from_config_json_alone(tmp_path, capsys):
    """`mtp-train plan=true` prints the plan term by term from a folder holding only config.json (no weights), for
    8 ranks planned from one process, and writes nothing."""
    model = tmp_path / "llama-3.1-8b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA31_8B))
    out = tmp_path / "run"
    result = train_main(plan_cfg(model, out, "plan=true", "plan_world=8", "plan_length=32768", "plan_device=cuda",
                                 "train.sequence_parallel=4"))
    printed = capsys.readouterr().out
    for name in ("runtime", "frozen", "batch", "weights", "gradients", "optimizer", "activations", "loss chunk"):
        assert name in printed and name in result["plan"]
    assert "world 8" in printed and "sequence_parallel=4" in printed and "plan_length" in printed
    assert "peak per rank" in printed and result["plan_total"] == sum(result["plan"].values())
    assert not out.exists()


def test_a_run_over_its_memory_limit_is_refused_before_anything_is_written(tmp_path, tiny_checkpoints):
    model_dir = tiny_checkpoints["llama"][0]
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="memory_limit_gib=0.001.*the largest term is"):
        train_main(plan_cfg(model_dir, out, "memory_limit_gib=0.001", "plan_length=64"))
    assert not out.exists()


def test_the_longest_sample_comes_from_the_folder(tmp_path):
    from mtp_train.precompute.synthetic import make_folder

    make_folder(tmp_path / "pc", 12, min_len=5, max_len=40, shard_tokens=64)
    assert longest_sample(tmp_path / "pc") <= 40 and longest_sample(tmp_path / "pc") >= 30
    assert longest_sample(tmp_path / "missing") is None


# (head, sample lengths): the range's ends where a run takes seconds; eagle3's and dflash's 8k runs take minutes each
# on two cores and are measured by `python -m bench.train_memory` (docs/training.md "Memory plan")
MEASURED = [("mtp", (1024, 8192)), ("eagle3", (1024, 4096)), ("dflash", (1024, 4096))]


@pytest.mark.slow
@pytest.mark.parametrize(("head", "lengths"), MEASURED, ids=[h for h, _ in MEASURED])
def test_the_plan_is_within_15_percent_of_the_measured_peak(head, lengths, tmp_path):
    """Real `mtp-train` processes on the default target, two steps of one sample each (every token under the loss):
    the peak per rank that `mtp-train ... plan=true` prints is within 15% of the process's measured peak RSS
    (bench.train_memory)."""
    from bench.common import DEFAULT_MODEL
    from bench.train_memory import run_one

    if not (DEFAULT_MODEL / "config.json").is_file():
        pytest.skip(f"the default target {DEFAULT_MODEL} is not here (make model)")
    for length in lengths:
        row = run_one(DEFAULT_MODEL.resolve(), head, length, steps=2, sp=1, work=tmp_path)
        assert 0.85 <= row.ratio <= 1.15, (head, length, row.measured / GIB, row.planned / GIB)

def test_a_block_drafters_attention_backward_is_transient_beside_the_loss_chunk():
    """dflash's attention backward (the context K/V's gradient once, one chunk's explicit group) is a transient term
    like the loss's chunk: the peak counts the larger of the two. It grows with the context, not with the anchors;
    SP divides the anchors a rank drafts; its loss runs over every slot's rows at once, in chunks of
    loss.chunk_size rows, so the chunk shrinks only once a rank's anchors × slots are fewer."""
    plan = plan_memory(settings("dflash", length=32768, micro_batch_tokens=32768), llama_args())
    grad, chunk = term(plan, "attention grad"), term(plan, "loss chunk")
    lasting = sum(t.bytes for t in plan.terms if not t.transient)
    assert plan.total == lasting + max(grad, chunk)
    many = HeadConfig.of(type="dflash", max_anchors=2048).resolved(32)
    assert term(plan_memory(settings("dflash", head=many, length=32768, micro_batch_tokens=32768), llama_args()),
                "attention grad") == grad
    longer = plan_memory(settings("dflash", length=65536, micro_batch_tokens=65536), llama_args())
    assert term(longer, "attention grad") - grad == CONTEXT_GRAD_COPIES * 8 * 32768 * (128 + 8) * 2  # 8 KV heads, bf16
    half = plan_memory(settings("dflash", length=32768, micro_batch_tokens=32768, sequence_parallel=2), llama_args())
    assert term(half, "loss chunk") == chunk  # 256 anchors × 7 slots on a rank: still whole chunks of 1024 rows
    few = HeadConfig.of(type="dflash", max_anchors=64).resolved(32)  # 64 × 7 = 448 rows, 224 on each of 2 ranks
    one, two = (term(plan_memory(settings("dflash", head=few, length=32768, micro_batch_tokens=32768,
                                          sequence_parallel=n), llama_args()), "loss chunk") for n in (1, 2))
    assert two == pytest.approx(one / 2, rel=0.01)
