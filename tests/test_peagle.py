"""The peagle head (P-EAGLE): its slots read the placeholder and see only their anchor's context and earlier slots,
its training unroll equals its inference path through the paged cache, it trains (the loss falls), its drafter runs
one head forward per step whose k drafts equal the unroll's and decodes exactly as plain greedy, it is trained by
`mtp-train` and evaluated by `mtp-eval`, and its exports (native, speculators-peagle) read back unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mtp_train.cli.eval import eval_main
from mtp_train.cli.export import export_main
from mtp_train.config import HEAD_TYPES, HeadConfig, LossConfig
from mtp_train.engine import LLMEngine, SamplingParams, prefill_hidden
from mtp_train.export import LayoutError, export_head, load_export, verify_round_trip
from mtp_train.export.importer import import_drafter
from mtp_train.head_types.peagle import HEAD_TYPE
from mtp_train.head_types.peagle.drafter import ParallelProposer, parallel_drafter, parallel_inference_path
from mtp_train.head_types.peagle.head import PEagleHead
from mtp_train.heads import build_head, packed_shift, save_head
from mtp_train.models import ModelConfigError, load_model
from mtp_train.speculative.engine import SpecEngine
from mtp_train.train.losses import in_draft_vocab, step_anchor_seed, step_loss, step_token_counts, unrolled_loss
from mtp_train.train.sequence_parallel import SequenceParallel
from tests.conftest import compose_config, make_tiny_checkpoint, metrics_by_step, precompute_and_train
from tests.test_speculative_engine import _marginal_of_second_token, assert_second_tokens_follow

pytestmark = pytest.mark.usefixtures("one_thread")

if "peagle" not in HEAD_TYPES:  # a checkout whose installed entry points predate the type (pip install -e . adds it)
    HEAD_TYPES.add(HEAD_TYPE)

TOL = dict(rtol=1e-4, atol=1e-4)
PROMPTS = [[3, 17, 42], [5, 9, 11, 200, 7, 1, 8], list(range(20, 33)), [250] * 2 + list(range(40, 58))]


def _head(path, seed=0, **kw) -> PEagleHead:
    torch.manual_seed(seed)
    kw.setdefault("draft_vocab_size", 64)
    head = build_head(HeadConfig.of(type="peagle", **kw), path, dtype="float32")
    assert isinstance(head, PEagleHead)
    return head


def _perturbed(head: PEagleHead) -> PEagleHead:
    """Weights away from their start (unit norms, the target's lm_head rows), so that a wrong map shows."""
    with torch.no_grad():
        for n, p in head.named_parameters():
            p.add_(torch.randn_like(p) * (0.2 if n.endswith("norm.weight") else 0.05))
    return head


def _batch(head, path, seqs):
    model = load_model(path, dtype="float32")
    out = prefill_hidden(model, seqs, hidden_layers=head.aux_layers)
    aux = torch.cat([out.layers[j] for j in head.aux_layers], -1)
    return out.hidden, aux, torch.tensor([t for s in seqs for t in s]), [len(s) for s in seqs]


def test_slots_see_their_anchor_context_and_earlier_slots_only(tiny_checkpoints):
    """Slot j of anchor i reads neither the rows after i nor the tokens after t_{i+1} (it drafts from the context up
    to i alone); the unroll equals the inference path through the paged cache, and depth 0 is EAGLE-3's step 0."""
    path = tiny_checkpoints["llama"][0]
    head = _perturbed(_head(path))
    assert head.mask_token_id == head.args.vocab_size - 1 and head.mask_hidden.shape == (head.input_width,)
    assert head.kv_shape[0] == 1
    _, aux, ids, lens = _batch(head, path, [PROMPTS[2], PROMPTS[1]])
    steps = 4
    with torch.no_grad():
        outs = head.unroll(aux, ids, lens, steps)
        path_outs = parallel_inference_path(head, aux, ids, lens, steps)
        for a, b in zip(outs, path_outs):
            torch.testing.assert_close(a, b, **TOL)
        torch.testing.assert_close(outs[0], head.forward_train(aux, packed_shift(ids, lens, 1), lens), **TOL)
        i = 5  # change every row after anchor i of the first sequence, and every token after t_{i+1} (its row's)
        aux2, ids2 = aux.clone(), ids.clone()
        aux2[i + 1:lens[0]] += 1.0
        ids2[i + 2:lens[0]] = (ids2[i + 2:lens[0]] + 7) % head.args.vocab_size
        changed = head.unroll(aux2, ids2, lens, steps)
    for j in range(1, steps):  # the slots of anchors 0..i and of the other sequence are unchanged
        torch.testing.assert_close(changed[j][:i + 1], outs[j][:i + 1], **TOL)
        torch.testing.assert_close(changed[j][lens[0]:], outs[j][lens[0]:], **TOL)
        assert not torch.allclose(changed[j][i + 1:lens[0]], outs[j][i + 1:lens[0]], **TOL)
    with torch.no_grad():
        head.mask_hidden.add_(1.0)  # only the slots read it
        moved = head.unroll(aux, ids, lens, steps)
    torch.testing.assert_close(moved[0], outs[0])
    assert not torch.allclose(moved[1], outs[1], **TOL)


def test_settings_and_refusals(tiny_checkpoints):
    path = tiny_checkpoints["llama"][0]
    head = _head(path)
    with pytest.raises(ValueError, match="own draft vocabulary"):
        HeadConfig(type="peagle")
    with pytest.raises(ValueError, match="aux layers only"):
        HeadConfig(type="peagle", features="final", draft_vocab_size=8)
    with pytest.raises(ValueError, match="head.block_size is a dflash / dspark setting"):
        HeadConfig.of(type="peagle", draft_vocab_size=8, block_size=4)
    with pytest.raises(ValueError, match="norm_output"):
        HeadConfig.of(type="peagle", draft_vocab_size=8, norm_output=True)
    with pytest.raises(ValueError, match="loss.unroll_attention=chain"):
        head.unroll(torch.randn(5, head.input_width), torch.arange(5), [5], 2, attention="causal")
    with pytest.raises(ValueError, match="parallel drafter takes draft_threshold; not draft_width"):
        parallel_drafter(head, {"draft_width": 2})
    assert head.accepts_unroll_option("shard") and head.accepts_unroll_option("checkpoint")


def _greedy(model, prompts, n=24, page_size=3):
    out = LLMEngine(model, page_size=page_size, num_pages=256).generate(
        prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))
    return [o.output_ids for o in out]


