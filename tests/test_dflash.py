"""The dflash block drafter: its block attention against a reference built position by position, its training unroll
(anchors only counted, every loss kind, the loss falls), its drafter (the paged context cache equals the unroll,
greedy speculative decoding equals plain greedy for several B, a sampled run) and its settings."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mtp_train.cli.eval import eval_main
from mtp_train.cli.export import export_main
from mtp_train.cli.precompute import precompute_main
from mtp_train.cli.train import train_main
from mtp_train.config import HEAD_TYPES, HeadConfig, LossConfig
from mtp_train.engine import LLMEngine, SamplingParams, prefill_hidden
from mtp_train.export import LayoutError, export_head, load_export, verify_round_trip
from mtp_train.head_types.dflash import HEAD_TYPE
from mtp_train.head_types.dflash.drafter import BlockProposer, block_tree
from mtp_train.head_types.dflash.head import DFlashHead, default_block_layers
from mtp_train.head_types.dflash.layouts import import_dflash
from mtp_train.heads import FrozenTargetParts, build_head, new_head, save_head
from mtp_train.heads.block_attention import BlockLayout, packed_block_attention
from mtp_train.models import ModelConfigError, load_model
from mtp_train.models.families import args_from_hf_config
from mtp_train.speculative.engine import SpecEngine
from mtp_train.speculative.tree_draft import TreeSpec
from mtp_train.train.divergences import TOKEN_LOSSES
from mtp_train.train.losses import step_token_counts, unrolled_loss
from tests.conftest import compose_config, make_chat_target, metrics_by_step, topic_conversations
from tests.test_families import CASES as FAMILY_CASES
from tests.test_families import TINY as FAMILY_CONFIGS
from tests.test_speculative_engine import _marginal_of_second_token, assert_second_tokens_follow

pytestmark = pytest.mark.usefixtures("one_thread")

if "dflash" not in HEAD_TYPES:  # a checkout whose installed entry points predate the type (pip install -e . adds it)
    HEAD_TYPES.add(HEAD_TYPE)

_cfg = compose_config




PROMPTS = [[3, 17, 42], [5, 9, 11, 200, 7, 1, 8], list(range(20, 33)), [250] * 2 + list(range(40, 58))]


def _head(path, block_size=4, layers=1, seed=0, **kw) -> DFlashHead:
    torch.manual_seed(seed)
    head = build_head(HeadConfig.of(type="dflash", block_size=block_size, layers=layers, **kw), path, dtype="float32")
    assert isinstance(head, DFlashHead)
    return head


def _reference_attention(q, k_blk, v_blk, k_ctx, v_ctx, seq_of_anchor, anchor_pos, seq_of_ctx, pos_of_ctx):
    """Dense attention over every context row and every block row of the batch, the mask built one (query, key)
    pair at a time from the rule: the same sequence's context before the anchor, and the query's own block."""
    a, b, hq, d = q.shape
    hkv = k_blk.shape[2]
    keys = torch.cat([k_ctx, k_blk.reshape(a * b, hkv, d)])
    vals = torch.cat([v_ctx, v_blk.reshape(a * b, hkv, d)])
    n = k_ctx.shape[0]
    mask = torch.zeros(a * b, n + a * b, dtype=torch.bool)
    for qa in range(a):
        for qs in range(b):
            r = qa * b + qs
            for c in range(n):
                mask[r, c] = bool(seq_of_ctx[c] == seq_of_anchor[qa] and pos_of_ctx[c] < anchor_pos[qa])
            for ka in range(a):
                for ks in range(b):
                    mask[r, n + ka * b + ks] = ka == qa
    g = hq // hkv
    out = torch.empty(a * b, hq, d)
    for h in range(hq):
        s = (q.reshape(a * b, hq, d)[:, h] @ keys[:, h // g].T) * d ** -0.5
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
        out[:, h] = p @ vals[:, h // g]
    return out.view(a, b, hq, d)


def test_block_attention_equals_a_mask_built_position_by_position():
    torch.manual_seed(0)
    lens, b, hq, hkv, d = [5, 1, 7], 3, 4, 2, 8
    starts = [0, 5, 6]
    anchors = [(0, 1), (0, 4), (2, 1), (2, 3), (2, 6)]  # (sequence, anchor position); sequence 1 has none
    a = len(anchors)
    q = torch.randn(a, b, hq, d)
    k_blk, v_blk = torch.randn(a, b, hkv, d), torch.randn(a, b, hkv, d)
    k_ctx, v_ctx = torch.randn(sum(lens), hkv, d), torch.randn(sum(lens), hkv, d)
    layout = BlockLayout(((0, 2, 0, 5), (2, 5, 6, 13)), torch.tensor([p for _, p in anchors]))
    got = packed_block_attention(q, k_blk, v_blk, k_ctx, v_ctx, layout)
    seq_of_ctx = [s for s, n in enumerate(lens) for _ in range(n)]
    pos_of_ctx = [i - starts[s] for i, s in enumerate(seq_of_ctx)]
    ref = _reference_attention(q, k_blk, v_blk, k_ctx, v_ctx, [s for s, _ in anchors], [p for _, p in anchors],
                               seq_of_ctx, pos_of_ctx)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # chunked over anchors (a small score budget) gives the same
    import mtp_train.heads.block_attention as ba
    budget, ba.SCORE_BUDGET = ba.SCORE_BUDGET, 1
    try:
        torch.testing.assert_close(packed_block_attention(q, k_blk, v_blk, k_ctx, v_ctx, layout), got)
    finally:
        ba.SCORE_BUDGET = budget


def test_settings_defaults_and_refusals(tiny_checkpoints):
    assert default_block_layers(30) == [2, 9, 15, 21, 28]  # z-lab's layers 1..L-3, +1 for hidden_states
    assert default_block_layers(3) == [1, 2]  # a small target: fewer distinct layers
    head = _head(tiny_checkpoints["llama"][0])
    assert head.aux_layers == [1, 2] and head.mask_token_id == head.args.vocab_size - 1
    assert head.kv_shape[0] == 1
    with pytest.raises(ValueError, match="head.block_size is a dflash / dspark setting"):
        HeadConfig.of(type="mtp", block_size=4)
    with pytest.raises(ValueError, match="block_size >= 2"):
        HeadConfig.of(type="dflash", block_size=1)
    with pytest.raises(ValueError, match="aux layers only"):
        HeadConfig(type="dflash", features="final")
    with pytest.raises(ValueError, match="not a token of the target"):
        _head(tiny_checkpoints["llama"][0], mask_token_id=10_000)
    with pytest.raises(ValueError, match="loss.steps=4"):
        head.unroll(torch.randn(5, head.input_width), torch.arange(5), [5], 4)


def _batch(head, path, seqs):
    model = load_model(path, dtype="float32")
    out = prefill_hidden(model, seqs, hidden_layers=head.aux_layers)
    aux = torch.cat([out.layers[j] for j in head.aux_layers], -1)
    return out.hidden, aux, torch.tensor([t for s in seqs for t in s]), [len(s) for s in seqs]


def test_unroll_counts_only_its_anchors_and_every_loss_kind_trains(tiny_checkpoints):
    path = tiny_checkpoints["qwen3"][0]
    head = _head(path, block_size=4, max_anchors=6)
    hidden, aux, ids, lens = _batch(head, path, [PROMPTS[2], PROMPTS[3]])
    mask = torch.ones_like(ids)
    mask[:4] = 0
    rows = head.loss_rows(ids, mask, lens)
    assert int(rows.sum()) == 6 and torch.equal(rows, head.loss_rows(ids, mask, lens))  # the batch picks them
    eligible = torch.zeros_like(rows)
    eligible[3:12] = eligible[13:32] = True  # a = i+1 in the loss positions, within its sequence
    assert bool((rows <= eligible).all())
    cfg = LossConfig(steps=3, w_feat=0.0, w_tok=1.0)
    loss, m = unrolled_loss(head, hidden, ids, mask, lens, cfg, aux_hidden=aux)
    counts = step_token_counts(mask, lens, 3, rows)
    assert [float(m[f"step{j}/num_tokens"]) for j in range(3)] == counts.tolist()
    # the block of a row is its own: predicting more rows leaves an anchor's block unchanged
    preds = head.unroll(aux, ids, lens, 3, rows=rows)
    full = head.unroll(aux, ids, lens, 3)
    for p, f in zip(preds, full):
        torch.testing.assert_close(p[rows], f[rows])
        assert bool((p[~rows] == 0).all())
    for kind in TOKEN_LOSSES.names():
        for weights in ("decay", "dpace"):
            c = LossConfig(steps=3, w_feat=0.0, w_tok=1.0, kind=kind, position_weights=weights)
            loss, _ = unrolled_loss(head, hidden, ids, mask, lens, c, aux_hidden=aux)
            head.zero_grad()
            loss.backward()
            assert torch.isfinite(loss) and head.fc.weight.grad.abs().sum() > 0, (kind, weights)


def _greedy(model, prompts, n=24, page_size=3):
    out = LLMEngine(model, page_size=page_size, num_pages=256).generate(
        prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))
    return [o.output_ids for o in out]


def _trained(path, block_size, layers=1, steps=80):
    """A dflash head trained briefly on the target's own greedy continuations (so its drafts are often right)."""
    model = load_model(path, dtype="float32")
    head = _head(path, block_size=block_size, layers=layers)
    seqs = [p + o for p, o in zip(PROMPTS, _greedy(model, PROMPTS, n=40))]
    hidden, aux, ids, lens = _batch(head, path, seqs)
    cfg = LossConfig(steps=block_size - 1, w_feat=0.0, w_tok=1.0, kind="argmax_ce")  # near-uniform targets
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss, _ = unrolled_loss(head, hidden, ids, torch.ones_like(ids), lens, cfg, aux_hidden=aux)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return model, head.eval(), losses


