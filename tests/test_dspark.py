"""The dspark block drafter: vLLM's `sample_from_anchor` alignment and the Markov bias in its unroll, every loss kind
training it (and the confidence head), its drafter (greedy speculative decoding equals plain greedy for several B,
the paged context cache equals the unroll, the confidence head's dynamic length, a sampled run's χ² test), its
export in vLLM's DSpark layout and the import back."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from mtp_train.cli.eval import eval_main
from mtp_train.cli.export import export_main
from mtp_train.config import HEAD_TYPES, HeadConfig, LossConfig
from mtp_train.engine import SamplingParams
from mtp_train.export import LayoutError, export_head, load_export, verify_round_trip
from mtp_train.export.importer import import_drafter
from mtp_train.head_types.dspark import HEAD_TYPE
from mtp_train.head_types.dspark.drafter import MarkovBlockProposer
from mtp_train.head_types.dspark.head import DSparkHead
from mtp_train.heads import FrozenTargetParts, build_head, new_head, save_head
from mtp_train.models import ModelConfigError, load_model
from mtp_train.models.families import args_from_hf_config
from mtp_train.speculative.engine import SpecEngine
from mtp_train.train.divergences import TOKEN_LOSSES
from mtp_train.train.losses import unrolled_loss
from tests.conftest import compose_config, make_chat_target, metrics_by_step, precompute_and_train
from tests.test_dflash import PROMPTS, _batch, _greedy
from tests.test_families import CASES as FAMILY_CASES
from tests.test_families import TINY as FAMILY_CONFIGS
from tests.test_speculative_engine import _marginal_of_second_token, assert_second_tokens_follow

pytestmark = pytest.mark.usefixtures("one_thread")

if "dspark" not in HEAD_TYPES:  # a checkout whose installed entry points predate the type (pip install -e . adds it)
    HEAD_TYPES.add(HEAD_TYPE)


def _head(path, block_size=4, layers=1, seed=0, markov_rank=8, **kw) -> DSparkHead:
    torch.manual_seed(seed)
    head = build_head(HeadConfig.of(type="dspark", block_size=block_size, layers=layers, markov_rank=markov_rank, **kw),
                      path, dtype="float32")
    assert isinstance(head, DSparkHead)
    return head


def _perturb(head, scale=0.02):
    with torch.no_grad():
        for n, p in head.named_parameters():
            p.add_(torch.randn_like(p) * (0.2 if n.endswith("norm.weight") else scale))


def test_settings_and_the_sample_from_anchor_alignment(tiny_checkpoints):
    """Every slot drafts (slot j of anchor a = i+1 is step j of row i, the token after position a+j), its Markov
    input is the batch's token at the slot's position, and the logits are lm_head(slot) + W2·W1[that token]."""
    path = tiny_checkpoints["qwen3"][0]
    with pytest.raises(ValueError, match="markov_rank >= 1"):
        HeadConfig.of(type="dspark", markov_rank=0)
    assert HeadConfig(type="dspark").resolved().settings.markov_rank == 64
    with pytest.raises(ValueError, match="head.markov_rank is a dspark setting"):
        HeadConfig.of(type="dflash", markov_rank=4)
    with pytest.raises(ValueError, match="confidence_with_markov=true needs head.confidence_head=true"):
        HeadConfig.of(type="dspark", markov_rank=4, confidence_with_markov=True)
    head = _head(path, block_size=4)
    _perturb(head)
    assert head.drafts == 4 and head.markov_head.markov_w1.weight.shape == (head.args.vocab_size, 8)
    with pytest.raises(ValueError, match="loss.steps=5"):
        head.unroll(torch.randn(5, head.input_width), torch.arange(5), [5], 5)
    _, aux, ids, lens = _batch(head, path, [PROMPTS[2]])
    with torch.no_grad():
        preds = head.unroll(aux, ids, lens, 4)
        row_idx, out = head.anchor_blocks(aux, ids, lens)
        h = head.args.hidden_size
        for j, p in enumerate(preds):
            torch.testing.assert_close(p[row_idx, :h], out[:, j])  # slot j, not DFlash's j + 1
            at = (row_idx + 1 + j).clamp_max(len(ids) - 1)
            torch.testing.assert_close(p[row_idx, h:], head.markov_embed(ids[at]))
            torch.testing.assert_close(head.compute_logits(p), head.base_logits(p[:, :h]) + head.markov_bias(p[:, h:]),
                                       rtol=1e-4, atol=1e-4)


def test_every_loss_kind_trains_the_markov_and_confidence_heads(tiny_checkpoints):
    path = tiny_checkpoints["llama"][0]
    head = _head(path, block_size=3, max_anchors=8, confidence_head=True, confidence_with_markov=True)
    _perturb(head)
    hidden, aux, ids, lens = _batch(head, path, [PROMPTS[2], PROMPTS[3]])
    mask = torch.ones_like(ids)
    for kind in TOKEN_LOSSES.names():
        for weights, impl in (("decay", "checkpoint"), ("dpace", "fused")):
            c = LossConfig(steps=3, w_feat=0.0, w_tok=1.0, kind=kind, position_weights=weights, ce_impl=impl)
            loss, m = unrolled_loss(head, hidden, ids, mask, lens, c, aux_hidden=aux)
            head.zero_grad()
            loss.backward()
            assert torch.isfinite(loss), (kind, weights)
            for p in (head.fc.weight, head.markov_head.markov_w1.weight, head.markov_head.markov_w2.weight,
                      head.confidence_head.proj.weight):
                assert p.grad is not None and p.grad.abs().sum() > 0, (kind, weights)
            assert 0.0 <= float(m["step2/conf_accept"]) <= 1.0 and float(m["step0/conf_loss"]) > 0
    # the confidence head reads the drafter, never moves it: the drafter's gradients are those without it
    plain = _head(path, block_size=3, max_anchors=8)
    plain.load_state_dict({k: v for k, v in head.state_dict().items() if not k.startswith("confidence_head.")})
    c = LossConfig(steps=3, w_feat=0.5, w_tok=1.0)  # the feature loss reads the slot's H columns
    for h in (head, plain):
        h.zero_grad()
        unrolled_loss(h, hidden, ids, mask, lens, c, aux_hidden=aux)[0].backward()
    torch.testing.assert_close(head.fc.weight.grad, plain.fc.weight.grad)
    torch.testing.assert_close(head.markov_head.markov_w1.weight.grad, plain.markov_head.markov_w1.weight.grad)


def _trained(path, block_size, layers=1, steps=80, **kw):
    """A dspark head trained briefly on the target's own greedy continuations (so its drafts are often right)."""
    model = load_model(path, dtype="float32")
    head = _head(path, block_size=block_size, layers=layers, **kw)
    seqs = [p + o for p, o in zip(PROMPTS, _greedy(model, PROMPTS, n=40))]
    hidden, aux, ids, lens = _batch(head, path, seqs)
    cfg = LossConfig(steps=block_size, w_feat=0.0, w_tok=1.0, kind="argmax_ce")  # near-uniform targets
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss, _ = unrolled_loss(head, hidden, ids, torch.ones_like(ids), lens, cfg, aux_hidden=aux)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return model, head.eval(), losses