def _trained(path, steps=6, iters=40):
    """A peagle head trained briefly on the target's own greedy continuations (so its drafts are often right)."""
    model = load_model(path, dtype="float32")
    head = _head(path, draft_vocab_size=256)
    seqs = [p + o for p, o in zip(PROMPTS, _greedy(model, PROMPTS, n=40))]
    hidden, aux, ids, lens = _batch(head, path, seqs)
    cfg = LossConfig(steps=steps, step_decay=1.0, w_feat=0.0, w_tok=1.0, kind="argmax_ce")
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    losses = []
    for it in range(iters):  # COD sampling drawn afresh every step, as the trainer draws it
        loss, _ = unrolled_loss(head, hidden, ids, torch.ones_like(ids), lens, cfg, aux_hidden=aux,
                                anchor_seed=step_anchor_seed(0, it, 0, 0))
        opt.zero_grad()
        loss.backward()
        assert head.mask_hidden.grad is not None and head.mask_hidden.grad.abs().sum() > 0
        opt.step()
        losses.append(float(loss.detach()))
    return model, head.eval(), losses


@pytest.fixture(scope="module")
def trained(tiny_checkpoints):
    return _trained(tiny_checkpoints["llama"][0])


def test_the_loss_falls_and_greedy_parallel_drafts_equal_plain_greedy(trained):
    model, head, losses = trained
    assert losses[-1] < 0.7 * losses[0], losses
    ref = _greedy(model, PROMPTS)
    for k in (1, 3, 6):
        proposer = ParallelProposer(head)
        eng = SpecEngine(model, proposer, k, page_size=3, num_pages=256)
        out = eng.generate(PROMPTS, SamplingParams(max_new_tokens=24, ignore_eos=True))
        assert [o.output_ids for o in out] == ref
        m = eng.stats.metrics
        assert m.num_draft_tokens == k * m.num_drafts  # all k drafts of a step, every step
        assert proposer.forwards == eng.stats.verify_steps  # from one head forward per step
        if k > 1:
            assert m.mean_acceptance_length > 1.5
        assert eng.runner.kv.allocator.num_free == eng.runner.kv.num_pages


