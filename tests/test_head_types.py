"""Head types are plug-ins: a type registered from outside the package (here, by this test) trains, validates,
drafts in `mtp-eval` and decodes exactly, with nothing of the package naming it.

The type is `pair`: one forward of a small MLP over [E(t_{i+1}) ; h_i] gives two features at once, the estimates of
h_{i+1} and h_{i+2} (a block of two drafts from one forward, no chain and no KV cache). Its training unroll is that
one forward's two outputs as steps 0 and 1 (row i of step j predicts h_{i+j+1}, the alignment every head type
shares); its drafter proposes both drafts of a step from the last target hidden state and the last token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from collections.abc import Sequence as Seq
from typing import Any

import pytest
import torch
from torch import nn

from mtp_train.cli.eval import eval_main
from mtp_train.cli.precompute import precompute_main
from mtp_train.cli.train import train_main
from mtp_train.config import HEAD_TYPES, HeadConfig, HeadType, HeadTypeSpec
from mtp_train.config.head import NORM_FLAGS
from mtp_train.engine import KVCache, LLMEngine, SamplingParams, Sequence
from mtp_train.heads import DraftHead, build_head, packed_shift, resolve_seq_lens
from mtp_train.layers import AttentionMetadata
from mtp_train.layers.norm import RMSNorm
from mtp_train.models import load_model
from mtp_train.speculative.engine import SpecEngine
from mtp_train.speculative.proposers import Drafts, Proposer
from mtp_train.speculative.tree import DraftTree
from tests.conftest import compose_config, make_chat_target, metrics_by_step, topic_conversations

pytestmark = pytest.mark.usefixtures("one_thread")


class PairHead(DraftHead):
    """Two draft features from one forward: x = MLP(fc [E(t_{i+1}) ; h_i]); ĥ_{i+1} = norm(x), ĥ_{i+2} = norm(W x)."""

    type_name = "pair"

    def __init__(self, cfg: HeadConfig, target_args: Any, frozen: Any = None, backend: str = "torch") -> None:
        super().__init__(cfg, target_args, frozen, backend)
        h = self.args.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.mlp = nn.Sequential(nn.Linear(h, 2 * h), nn.SiLU(), nn.Linear(2 * h, h))
        self.second = nn.Linear(h, h, bias=False)
        self.norm = RMSNorm(h, self.args.rms_norm_eps)

    def pair(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, H) target hidden h_i, (T,) t_{i+1} → the estimates of h_{i+1} and h_{i+2}, (T, H) each."""
        x = self.fc(torch.cat([self.embed(token_ids), hidden.to(self.dtype)], -1))
        x = x + self.mlp(x)
        return self.norm(x), self.norm(self.second(x))

    def features(self, hidden, token_ids, meta, kv_cache, attn, *, from_target: bool) -> torch.Tensor:
        if not from_target:
            raise ValueError("a pair head reads the target's hidden states only (it never chains)")
        return self.pair(hidden, token_ids)[0]

    def unroll(self, hidden: torch.Tensor, input_ids: torch.Tensor, seq_lens, steps: int, attention: str = "chain",
               chain_mode: str = "diagonal") -> list[torch.Tensor]:
        if not 1 <= steps <= 2:
            raise ValueError(f"a pair head drafts 2 tokens per forward; loss.steps={steps}")
        self.check_input(hidden, True)
        lens = resolve_seq_lens(hidden.shape[0], seq_lens)
        return list(self.pair(hidden, packed_shift(input_ids, lens, 1)))[:steps]


class PairProposer(Proposer):
    """Both drafts of a step from one head forward over (h_{L-2}, t_{L-1}): no cache, the last target row kept."""

    name = "pair"

    def __init__(self, head: PairHead) -> None:
        self.head = head.eval()
        self.forwards = 0  # head forwards so far: one per step that drafts
        self._last: dict[int, torch.Tensor] = {}  # seq_id → (H,) the target's hidden state at position L-2

    def bind(self, target_kv: KVCache) -> None:
        pass

    def prefill(self, seqs: Seq[Sequence], target_hidden: torch.Tensor) -> None:
        ends = torch.tensor([s.num_prompt_tokens for s in seqs]).cumsum(0) - 1
        for s, e in zip(seqs, ends.tolist()):
            self._last[s.seq_id] = target_hidden[e]

    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence], k: int) -> list[DraftTree]:
        hidden = torch.stack([self._last[s.seq_id] for s in seqs])
        tokens = torch.tensor([s.token_ids[-1] for s in seqs])
        first, second = self.head.pair(hidden, tokens)
        self.forwards += 1
        drafts = Drafts(seqs, self.head.draft_vocab, self.head.args.vocab_size)
        for feat in (first, second)[:min(k, 2)]:
            drafts.add(self.head.compute_logits(feat))
        return drafts.trees()

    def update(self, seqs, old_lens, trees, paths, target_hidden) -> None:
        for s, h in zip(seqs, target_hidden):
            self._last[s.seq_id] = h[-1]

    def release(self, seq: Sequence) -> None:
        self._last.pop(seq.seq_id, None)


def pair_drafter(head: PairHead, options: Mapping[str, Any]) -> PairProposer:
    assert not options, options  # it takes no eval options: `mtp-eval` passes it none
    return PairProposer(head)


def pair_inference_path(head: PairHead, hidden: torch.Tensor, input_ids: torch.Tensor, seq_lens: Seq[int],
                        steps: int) -> list[torch.Tensor]:
    """The drafter's features from every position: the same one forward (it keeps no cache)."""
    return list(head.pair(hidden, packed_shift(input_ids, list(seq_lens), 1)))[:steps]


PAIR = HeadType(HeadTypeSpec("pair", "two drafts from one forward", dict.fromkeys(NORM_FLAGS, False),
                             fixed_norms=NORM_FLAGS), PairHead, pair_drafter, pair_inference_path)


@pytest.fixture(scope="module")
def pair_type() -> Iterator[HeadType]:
    HEAD_TYPES.add(PAIR)
    yield PAIR
    HEAD_TYPES.unregister("pair")


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