@pytest.mark.parametrize(("name", "block_size", "layers"), [("llama", 2, 1), ("llama", 4, 2), ("qwen3", 6, 1)])
def test_greedy_markov_drafts_equal_plain_greedy(tiny_checkpoints, name, block_size, layers):
    path = tiny_checkpoints[name][0]
    model, head, losses = _trained(path, block_size, layers)
    assert losses[-1] < 0.7 * losses[0]  # the loss falls
    assert head.markov_head.markov_w2.weight.abs().sum() > 0  # the bias was trained
    ref = _greedy(model, PROMPTS)
    for k in (1, block_size, block_size + 2):
        proposer = MarkovBlockProposer(head)
        eng = SpecEngine(model, proposer, k, page_size=3, num_pages=256)
        out = eng.generate(PROMPTS, SamplingParams(max_new_tokens=24, ignore_eos=True))
        assert [o.output_ids for o in out] == ref
        m = eng.stats.metrics
        assert m.num_draft_tokens == min(k, block_size) * m.num_drafts  # every slot drafts
        assert proposer.forwards == eng.stats.verify_steps  # one block forward per step
        assert m.mean_acceptance_length > 1.0
        assert eng.runner.kv.allocator.num_free == eng.runner.kv.num_pages


def test_the_drafts_are_the_unroll_chained_through_the_markov_head(tiny_checkpoints):
    """After a speculative run, the next block's slots equal the unroll's at that anchor (the cache holds exactly
    the accepted positions), and each greedy draft is the argmax of lm_head(slot) + W2·W1[the draft before]."""
    path = tiny_checkpoints["qwen3"][0]
    model, head, _ = _trained(path, 4, layers=2, steps=40)
    with torch.no_grad():
        head.markov_head.markov_w2.weight.add_(torch.randn_like(head.markov_head.markov_w2.weight))  # a large bias
    proposer = MarkovBlockProposer(head)
    eng = SpecEngine(model, proposer, 4, page_size=3, num_pages=256)
    params = SamplingParams(max_new_tokens=15, ignore_eos=True)
    seqs = [eng.add_request(p, params) for p in PROMPTS[:2]]
    for _ in range(3):
        eng.step()
    running = [s for s in seqs if s in eng.running]
    assert running
    got = proposer.block_features(running)
    drafted = proposer.propose(running, 4)
    h = head.args.hidden_size
    for s, g, tree in zip(running, got, drafted):
        ids = list(s.token_ids)
        _, aux, t, lens = _batch(head, path, [ids])
        want = head.unroll(aux, t, lens, 4)
        for j in range(4):
            torch.testing.assert_close(g[j], want[j][len(ids) - 2, :h], rtol=1e-4, atol=1e-4)  # anchor L-1: row L-2
        prev = [ids[-1], *tree.tokens[:-1]]
        with torch.no_grad():
            want_tokens = [int((head.base_logits(g[j:j + 1]) + head.markov_bias(head.markov_embed(
                torch.tensor([prev[j]])))).argmax()) for j in range(4)]
        assert tree.tokens == want_tokens