class _Recording(ParallelProposer):
    """The drafter, keeping each step's sequences (their tokens then) and the features of its one forward."""

    def __init__(self, head: PEagleHead) -> None:
        super().__init__(head)
        self.seen: list[tuple[list[list[int]], torch.Tensor]] = []

    def draft_forward(self, seqs, k):
        feats, logits = super().draft_forward(seqs, k)
        self.seen.append(([list(s.token_ids) for s in seqs], feats.clone()))
        return feats, logits


def test_the_drafter_forward_equals_the_unroll(tiny_checkpoints, trained):
    """Every step's one forward (after prefill, and after verifications that left slots past the accepted length,
    then overwritten) gives the k features the unroll computes from the whole sequence's target features at that
    anchor: drafting is exactly the trained computation."""
    path = tiny_checkpoints["llama"][0]
    model, head, _ = trained
    k = 4
    proposer = _Recording(head)
    eng = SpecEngine(model, proposer, k, page_size=3, num_pages=256)
    eng.generate(PROMPTS[:3], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert len(proposer.seen) == eng.stats.verify_steps > 3
    for tokens, feats in proposer.seen[::2]:
        for ids, got in zip(tokens, feats):
            _, aux, t, lens = _batch(head, path, [ids])
            with torch.no_grad():
                want = head.unroll(aux, t, lens, k)
            i = len(ids) - 2  # the last row with a next token drafts d_1: anchor L-2
            for j in range(k):
                torch.testing.assert_close(got[j], want[j][i], **TOL)


@pytest.mark.slow
def test_sampled_parallel_drafts_follow_the_target_distribution(tiny_checkpoints, trained):
    """Chi-square, as for the chain heads (`test_speculative_engine`): the second generated token of many seeded
    requests, the first one through speculative acceptance of the slots' sampled drafts, follows the target."""
    model, head, _ = trained
    prompt, temp, n = [3, 17, 42, 7], 0.7, 3000
    expected_p = _marginal_of_second_token(model, prompt, temp)
    eng = SpecEngine(model, ParallelProposer(head), 3, page_size=4, num_pages=4096, max_batch_size=256)
    outs = eng.generate([prompt] * n, SamplingParams(temperature=temp, max_new_tokens=2, ignore_eos=True, seed=1234))
    assert eng.stats.metrics.num_draft_tokens > 0 and eng.stats.metrics.num_accepted > 0
    assert_second_tokens_follow(outs, expected_p)


def test_draft_threshold_shortens_the_chain(trained):
    model, head, _ = trained
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    eng = SpecEngine(model, ParallelProposer(head, draft_threshold=0.9), 4, page_size=3, num_pages=256)
    assert [o.output_ids for o in eng.generate(PROMPTS, params)] == _greedy(model, PROMPTS, n=16)
    m = eng.stats.metrics
    assert m.num_draft_tokens < 4 * m.num_drafts


@pytest.mark.parametrize("fmt", ["native", "speculators-peagle"])
def test_export_round_trip_gives_identical_features(tmp_path, fmt):
    target = tmp_path / "target"
    make_tiny_checkpoint("llama", target, num_hidden_layers=5)  # vLLM captures hidden_states[1..L-1]
    head = _perturbed(_head(target, aux_layers=[1, 2, 4]))
    head_dir = save_head(head, tmp_path / "head")
    out = export_head(head_dir, target, fmt, tmp_path / fmt)
    assert verify_round_trip(head_dir, out, target) == 0.0
    back = load_export(out, target)
    assert isinstance(back, PEagleHead) and torch.equal(back.mask_hidden, head.mask_hidden)
    assert torch.equal(back.draft_vocab, head.draft_vocab) and back.cfg.aux_layers == [1, 2, 4]
    with torch.no_grad():  # the drafts of a whole step agree
        hidden, ids = torch.randn(9, head.input_width), torch.randint(0, head.args.vocab_size, (9,))
        for a, b in zip(head.unroll(hidden, ids, [4, 5], 3), back.unroll(hidden, ids, [4, 5], 3)):
            assert torch.equal(a, b)
        head.mask_hidden.mul_(1.5)  # a change the slots alone read shows in the round-trip check
    assert verify_round_trip(save_head(head, tmp_path / "other"), out, target) > 1e-4


def test_the_speculators_peagle_layout_names_and_config(tmp_path):
    """The tensors and config.json keys vLLM reads (`configs/speculators/algos.py` update_peagle, `llama_eagle3.py`
    load_weights): speculators_model_type peagle, mask_token_id, mask_hidden of the fc's input width."""
    target = tmp_path / "target"
    make_tiny_checkpoint("llama", target, num_hidden_layers=5)
    head = _head(target, aux_layers=[1, 2, 4])
    out = export_head(save_head(head, tmp_path / "head"), target, "speculators-peagle", tmp_path / "pe")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "peagle" and cfg["mask_token_id"] == head.args.vocab_size - 1
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4] and cfg["draft_vocab_size"] == 64
    assert cfg["norm_before_residual"] is False and "fc_norm" not in cfg
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    assert cfg["speculators_config"]["algorithm"] == "peagle"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert tuple(f.get_tensor("mask_hidden").shape) == (1, 1, 3 * head.args.hidden_size)
    assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.gate_proj.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d", "mask_hidden"} <= names
    with pytest.raises(LayoutError, match="head.aux_norm=true: vLLM's peagle config reader"):
        export_head(save_head(_head(target, aux_layers=[1, 2, 4], aux_norm=True), tmp_path / "h31"), target,
                    "speculators-peagle", tmp_path / "x")
    with pytest.raises(LayoutError, match="use a format for peagle heads: native, speculators-peagle"):
        export_head(save_head(_head(target, aux_layers=[1, 2, 4]), tmp_path / "h"), target, "speculators",
                    tmp_path / "y")