@pytest.mark.parametrize(("name", "block_size", "layers"), [("llama", 2, 1), ("llama", 4, 2), ("qwen3", 8, 1)])
def test_greedy_block_drafts_equal_plain_greedy(tiny_checkpoints, name, block_size, layers):
    path = tiny_checkpoints[name][0]
    model, head, losses = _trained(path, block_size, layers)
    assert losses[-1] < 0.7 * losses[0]  # the loss falls
    ref = _greedy(model, PROMPTS)
    for k in (1, block_size - 1, block_size + 2):
        proposer = BlockProposer(head)
        eng = SpecEngine(model, proposer, k, page_size=3, num_pages=256)
        out = eng.generate(PROMPTS, SamplingParams(max_new_tokens=24, ignore_eos=True))
        assert [o.output_ids for o in out] == ref
        m = eng.stats.metrics
        assert m.num_draft_tokens <= min(k, block_size - 1) * m.num_drafts
        assert proposer.forwards == eng.stats.verify_steps  # one block forward per step
        assert m.mean_acceptance_length > 1.0  # drafts were accepted: the cache grew by several rows at once
        assert eng.runner.kv.allocator.num_free == eng.runner.kv.num_pages


def test_the_context_cache_equals_the_unroll_after_decoding(tiny_checkpoints):
    """After a speculative run, the block the drafter would draft next equals the unroll's block at that anchor
    computed from the whole sequence's target features: the cache holds exactly the accepted positions' K/V."""
    path = tiny_checkpoints["qwen3"][0]
    model, head, _ = _trained(path, 4, layers=2, steps=40)
    proposer = BlockProposer(head)
    eng = SpecEngine(model, proposer, 3, page_size=3, num_pages=256)
    params = SamplingParams(max_new_tokens=15, ignore_eos=True)
    seqs = [eng.add_request(p, params) for p in PROMPTS[:2]]
    for _ in range(4):
        eng.step()
    running = [s for s in seqs if s in eng.running]
    assert running
    got = proposer.block_features(running)
    for s, g in zip(running, got):
        ids = list(s.token_ids)
        _, aux, t, lens = _batch(head, path, [ids])
        want = head.unroll(aux, t, lens, 3)
        i = len(ids) - 2  # anchor L-1 is row L-2
        for j in range(3):
            torch.testing.assert_close(g[j + 1], want[j][i], rtol=1e-4, atol=1e-4)