def test_the_confidence_head_sets_the_verified_length(tiny_checkpoints):
    """draft_threshold with a confidence head: the chain stops before the first draft whose survival (the running
    product of the estimates) is under it; 0.8 per draft and 0.6 keep two (0.8, 0.64), every answer exact."""
    path = tiny_checkpoints["llama"][0]
    model, head, _ = _trained(path, 4, steps=40, confidence_head=True)
    with torch.no_grad():
        head.confidence_head.proj.weight.zero_()
        head.confidence_head.proj.bias.fill_(math.log(0.8 / 0.2))
    ref = _greedy(model, PROMPTS, n=16)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    counts = []
    for threshold, most in ((0.0, 4), (0.6, 2), (0.85, 0)):
        eng = SpecEngine(model, MarkovBlockProposer(head, draft_threshold=threshold), 4, page_size=3,
                         num_pages=256)
        assert [o.output_ids for o in eng.generate(PROMPTS, params)] == ref
        m = eng.stats.metrics
        assert m.num_draft_tokens <= most * max(m.num_drafts, 1), (threshold, m)
        counts.append(m.num_draft_tokens)
    assert counts[0] > counts[1] > counts[2] == 0, counts


def test_sampled_markov_drafts_follow_the_target_distribution(tiny_checkpoints):
    """Chi-square, as for the chain heads (`test_speculative_engine`): the second generated token of many seeded
    requests, the first one through speculative acceptance of the block's left-to-right sampled drafts (a large
    Markov bias, so each draft's distribution depends on the one before), follows the target."""
    path = tiny_checkpoints["llama"][0]
    model = load_model(path)
    head = _head(path, block_size=4)
    with torch.no_grad():
        head.markov_head.markov_w2.weight.normal_(0.0, 20.0)
    prompt, temp, n = [3, 17, 42, 7], 0.7, 3000
    expected_p = _marginal_of_second_token(model, prompt, temp)
    eng = SpecEngine(model, MarkovBlockProposer(head), 3, page_size=4, num_pages=4096, max_batch_size=256)
    outs = eng.generate([prompt] * n, SamplingParams(temperature=temp, max_new_tokens=2, ignore_eos=True, seed=1234))
    assert eng.stats.metrics.num_draft_tokens > 0 and eng.stats.metrics.num_accepted > 0
    assert_second_tokens_follow(outs, expected_p)