@pytest.mark.slow
def test_trained_by_mtp_train_and_evaluated_by_mtp_eval(tmp_path):
    """`mtp-precompute` (its aux layers) → `mtp-train head=peagle` (validated through its inference path and its
    drafter) → `mtp-eval` drafts k tokens per forward whose greedy answers equal plain decoding."""
    target, prompts, _ = precompute_and_train(tmp_path, [
        "train.max_steps=12", "train.eval_every=6", "head=peagle", "head.draft_vocab_size=128",
        "head.aux_layers=[1,2]", "loss.steps=3", "loss.kind=argmax_ce"])
    history = metrics_by_step(tmp_path / "run")
    losses = [m["train/loss"] for _, m in sorted(history.items()) if "train/loss" in m]
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses))), losses
    evals = [m for m in history.values() if "eval/step2/top1" in m]
    assert evals and all(1.0 <= m["spec/tau"] <= 4.0 for m in evals), history
    head = tmp_path / "run" / "heads" / "step-12"
    assert json.loads((head / "config.json").read_text())["head"]["type"] == "peagle"
    base = [f"model.path={target}", "model.device=cpu", f"head_ckpt={head}", f"prompts=[{prompts}]",
            "max_new_tokens=16", "progress=false", "warmup=false", "plots=false", "ngram.compare=false"]
    report = eval_main(compose_config("eval", [*base, "k=3", f"out={tmp_path / 'eval'}"]))
    rows = [r for r in report["rows"] if r["method"] == "head"]
    assert rows and all(r["exact_match"] == 1.0 and r["mean_draft_len"] == 3 for r in rows)
    with pytest.raises(ValueError, match="peagle heads draft with their own drafter, which takes no draft_width=2"):
        eval_main(compose_config("eval", [*base, "k=3", "draft_width=2", f"out={tmp_path / 'eval-width'}"]))