def test_sampled_block_drafts_follow_the_target_distribution(tiny_checkpoints):
    """Chi-square, as for the chain heads (`test_speculative_engine`): the second generated token of many seeded
    requests, the first one through speculative acceptance of the block's sampled drafts, follows the target."""
    model = load_model(tiny_checkpoints["llama"][0])
    prompt, temp, n = [3, 17, 42, 7], 0.7, 3000
    expected_p = _marginal_of_second_token(model, prompt, temp)
    eng = SpecEngine(model, BlockProposer(_head(tiny_checkpoints["llama"][0], block_size=4)), 3, page_size=4,
                     num_pages=4096, max_batch_size=256)
    outs = eng.generate([prompt] * n, SamplingParams(temperature=temp, max_new_tokens=2, ignore_eos=True, seed=1234))
    assert eng.stats.metrics.num_draft_tokens > 0 and eng.stats.metrics.num_accepted > 0
    assert_second_tokens_follow(outs, expected_p)


def test_draft_threshold_shortens_the_block(tiny_checkpoints):
    path = tiny_checkpoints["llama"][0]
    model, head, _ = _trained(path, 4, steps=40)
    seqs = [p + o for p, o in zip(PROMPTS, _greedy(model, PROMPTS, n=16))]
    _, aux, ids, lens = _batch(head, path, seqs)
    with torch.no_grad():  # a threshold at the median confidence of the blocks' slots
        conf = torch.cat([torch.softmax(head.compute_logits(p), -1).amax(-1) for p in head.unroll(aux, ids, lens, 3)])
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    sure = SpecEngine(model, BlockProposer(head, draft_threshold=float(conf.median())), 3, page_size=3,
                      num_pages=256)
    assert [o.output_ids for o in sure.generate(PROMPTS, params)] == [s[len(p):] for p, s in zip(PROMPTS, seqs)]
    m = sure.stats.metrics
    assert 0 < m.num_draft_tokens < 3 * m.num_drafts