@pytest.mark.parametrize("fmt", ["native", "dspark"])
def test_export_round_trip_gives_identical_blocks(tiny_checkpoints, tmp_path, fmt):
    """vLLM's DSpark layout keeps our names; read back, the head drafts the same blocks, Markov biases and
    confidences (verify_round_trip: 0), and a changed Markov or confidence weight shows in the check."""
    target = tiny_checkpoints["qwen3"][0]
    head = _head(target, block_size=4, layers=2, mask_token_id=7, confidence_head=True, confidence_with_markov=True)
    _perturb(head)
    head_dir = save_head(head, tmp_path / "head")
    out = export_head(head_dir, target, fmt, tmp_path / fmt)
    assert verify_round_trip(head_dir, out, target) == 0.0
    back = load_export(out, target)
    assert (back.cfg.settings.markov_rank, back.cfg.settings.confidence_head,
            back.cfg.settings.confidence_with_markov) == (8, True, True)
    assert back.mask_token_id == 7 and back.block_size == 4 and back.cfg.aux_layers == head.cfg.aux_layers
    for i, change in enumerate((lambda: head.markov_head.markov_w2.weight.mul_(1.5),
                                lambda: head.confidence_head.proj.bias.add_(1.0))):
        with torch.no_grad():
            change()
        assert verify_round_trip(save_head(head, tmp_path / f"other{i}"), out, target) > 1e-4


def test_the_vllm_dspark_layout_names_and_config(tiny_checkpoints, tmp_path):
    target = tiny_checkpoints["llama"][0]
    head = _head(target, block_size=5, layers=2, markov_rank=6, confidence_head=True)
    out = export_head(save_head(head, tmp_path / "head"), target, "dspark", tmp_path / "ds")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    assert cfg["num_hidden_layers"] == 2 and cfg["block_size"] == 5
    assert cfg["dflash_config"] == {"block_size": 5, "mask_token_id": 255, "target_layer_ids": [0, 1]}
    assert (cfg["markov_rank"], cfg["markov_head_type"], cfg["enable_confidence_head"],
            cfg["confidence_head_with_markov"], cfg["sample_from_anchor"], cfg["dspark_bonus_anchor"]) == \
        (6, "vanilla", True, False, True, False)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
    v, hs = head.args.vocab_size, head.args.hidden_size
    assert shapes["markov_head.markov_w1.weight"] == (v, 6) and shapes["markov_head.markov_w2.weight"] == (v, 6)
    assert shapes["confidence_head.proj.weight"] == (1, hs) and shapes["confidence_head.proj.bias"] == (1,)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_norm.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)  # the target's are shared
    with pytest.raises(LayoutError, match="hidden_states\\[1..2\\]"):
        export_head(save_head(_head(target, aux_layers=[0, 2]), tmp_path / "h0"), target, "dspark", tmp_path / "x")
    with pytest.raises(LayoutError, match="format dspark takes dspark heads"):
        export_head(save_head(build_head(HeadConfig.of(type="dflash", block_size=3), target, dtype="float32"),
                              tmp_path / "df"), target, "dspark", tmp_path / "y")


def test_mtp_export_in_reverse_imports_a_vllm_dspark_folder(tmp_path):
    """`mtp-export import_from=dspark head_ckpt=<vLLM DSpark folder>`: the drafter becomes a native dspark head
    drafting the same blocks; a layout our block does not compute is refused by its key."""
    target = make_chat_target(tmp_path / "target")
    head = _head(target, block_size=3, mask_token_id=1, aux_layers=[1], confidence_head=True)
    _perturb(head)
    head_dir = save_head(head, tmp_path / "head")
    folder = export_head(head_dir, target, "dspark", tmp_path / "vllm")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["mtp_train"]  # a folder written elsewhere: vLLM's fields only
    (folder / "config.json").write_text(json.dumps(cfg))
    got = import_drafter("dspark", folder, target, dtype=torch.float32)
    own = got.cfg.settings
    assert (got.cfg.type, got.block_size, got.mask_token_id, own.markov_rank, own.confidence_head) == \
        ("dspark", 3, 1, 8, True)
    base = [f"model.path={target}", "model.device=cpu", f"head_ckpt={folder}", "import_from=dspark"]
    res = export_main(compose_config("export", [*base, f"out={tmp_path / 'imported'}"]))
    assert res["max_abs_diff"] == 0.0
    assert verify_round_trip(head_dir, tmp_path / "imported", target) == 0.0
    saved = json.loads((tmp_path / "imported" / "config.json").read_text())
    assert saved["head"]["type"] == "dspark" and saved["extra"]["layout"] == "dspark"
    (folder / "config.json").write_text(json.dumps({**cfg, "sample_from_anchor": False}))
    with pytest.raises(ModelConfigError, match="sample_from_anchor=False"):
        import_drafter("dspark", folder, target)
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["DFlashDraftModel"]}))
    with pytest.raises(ModelConfigError, match=r"no architectures \['Qwen3DSparkModel'\] \(vLLM's DSpark layout\); "
                                               r"this folder is read with import_from=dflash"):
        import_drafter("dspark", folder, target)