def test_a_speculators_peagle_folder_is_imported_and_refused_where_the_head_would_change_it(tmp_path):
    """Our export read by the importer (`import_drafter`, as a folder from speculators) drafts the same; a folder's
    own placeholder token becomes the head's (head.mask_token_id); a trained embedding is refused by name."""
    target = tmp_path / "target"
    make_tiny_checkpoint("llama", target, num_hidden_layers=5)
    head = _perturbed(_head(target, aux_layers=[1, 2, 4]))
    out = export_head(save_head(head, tmp_path / "head"), target, "speculators-peagle", tmp_path / "pe")
    back = import_drafter("speculators-peagle", out, target)
    assert isinstance(back, PEagleHead) and back.cfg.aux_layers == [1, 2, 4] and back.cfg.draft_vocab_size == 64
    with torch.no_grad():
        hidden, ids = torch.randn(9, head.input_width), torch.randint(0, head.args.vocab_size, (9,))
        for a, b in zip(head.unroll(hidden, ids, [4, 5], 3), back.unroll(hidden, ids, [4, 5], 3)):
            assert torch.equal(a, b)
    folder = tmp_path / "foreign"
    folder.mkdir()
    cfg = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({**cfg, "mask_token_id": 5}))
    save_file(tensors, str(folder / "model.safetensors"))
    five = import_drafter("speculators-peagle", folder, target)
    assert isinstance(five, PEagleHead) and five.mask_token_id == 5 and five.cfg.settings.mask_token_id == 5
    same = _head(target, aux_layers=[1, 2, 4], mask_token_id=5)
    same.load_state_dict(head.state_dict())
    with torch.no_grad():  # its slots read token 5: the drafts of the head with that placeholder, not ours
        for j, (a, b, c) in enumerate(zip(five.unroll(hidden, ids, [4, 5], 3), same.unroll(hidden, ids, [4, 5], 3),
                                          head.unroll(hidden, ids, [4, 5], 3))):
            assert torch.equal(a, b) and (j == 0) == torch.equal(a, c)
    again = export_head(save_head(five, tmp_path / "five"), target, "speculators-peagle", tmp_path / "pe5")
    assert json.loads((again / "config.json").read_text())["mask_token_id"] == 5
    for bad, why in ((-1, "a token id >= 0"), (True, "a token id >= 0"),
                     (10**6, "not a token of transformer_layer_config.vocab_size")):
        (folder / "config.json").write_text(json.dumps({**cfg, "mask_token_id": bad}))
        with pytest.raises(ModelConfigError, match=f"mask_token_id={bad!r} \\({why}"):
            import_drafter("speculators-peagle", folder, target)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({**tensors, "embed_tokens.weight": torch.randn(head.args.vocab_size, head.args.hidden_size)},
              str(folder / "model.safetensors"))
    with pytest.raises(ModelConfigError, match="embed_tokens.weight is not the target's embedding"):
        import_drafter("speculators-peagle", folder, target)
    (folder / "config.json").write_text(json.dumps({**cfg, "norm_before_fc": True}))
    with pytest.raises(ModelConfigError, match="norm_before_fc=True"):
        import_drafter("speculators-peagle", folder, target)
    # the command: `mtp-export import_from=speculators-peagle` writes the same head as a native one
    res = export_main(compose_config("export", [f"model.path={target}", "model.device=cpu", f"head_ckpt={out}",
                                                "import_from=speculators-peagle", f"out={tmp_path / 'imported'}"]))
    assert res["max_abs_diff"] == 0.0
    saved = json.loads((tmp_path / "imported" / "config.json").read_text())
    assert saved["head"]["type"] == "peagle" and saved["extra"]["imported_from"] == str(out)


# --- sequence parallelism: the slots' unroll over 2 gloo ranks equals 1 rank (as tests/test_sequence_parallel.py) ---

SP_LENS = [301, 37]  # a long and a short sample (338 rows: one pad row under SP = 2)