def test_trained_by_mtp_train_and_evaluated_by_mtp_eval(tmp_path):
    """`mtp-precompute` (its aux layers) → `mtp-train head=dflash` (the loss falls; validated through its inference
    path and its drafter) → `mtp-eval` drafts blocks whose greedy answers equal plain decoding."""
    target = make_chat_target(tmp_path / "target")
    convs, prompts = topic_conversations(tmp_path)
    precompute_main(_cfg("precompute", [f"model.path={target}", "model.device=cpu", f"data.paths=[{convs}]",
                                        f"out={tmp_path / 'pc'}", "max_seq_len=64", "progress=false",
                                        "val_fraction=0.25", "aux_layers=[1,2]"]))
    train_main(_cfg("train", [
        f"model.path={target}", "model.device=cpu", "model.backend=torch", f"data.dir={tmp_path / 'pc'}",
        f"out={tmp_path / 'run'}", "wandb.mode=disabled", "train.progress=false", "train.max_steps=20",
        "train.micro_batch_tokens=256", "train.eval_every=10", "train.eval_batches=2", "train.save_every=0",
        "optim.lr=3e-2", "optim.warmup_steps=1", "head=dflash", "head.block_size=4", "loss.steps=3",
        "loss.kind=argmax_ce", "train.log_every=1", f"spec_eval.prompts=[{prompts}]", "spec_eval.k=3",
        "spec_eval.max_new_tokens=8"]))
    history = metrics_by_step(tmp_path / "run")
    losses = [m["train/loss"] for _, m in sorted(history.items()) if "train/loss" in m]
    assert len(losses) == 20 and sum(losses[-3:]) < 0.98 * sum(losses[:3]), losses  # (a random target: its greedy
    # token is learnable, its near-uniform distribution is not, hence the hard CE here)
    evals = [m for m in history.values() if "eval/step2/top1" in m]
    assert evals and all(1.0 <= m["spec/tau"] <= 4.0 for m in evals), history
    head = tmp_path / "run" / "heads" / "step-20"
    assert json.loads((head / "config.json").read_text())["head"]["block_size"] == 4

    base = [f"model.path={target}", "model.device=cpu", f"head_ckpt={head}", f"prompts=[{prompts}]",
            "max_new_tokens=16", "progress=false", "warmup=false", "plots=false", "ngram.compare=false"]
    report = eval_main(_cfg("eval", [*base, "k=3", f"out={tmp_path / 'eval'}"]))
    rows = [r for r in report["rows"] if r["method"] == "head"]
    assert rows and all(r["exact_match"] == 1.0 and 1.0 <= r["tau"] <= 4.0 for r in rows)
    tree = eval_main(_cfg("eval", [*base, "k=3", "tree=3x2x6", f"out={tmp_path / 'eval-tree'}"]))
    rows = [r for r in tree["rows"] if r["method"] == "head"]
    assert rows and all(r["exact_match"] == 1.0 and r["tree"] == "3x2x6" and r["mean_draft_len"] == 5 for r in rows)
    with pytest.raises(ValueError, match="dflash heads draft with their own drafter, which takes no draft_width=2"):
        eval_main(_cfg("eval", [*base, "k=3", "draft_width=2", f"out={tmp_path / 'eval-width'}"]))


@pytest.mark.parametrize("fmt", ["native", "dflash"])
def test_export_round_trip_gives_identical_blocks(tiny_checkpoints, tmp_path, fmt):
    """The z-lab layout keeps our names; read back, the head drafts the same blocks (verify_round_trip: 0), and a
    changed weight shows in the check."""
    target = tiny_checkpoints["qwen3"][0]
    head = _head(target, block_size=4, layers=2, mask_token_id=7)
    with torch.no_grad():
        for n, p in head.named_parameters():
            p.add_(torch.randn_like(p) * (0.2 if n.endswith("norm.weight") else 0.02))
    head_dir = save_head(head, tmp_path / "head")
    out = export_head(head_dir, target, fmt, tmp_path / fmt)
    assert verify_round_trip(head_dir, out, target) == 0.0
    back = load_export(out, target)
    assert back.cfg.aux_layers == head.cfg.aux_layers and back.mask_token_id == 7 and back.block_size == 4
    with torch.no_grad():
        head.layers[1].self_attn.k_norm.weight.mul_(1.5)  # a context-K/V-only weight
    assert verify_round_trip(save_head(head, tmp_path / "other"), out, target) > 1e-4