def test_trained_by_mtp_train_and_evaluated_by_mtp_eval(tmp_path):
    """`mtp-precompute` → `mtp-train head=dspark` (conf/head/dspark.yaml's recipe, a confidence head; the loss
    falls) → `mtp-eval` drafts Markov chains whose greedy answers equal plain decoding, with and without the
    confidence head's length."""
    target, prompts, _ = precompute_and_train(tmp_path, [
        "train.max_steps=20", "train.eval_every=10", "head=dspark", "head.block_size=3", "loss.steps=3",
        "head.markov_rank=8", "head.confidence_head=true", "loss.kind=argmax_ce"])
    history = metrics_by_step(tmp_path / "run")
    losses = [m["train/loss"] for _, m in sorted(history.items()) if "train/loss" in m]
    assert len(losses) == 20 and sum(losses[-3:]) < 0.98 * sum(losses[:3]), losses
    evals = [m for m in history.values() if "eval/step2/top1" in m]
    assert evals and all(1.0 <= m["spec/tau"] <= 4.0 for m in evals), history
    head = tmp_path / "run" / "heads" / "step-20"
    saved = json.loads((head / "config.json").read_text())["head"]
    assert (saved["type"], saved["block_size"], saved["markov_rank"], saved["confidence_head"]) == \
        ("dspark", 3, 8, True)
    base = [f"model.path={target}", "model.device=cpu", f"head_ckpt={head}", f"prompts=[{prompts}]",
            "max_new_tokens=16", "progress=false", "warmup=false", "plots=false", "ngram.compare=false"]
    report = eval_main(compose_config("eval", [*base, "k=3", "draft_threshold=[0.0,0.3]", f"out={tmp_path / 'e'}"]))
    rows = [r for r in report["rows"] if r["method"] == "head"]
    assert len(rows) >= 2 and all(r["exact_match"] == 1.0 and 1.0 <= r["tau"] <= 4.0 for r in rows)
    with pytest.raises(ValueError, match="dspark heads draft with their own drafter, which takes no tree=3x2x6"):
        eval_main(compose_config("eval", [*base, "k=3", "tree=3x2x6", f"out={tmp_path / 'eval-tree'}"]))


@pytest.mark.parametrize(("family", "name"), FAMILY_CASES, ids=[f"{f}-{n}" for f, n in FAMILY_CASES])
def test_every_family_builds_a_dspark_head_or_refuses_it_by_name(family, name):
    """As dflash: Llama-family targets take the head and its Markov block runs; DeepSeek (MLA) targets refuse it."""
    args = args_from_hf_config(FAMILY_CONFIGS[family][name])
    cfg = HeadConfig.of(type="dspark", block_size=3, aux_layers=[1, 2], markov_rank=4, confidence_head=True)
    if family.startswith("deepseek"):
        with pytest.raises(ModelConfigError, match="takes an mtp head"):
            new_head(cfg, args)
        return
    torch.manual_seed(0)
    frozen = FrozenTargetParts(torch.randn(args.vocab_size, args.hidden_size),
                               torch.randn(args.vocab_size, args.hidden_size), args)
    head = new_head(cfg, args, frozen)
    x, ids = torch.randn(9, head.input_width), torch.randint(0, args.vocab_size, (9,))
    outs = head.unroll(x, ids, [4, 5], 3)
    assert len(outs) == 3 and all(o.shape == (9, args.hidden_size + 4) and torch.isfinite(o).all() for o in outs)
    assert torch.isfinite(head.compute_logits(outs[2])).all() and torch.isfinite(head.confidence_logits(outs[0])).all()