def _sp_case(root: Path) -> tuple[PEagleHead, dict, LossConfig]:
    target = root / "target"
    torch.manual_seed(0)
    head = build_head(HeadConfig(type="peagle", aux_layers=[1, 2, 3], draft_vocab_size=200), target,
                      dtype="float32").train()
    g = torch.Generator().manual_seed(0)
    rows = sum(SP_LENS)
    mask = (torch.rand(rows, generator=g) < 0.7).to(torch.uint8)
    batch = {"input_ids": torch.randint(0, 255, (rows,), generator=g), "loss_mask": mask,
             "hidden": torch.randn(rows, head.args.hidden_size, generator=g),
             "aux_hidden": torch.randn(rows, head.input_width, generator=g)}
    return head, batch, LossConfig(steps=4, step_decay=1.0, w_feat=0.0, w_tok=1.0)


SP_SEED = step_anchor_seed(0, 3, 0, 0)  # one training step's COD draw, the same on every rank of the group


def _sp_counts(head, batch, cfg, shard=None):
    rows = head.loss_rows(batch["input_ids"], batch["loss_mask"], SP_LENS, SP_SEED)
    assert rows is not None and (rows > 1).sum() < (rows > 0).sum()  # the deeper depths train fewer anchors
    return step_token_counts(batch["loss_mask"], SP_LENS, cfg.steps, rows, shard)


def _sp_loss(head, batch, cfg, shard=None, counts=None, checkpoint=False):
    head.zero_grad(set_to_none=True)
    loss, _ = unrolled_loss(head, batch["hidden"], batch["input_ids"], batch["loss_mask"], SP_LENS, cfg,
                            num_tokens=counts, aux_hidden=batch["aux_hidden"], shard=shard, checkpoint=checkpoint,
                            anchor_seed=SP_SEED)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}


def _sp_worker(rank: int, world: int, root: str) -> None:
    """One of 2 ranks (train.sequence_parallel = 2): its loss and gradients, plain and checkpointed."""
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=world)
    try:
        sp = SequenceParallel.setup(world, rank, world, torch.device("cpu"))
        head, batch, cfg = _sp_case(Path(root))
        shard = sp.shard(sum(SP_LENS))
        counts = _sp_counts(head, batch, cfg, shard)
        tdist.all_reduce(counts, group=sp.groups.group)
        out = {c: _sp_loss(head, batch, cfg, shard, counts, checkpoint=c) for c in (False, True)}
        torch.save(out, Path(root) / f"rank{rank}.pt")
    finally:
        tdist.destroy_process_group()