def test_the_zlab_layout_names_and_config(tiny_checkpoints, tmp_path):
    target = tiny_checkpoints["llama"][0]
    head = _head(target, block_size=6, layers=2)
    out = export_head(save_head(head, tmp_path / "head"), target, "dflash", tmp_path / "df")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["num_hidden_layers"] == 2 and cfg["num_target_layers"] == 3
    assert cfg["dflash_config"] == {"block_size": 6, "mask_token_id": 255, "target_layer_ids": [0, 1]}
    assert [j - 1 for j in head.aux_layers] == cfg["dflash_config"]["target_layer_ids"]  # hidden_states[j] = id+1
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_norm.weight",
            "layers.0.self_attn.k_proj.weight", "layers.1.mlp.gate_proj.weight",
            "layers.0.post_attention_layernorm.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)  # the target's are shared
    with pytest.raises(LayoutError, match="hidden_states\\[1..2\\]"):
        export_head(save_head(_head(target, aux_layers=[0, 2]), tmp_path / "h0"), target, "dflash", tmp_path / "x")


def test_a_zlab_folder_is_imported_into_a_native_head(tiny_checkpoints, tmp_path):
    """A DFlash drafter in z-lab's layout (no block of ours in its config.json, an embedding of its own that the
    head does not read) becomes our head with the same blocks; one for other shapes is refused by name."""
    target = tiny_checkpoints["qwen3"][0]
    head = _head(target, block_size=5, layers=2, mask_token_id=9)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    head_dir = save_head(head, tmp_path / "head")
    out = export_head(head_dir, target, "dflash", tmp_path / "zlab")
    cfg = json.loads((out / "config.json").read_text())
    del cfg["mtp_train"]
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(out / "model.safetensors"))
    tensors["embed_tokens.weight"] = torch.zeros(head.args.vocab_size, head.args.hidden_size)
    save_file(tensors, str(out / "model.safetensors"))
    got = import_dflash(out, target, dtype=torch.float32)
    assert (got.cfg.settings.layers, got.block_size, got.mask_token_id, got.aux_layers) == (2, 5, 9, head.aux_layers)
    x = torch.randn(6, head.input_width)
    ids = torch.randint(0, head.args.vocab_size, (6,))
    with torch.no_grad():
        torch.testing.assert_close(got.probe_features(x, ids), head.eval().probe_features(x, ids))
    assert verify_round_trip(head_dir, save_head(got, tmp_path / "native"), target) == 0.0
    cfg["hidden_size"] = 2 * cfg["hidden_size"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="other shapes than the target"):
        import_dflash(out, target)


def test_mtp_export_in_reverse_imports_a_zlab_folder_as_a_native_head(tmp_path):
    """`mtp-export import_from=dflash head_ckpt=<z-lab folder>`: the drafter becomes a native head (loaded back
    exactly, then evaluated like any head); a layout other than native for the result is refused by key."""
    target = make_chat_target(tmp_path / "target")
    head = _head(target, block_size=4, mask_token_id=1, aux_layers=[1])
    head_dir = save_head(head, tmp_path / "head")
    zlab = export_head(head_dir, target, "dflash", tmp_path / "zlab")
    cfg = json.loads((zlab / "config.json").read_text())
    del cfg["mtp_train"]  # a folder written elsewhere: z-lab's fields only
    (zlab / "config.json").write_text(json.dumps(cfg))
    base = [f"model.path={target}", "model.device=cpu", f"head_ckpt={zlab}", "import_from=dflash"]
    res = export_main(_cfg("export", [*base, f"out={tmp_path / 'imported'}"]))
    assert res["max_abs_diff"] == 0.0
    assert verify_round_trip(head_dir, tmp_path / "imported", target) == 0.0  # the same blocks as the original
    saved = json.loads((tmp_path / "imported" / "config.json").read_text())
    assert saved["head"]["type"] == "dflash" and saved["extra"]["imported_from"] == str(zlab)
    with pytest.raises(ValueError, match="import_from=dflash writes a native head: drop format=dflash"):
        export_main(_cfg("export", [*base, "format=dflash", f"out={tmp_path / 'again'}"]))
    (zlab / "model.safetensors").unlink()
    with pytest.raises(ModelConfigError, match=r"zlab: no model.safetensors: a DFlash drafter's folder holds"):
        export_main(_cfg("export", [*base, f"out={tmp_path / 'no-weights'}"]))
    (zlab / "config.json").unlink()
    with pytest.raises(ModelConfigError, match=r"zlab/config.json does not exist: head_ckpt is a DFlash drafter"):
        export_main(_cfg("export", [*base, f"out={tmp_path / 'no-config'}"]))
    assert not (tmp_path / "no-weights").exists() and not (tmp_path / "no-config").exists()


