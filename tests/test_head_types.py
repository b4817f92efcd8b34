"""Head types are plug-ins: a type registered from outside the package (here, by this test) trains, validates,
drafts in `mtp-eval` and decodes exactly, with nothing of the package naming it.

The type is the template `pair` (tests/head_template/pair/): one forward of a small MLP over [E(t_{i+1}) ; h_i]
gives two features at once, the estimates of h_{i+1} and h_{i+2} (a block of two drafts from one forward, no chain
and no KV cache). Its training unroll is that one forward's two outputs as steps 0 and 1 (row i of step j predicts
h_{i+j+1}, the alignment every head type shares); its drafter proposes both drafts of a step from the last target
hidden state and the last token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from mtp_train.cli.eval import eval_main
from mtp_train.cli.precompute import precompute_main
from mtp_train.cli.train import train_main
from mtp_train.config import HEAD_TYPES, HeadConfig, HeadType
from mtp_train.engine import LLMEngine, SamplingParams
from mtp_train.export.layouts import LAYOUTS
from mtp_train.heads import build_head
from mtp_train.layers import AttentionMetadata
from mtp_train.models import load_model
from mtp_train.speculative.engine import SpecEngine
from tests.conftest import compose_config, make_chat_target, metrics_by_step, topic_conversations
from tests.head_template.pair import HEAD_TYPE as TEMPLATE_TYPE
from tests.head_template.pair.drafter import PairProposer, pair_inference_path
from tests.head_template.pair.head import PairHead

pytestmark = pytest.mark.usefixtures("one_thread")


# The template head type's parts (tests/head_template/pair/), registered here by hand, as a package of one's own
# would register them through an entry point (tests/test_head_template.py finds the same folder by scanning).
PAIR = TEMPLATE_TYPE


@pytest.fixture(scope="module")
def pair_type() -> Iterator[HeadType]:
    HEAD_TYPES.add(PAIR)
    yield PAIR
    HEAD_TYPES.unregister("pair")
    if LAYOUTS.registered("pair-flat") is not None:  # its layout, registered when the export formats were read
        LAYOUTS.unregister("pair-flat")


_cfg = compose_config




def test_a_registered_head_type_is_built_and_asked_for_its_parts(pair_type, tmp_path):
    target = make_chat_target(tmp_path / "target")
    head = build_head(HeadConfig(type="pair"), target, dtype="float32")
    assert isinstance(head, PairHead) and HEAD_TYPES["pair"] is pair_type
    proposer = pair_type.drafter(head, {})
    assert isinstance(proposer, PairProposer)
    with pytest.raises(ValueError, match="unknown head type 'quad'; choose one of .*pair"):
        HeadConfig(type="quad")


def test_a_head_type_from_outside_trains_drafts_in_eval_and_decodes_exactly(pair_type, tmp_path):
    """Registered by this test alone: `mtp-precompute` → `mtp-train head.type=pair` (two unrolled steps, validated
    through its own inference path and its drafter) → `mtp-eval` drafts two tokens per forward, and every greedy
    answer equals plain decoding; an eval option its drafter does not take is refused by name."""
    target = make_chat_target(tmp_path / "target")
    convs, prompts = topic_conversations(tmp_path)
    precompute_main(_cfg("precompute", [f"model.path={target}", "model.device=cpu", f"data.paths=[{convs}]",
                                        f"out={tmp_path / 'pc'}", "max_seq_len=64", "progress=false",
                                        "val_fraction=0.25"]))
    train_main(_cfg("train", [
        f"model.path={target}", "model.device=cpu", "model.backend=torch", f"data.dir={tmp_path / 'pc'}",
        f"out={tmp_path / 'run'}", "wandb.mode=disabled", "train.progress=false", "train.max_steps=6",
        "train.micro_batch_tokens=256", "train.eval_every=3", "train.eval_batches=2", "train.save_every=0",
        "optim.lr=1e-2", "optim.warmup_steps=1", "head.type=pair", "loss.steps=2", "loss.unroll_attention=causal",
        f"spec_eval.prompts=[{prompts}]", "spec_eval.k=2", "spec_eval.max_new_tokens=8"]))
    history = metrics_by_step(tmp_path / "run")
    losses = [m[key] for m in history.values() for key in m if key.endswith("loss") and "/" not in key[6:]]
    assert losses and all(torch.isfinite(torch.tensor(losses))), history
    evals = [m for m in history.values() if "eval/step1/top1" in m]
    assert evals and all(1.0 <= m["spec/tau"] <= 3.0 for m in evals), history
    head = tmp_path / "run" / "heads" / "step-6"
    assert json.loads((head / "config.json").read_text())["head"]["type"] == "pair"

    base = [f"model.path={target}", "model.device=cpu", f"head_ckpt={head}", f"prompts=[{prompts}]",
            "max_new_tokens=16", "progress=false", "warmup=false", "plots=false", "ngram.compare=false"]
    report = eval_main(_cfg("eval", [*base, "k=2", f"out={tmp_path / 'eval'}"]))
    rows = [r for r in report["rows"] if r["method"] == "head"]
    assert rows and all(r["exact_match"] == 1.0 and 1.0 <= r["tau"] <= 3.0 for r in rows)
    assert all(r["mean_draft_len"] == 2 for r in rows)  # both drafts of every step come from its one forward
    with pytest.raises(ValueError, match="pair heads draft with their own drafter, which takes no draft_width=2"):
        eval_main(_cfg("eval", [*base, "k=2", "draft_width=2", f"out={tmp_path / 'eval-width'}"]))


def test_the_drafter_runs_one_head_forward_per_step_and_decodes_exactly(pair_type, tmp_path):
    target = make_chat_target(tmp_path / "target")
    model = load_model(target, dtype="float32", backend="torch")
    head = build_head(HeadConfig(type="pair"), target, dtype="float32")
    prompts = [[5, 9, 11, 3], [7, 2, 8], [12, 40, 41, 42, 7]]
    params = SamplingParams(max_new_tokens=14, ignore_eos=True)
    plain = LLMEngine(model, page_size=4, num_pages=64).generate(prompts, params)
    spec = SpecEngine(model, pair_type.drafter(head, {}), 2, page_size=4, num_pages=64).generate(prompts, params)
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
    proposer = pair_type.drafter(head, {})  # one request: one verification per step
    eng = SpecEngine(model, proposer, 2, page_size=4, num_pages=64)
    assert eng.generate(prompts[:1], params)[0].output_ids == plain[0].output_ids
    m = eng.stats.metrics
    assert proposer.forwards == m.num_drafts > 0 and m.num_draft_tokens == 2 * m.num_drafts
    # its validation path is its training unroll (no cache: the same forward)
    hidden = torch.randn(7, head.args.hidden_size)
    ids = torch.randint(0, head.args.vocab_size, (7,))
    with torch.no_grad():
        for a, b in zip(head.unroll(hidden, ids, [4, 3], 2), pair_inference_path(head, hidden, ids, [4, 3], 2)):
            torch.testing.assert_close(a, b)
    meta = AttentionMetadata.build([7])
    with pytest.raises(ValueError, match="never chains"):
        head(hidden, ids, meta, from_target=False)