@pytest.mark.slow
def test_sequence_parallel_slots_equal_one_rank(tmp_path):
    make_tiny_checkpoint("llama", tmp_path / "target", num_key_value_heads=2, max_position_embeddings=1024)
    mp.start_processes(_sp_worker, args=(2, str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    head, batch, cfg = _sp_case(tmp_path)
    ref_loss, ref_grads = _sp_loss(head, batch, cfg, counts=_sp_counts(head, batch, cfg))
    assert "mask_hidden" in ref_grads
    for checkpoint in (False, True):
        torch.testing.assert_close(sum(r[checkpoint][0] for r in ranks), ref_loss, rtol=1e-5, atol=1e-6)
        for n, ref in ref_grads.items():
            torch.testing.assert_close(sum(r[checkpoint][1][n] for r in ranks), ref, rtol=1e-4, atol=1e-6, msg=n)


# --- COD sampling: fewer anchors at deeper depths, as speculators' P-EAGLE trains ---------------------------------


def _cod_batch(lens, seed=0):
    """Random tokens and a loss mask with stretches out of the loss (user turns) over packed sequences `lens`."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    mask = torch.rand(total, generator=g) < 0.9
    for lo in torch.randint(0, total - 8, (6,), generator=g).tolist():
        mask[lo:lo + 8] = False
    return torch.randint(0, 255, (total,), generator=g), mask


@pytest.mark.parametrize(("ratio", "floor"), [(0.7, 0.2), (0.5, 0.0), (0.9, 0.6)])
def test_cod_sampling_follows_the_references_rule(tiny_checkpoints, ratio, floor):
    """Depth d >= 1 trains min(floor((n - d) · max(r^d, r_min)), its candidates) anchors: those depth d - 1 trained
    whose depth-d target (position i+d+1 of the row's own sequence) is a loss position; n counts depth 0's. The same
    seed draws the same rows, another seed others; no seed: a draw fixed by the batch."""
    head = _head(tiny_checkpoints["llama"][0], down_sample_ratio=ratio, down_sample_ratio_min=floor)
    lens = [301, 37, 500]
    ids, mask = _cod_batch(lens)
    seed = step_anchor_seed(0, 5, 0, 0)
    rows = head.loss_rows(ids, mask, lens, seed)
    assert rows is not None and rows.dtype == torch.long and bool((rows >= 1).all())
    n = int(packed_shift(mask, lens, 1, fill=False).sum())
    counts, d = [], 1
    while True:
        candidates = (rows > d - 1) & packed_shift(mask, lens, d + 1, fill=False)
        drawn = rows > d
        assert not bool((drawn & ~candidates).any()), d  # nested, and every drawn row has a target
        want = min(int(max(0, n - d) * max(ratio**d, floor)), int(candidates.sum()))
        assert int(drawn.sum()) == want, (d, int(drawn.sum()), want)
        counts.append(want)
        if not want:
            break
        d += 1
    assert counts[0] == int((n - 1) * ratio) and counts[0] > counts[1] > counts[2] > 0
    assert torch.equal(rows, head.loss_rows(ids, mask, lens, seed))
    assert not torch.equal(rows, head.loss_rows(ids, mask, lens, step_anchor_seed(0, 6, 0, 0)))
    assert torch.equal(head.loss_rows(ids, mask, lens), head.loss_rows(ids, mask, lens))
    assert _head(tiny_checkpoints["llama"][0], down_sample_ratio=1.0).loss_rows(ids, mask, lens, seed) is None
    with pytest.raises(ValueError, match=r"head.down_sample_ratio must lie in \(0, 1\]"):
        HeadConfig.of(type="peagle", draft_vocab_size=8, down_sample_ratio=0.0)
    with pytest.raises(ValueError, match=r"head.down_sample_ratio_min must lie in \[0, 1\]"):
        HeadConfig.of(type="peagle", draft_vocab_size=8, down_sample_ratio_min=1.5)


def test_cod_counts_and_loss_agree_and_rows_not_drawn_are_not_in_it(tiny_checkpoints):
    """The trainer's counts (`step_token_counts` over `loss_rows` of the step's seed) are the loss's own, and the
    loss is the depths' losses over the drawn rows alone: other values at the unroll's rows not drawn change nothing
    of it or of its gradient."""
    path = tiny_checkpoints["llama"][0]
    head = _perturbed(_head(path)).train()
    hidden, aux, ids, lens = _batch(head, path, [PROMPTS[3] * 3, PROMPTS[2] * 2])
    mask = torch.ones_like(ids)
    mask[30:36] = 0
    cfg = LossConfig(steps=4, step_decay=1.0, w_feat=0.0, w_tok=1.0, mask_out_of_draft=True, noise_std=0.0)
    seed = step_anchor_seed(0, 7, 0, 0)
    rows = head.loss_rows(ids, mask, lens, seed)
    counts = step_token_counts(mask, lens, cfg.steps, rows)
    assert counts[3] < counts[1] < counts[0]
    head.zero_grad(set_to_none=True)
    loss, m = unrolled_loss(head, hidden, ids, mask, lens, cfg, num_tokens=counts, aux_hidden=aux, anchor_seed=seed)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
    assert [float(m[f"step{j}/num_tokens"]) for j in range(cfg.steps)] == counts.tolist()
    head.zero_grad(set_to_none=True)
    preds = head.unroll(aux, ids, lens, cfg.steps)
    in_vocab = in_draft_vocab(head, hidden)
    # other values at the rows not drawn (finite: the final norm before the lm_head reads every row, and its weight's
    # gradient sums 0 · x over the rows not counted)
    total = sum(step_loss(head, torch.where((rows > j)[:, None], p, 100 * torch.randn_like(p)), hidden, mask, lens,
                          j, cfg, counts[j], in_vocab, None, rows)[0] for j, p in enumerate(preds))
    torch.testing.assert_close(total, loss)
    total.backward()
    assert "mask_hidden" in grads
    for n, p in head.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n], msg=n)