def test_a_tree_from_the_slots_top_k():
    """Slot d's top tokens are every depth-d node's children; nodes ranked by their path's summed log q."""
    lp = torch.log_softmax(torch.tensor([[3.0, 2.0, 0.0, -1.0], [0.0, 2.5, 2.0, -1.0]]), -1)
    t = block_tree(lp, TreeSpec(2, 2, 5))  # 4 nodes of the 2 + 4 drafted
    assert t.tokens[:2] == [0, 1] and t.parents[:2] == [-1, 0]  # the best path first: slot 1's top, slot 2's top
    assert sorted(zip(t.parents, t.tokens)) == sorted([(-1, 0), (0, 1), (0, 2), (-1, 1)])
    path = [lp[0, 0] + lp[1, 1], lp[0, 0] + lp[1, 2], lp[0, 1]]
    assert sorted(t.scores, reverse=True)[1:] == pytest.approx(sorted(map(float, path), reverse=True))
    s = block_tree(lp, TreeSpec(choices=((0,), (1,), (0, 0))))
    assert (s.tokens, s.parents) == ([0, 1, 1], [-1, -1, 0])


@pytest.mark.parametrize("tree", [TreeSpec(3, 2, 6), TreeSpec(choices=((0,), (1,), (0, 0), (0, 1), (0, 0, 0)))])
def test_greedy_block_trees_equal_plain_greedy(tiny_checkpoints, tree):
    path = tiny_checkpoints["llama"][0]
    model, head, _ = _trained(path, 4, steps=40)
    ref = _greedy(model, PROMPTS)
    chain = SpecEngine(model, BlockProposer(head), 3, page_size=3, num_pages=256)
    chain.generate(PROMPTS, SamplingParams(max_new_tokens=24, ignore_eos=True))
    eng = SpecEngine(model, BlockProposer(head, tree=tree), 3, page_size=3, num_pages=256)
    out = eng.generate(PROMPTS, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert [o.output_ids for o in out] == ref
    m = eng.stats.metrics
    assert m.num_draft_tokens > 3 * m.num_drafts  # more nodes than a chain's
    assert m.mean_acceptance_length >= chain.stats.metrics.mean_acceptance_length  # its best path is the chain
    with pytest.raises(ValueError, match="at most block_size - 1 = 3 deep"):
        BlockProposer(head, tree=TreeSpec(4, 2, 6))


@pytest.mark.parametrize(("family", "name"), FAMILY_CASES, ids=[f"{f}-{n}" for f, n in FAMILY_CASES])
def test_every_family_builds_a_dflash_head_or_refuses_it_by_name(family, name):
    """Llama-family targets (sliding windows, q/k/v biases, q/k norms, MoE, attention sinks) take the head and its
    block runs; DeepSeek (MLA) targets refuse it, naming the head types they take."""
    args = args_from_hf_config(FAMILY_CONFIGS[family][name])
    cfg = HeadConfig.of(type="dflash", block_size=3, aux_layers=[1, 2])
    if family.startswith("deepseek"):
        with pytest.raises(ModelConfigError, match="takes an mtp head"):
            new_head(cfg, args)
        return
    torch.manual_seed(0)
    frozen = FrozenTargetParts(torch.randn(args.vocab_size, args.hidden_size),
                               torch.randn(args.vocab_size, args.hidden_size), args)
    head = new_head(cfg, args, frozen)
    x, ids = torch.randn(9, head.input_width), torch.randint(0, args.vocab_size, (9,))
    outs = head.unroll(x, ids, [4, 5], 2)
    assert len(outs) == 2 and all(o.shape == (9, args.hidden_size) and torch.isfinite(o).all() for o in outs)


# -- anchors drawn afresh every training step --


def _anchor_batch(rows: int = 61, lens: tuple[int, ...] = (40, 21)):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 255, (rows,), generator=g)
    mask = (torch.rand(rows, generator=g) < 0.8).to(torch.uint8)
    return ids, mask, list(lens)


def test_anchors_are_fresh_every_step_and_the_same_within_one(tiny_checkpoints):
    """The trainer's seed (train.seed, step, micro-batch, dp rank) draws the anchors: the same batch at two steps
    trains other anchors (the old draw, from the tokens alone, repeated them every epoch); one step's counts and
    loss draw the same ones, and the count is max_anchors either way."""
    from mtp_train.train.losses import step_anchor_seed

    head = _head(tiny_checkpoints["llama"][0], block_size=4, max_anchors=8)
    ids, mask, lens = _anchor_batch()
    step3, step4 = (head.loss_rows(ids, mask, lens, step_anchor_seed(0, s, 0, 0)) for s in (3, 4))
    assert int(step3.sum()) == int(step4.sum()) == 8
    assert not torch.equal(step3, step4)
    assert torch.equal(step3, head.loss_rows(ids, mask, lens, step_anchor_seed(0, 3, 0, 0)))
    assert not torch.equal(step3, head.loss_rows(ids, mask, lens, step_anchor_seed(0, 3, 1, 0)))  # micro-batch
    assert not torch.equal(step3, head.loss_rows(ids, mask, lens, step_anchor_seed(0, 3, 0, 1)))  # dp rank
    assert torch.equal(head.loss_rows(ids, mask, lens), head.loss_rows(ids, mask, lens))  # evaluation: fixed
    # the loss counts exactly the rows the trainer counted for that step
    x = torch.randn(ids.shape[0], head.input_width)
    cfg = LossConfig(steps=3, w_feat=0.0, w_tok=1.0)
    hidden = torch.randn(ids.shape[0], head.args.hidden_size)
    for seed in (step_anchor_seed(0, 3, 0, 0), step_anchor_seed(0, 4, 0, 0)):
        counts = step_token_counts(mask, lens, 3, head.loss_rows(ids, mask, lens, seed))
        _, m = unrolled_loss(head, hidden, ids, mask, lens, cfg, aux_hidden=x, anchor_seed=seed)
        assert [float(m[f"step{j}/num_tokens"]) for j in range(3)] == counts.tolist()


def _sp_anchor_worker(rank: int, world: int, path: str, root: str, seed: int) -> None:
    """One of 2 sequence-parallel ranks: its share of the seeded dflash loss and gradients, saved to root."""
    import torch.distributed as tdist

    from mtp_train.train.sequence_parallel import SequenceParallel

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=world)
    try:
        sp = SequenceParallel.setup(world, rank, world, torch.device("cpu"))
        head, batch = _sp_anchor_case(path)
        shard = sp.shard(batch[0].shape[0])
        counts = step_token_counts(batch[1], batch[2], 3, head.loss_rows(*batch, seed), shard)
        tdist.all_reduce(counts, group=sp.groups.group)
        torch.save(_sp_anchor_loss(head, batch, counts, seed, shard), f"{root}/rank{rank}.pt")
    finally:
        tdist.destroy_process_group()


def _sp_anchor_case(path: str):
    head = _head(path, block_size=4, layers=2, max_anchors=12, aux_layers=[1, 2, 3])
    head.train()
    return head, _anchor_batch(rows=97, lens=(60, 37))


def _sp_anchor_loss(head, batch, counts, seed, shard=None):
    ids, mask, lens = batch
    g = torch.Generator().manual_seed(1)
    hidden, aux = torch.randn(ids.shape[0], head.args.hidden_size, generator=g), \
        torch.randn(ids.shape[0], head.input_width, generator=g)
    head.zero_grad(set_to_none=True)
    loss, _ = unrolled_loss(head, hidden, ids, mask, lens, LossConfig(steps=3), num_tokens=counts, aux_hidden=aux,
                            shard=shard, anchor_seed=seed)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}


def test_sequence_parallel_ranks_draw_one_steps_anchors(tiny_checkpoints, tmp_path):
    """train.sequence_parallel = 2 with a step's seed: both ranks draw the whole batch's anchors alike, so their
    losses and gradients add up to the 1-rank ones."""
    import torch.multiprocessing as mp

    from mtp_train.train.losses import step_anchor_seed

    path, seed = str(tiny_checkpoints["llama"][0]), step_anchor_seed(0, 7, 0, 0)
    mp.start_processes(_sp_anchor_worker, args=(2, path, str(tmp_path), seed), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    head, batch = _sp_anchor_case(path)
    counts = step_token_counts(batch[1], batch[2], 3, head.loss_rows(*batch, seed))
    ref_loss, ref_grads = _sp_anchor_loss(head, batch, counts, seed)
    assert all(bool(r[0] != 0) for r in ranks)
    torch.testing.assert_close(ranks[0][0] + ranks[1][0], ref_loss, rtol=1e-5, atol=1e-6)
    for n, ref in ref_grads.items():
        torch.testing.assert_close(ranks[0][1][n] + ranks[1][1][n], ref, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("head_type", ["dflash", "dspark"])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_the_shared_first_layer_gives_the_explicit_loss_and_gradients(tiny_checkpoints, head_type, checkpoint):
    """Training runs the first layer's token-only part (its norm, q/k/v projections and q/k norms) once per distinct
    block token (`DFlashHead.share_first_layer`): the loss and every gradient equal the explicit path's, which runs
    it on all A·B rows, in float32 (two draft layers, under activation checkpointing too; a mask id that is also
    a token of the batch, so some anchors' rows equal the mask rows)."""
    torch.manual_seed(0)
    settings = {"markov_rank": 8} if head_type == "dspark" else {}
    head = build_head(HeadConfig.of(type=head_type, block_size=5, layers=2, max_anchors=24, mask_token_id=7,
                                    **settings), tiny_checkpoints["qwen3"][0], dtype="float32")
    head.train()
    ids, mask, lens = _anchor_batch()
    ids[::5] = 7  # the mask token among the anchors' tokens
    x = torch.randn(ids.shape[0], head.input_width)
    hidden = torch.randn(ids.shape[0], head.args.hidden_size)
    cfg = LossConfig(steps=head.drafts, w_feat=0.0, w_tok=1.0, position_weights="dpace")
    results = []
    for share in (True, False):
        head.share_first_layer = share
        head.zero_grad(set_to_none=True)
        loss, _ = unrolled_loss(head, hidden, ids, mask, lens, cfg, aux_hidden=x, anchor_seed=11,
                                checkpoint=checkpoint)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-6)
    assert grads_a.keys() == grads_b.keys() and any("layers.0.self_attn.q_proj" in n for n in grads_a)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("head_type,block_size", [("dflash", 4), ("dflash", 16), ("dspark", 4)])
@pytest.mark.parametrize("ce_impl", ["checkpoint", "fused"])
@pytest.mark.parametrize("kind,weights", [("soft_ce", "dpace"), ("soft_ce", "decay"), ("jsd", "dpace"),
                                          ("argmax_ce", "decay"), ("lk_hybrid", "dpace")])
def test_the_position_grouped_token_loss_gives_the_per_step_loss_and_gradients(tiny_checkpoints, head_type,
                                                                              block_size, ce_impl, kind, weights):
    """A block drafter's token loss runs over all its steps at once, rows grouped by target position
    (`train.losses.grouped_token_losses`: the target's lm_head once per distinct position, the head's once per row
    in the forward): the loss, every metric and every gradient equal the step-by-step path's in float32, for every
    ce_impl, several loss kinds, D-PACE or per-step weights, a draft vocabulary (dflash) or dspark's trainable
    Markov columns beside the whole vocabulary, chunks smaller than a position's rows."""
    torch.manual_seed(0)
    settings = {"markov_rank": 8} if head_type == "dspark" else {"draft_vocab_size": 64}
    head = build_head(HeadConfig.of(type=head_type, block_size=block_size, max_anchors=24, **settings),
                      tiny_checkpoints["qwen3"][0], dtype="float32")
    if head.draft_vocab is not None:
        head.set_draft_vocab(torch.randperm(head.args.vocab_size)[:64].sort().values)
    head.train()
    ids, mask, lens = _anchor_batch()
    x = torch.randn(ids.shape[0], head.input_width)
    hidden = torch.randn(ids.shape[0], head.args.hidden_size)
    cfg = LossConfig(steps=head.drafts, w_feat=0.5, w_tok=1.0, position_weights=weights, kind=kind, chunk_size=7,
                     ce_impl=ce_impl)
    rows = head.loss_rows(ids, mask, lens, 11)
    num = step_token_counts(mask, lens, cfg.steps, rows) * 1.5  # a global count, not the local one
    results = []
    for grouped in (True, False):
        head.zero_grad(set_to_none=True)
        loss, m = unrolled_loss(head, hidden, ids, mask, lens, cfg, num_tokens=num, aux_hidden=x, anchor_seed=11,
                                group_targets=grouped)
        loss.backward()
        results.append((loss.detach(), m, {n: p.grad.clone() for n, p in head.named_parameters()
                                           if p.grad is not None}))
    (loss_a, m_a, grads_a), (loss_b, m_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-6)
    assert m_a.keys() == m_b.keys()
    for k in m_a:
        torch.testing.assert_close(m_a[k].float(), m_b[k].float(), rtol=1e-5, atol=1e-6, msg=lambda s, k=k: f"{k}: {s}")
    assert grads_a.keys() == grads_b.keys() and any("layers.0.self_attn.q_proj" in n for n in grads_a)
    if head_type == "dspark":
        assert "markov_head.markov_w2.weight" in grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda s, n=name: f"{n}: {s}")
