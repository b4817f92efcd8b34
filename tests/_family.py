"""What every target family's test file checks the same way: a random transformers checkpoint saved to disk, parity
of every hidden state and the logits, greedy decoding against HF `generate` (plain and speculative), and a head that
trains a few steps on the target and then drafts without changing greedy output; precompute storing the target's
hidden states."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from mtp_train.config import LossConfig, PrecomputeConfig
from mtp_train.engine import LLMEngine, SamplingParams, prefill_hidden
from mtp_train.head_types.chain import HeadProposer
from mtp_train.precompute import PrecomputedDataset, Sample, precompute
from mtp_train.speculative.engine import SpecEngine
from mtp_train.speculative.proposers import DraftModelProposer
from mtp_train.train.losses import unrolled_loss


def save_random(config, path: Path, init: Callable[[str, torch.Tensor], None] | None = None):
    """A transformers model of `config` (eager attention, seed 0), its norms drawn from U(0.5, 1.5) and every other
    parameter or buffer passed to `init(name, tensor)` (to give routers, sinks and biases real values), saved as
    safetensors to `path`. Returns the model in eval mode."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, t in [*hf.named_parameters(), *hf.named_buffers()]:
            if name.endswith("norm.weight"):
                t.uniform_(0.5, 1.5)
            elif init is not None:
                init(name, t)
    hf.save_pretrained(path, safe_serialization=True)
    return hf


def assert_layers_and_logits_match(model, hf, prompts: Sequence[Sequence[int]], tol: float = 1e-5) -> None:
    """Every hidden state (transformers' hidden_states numbering) and the logits of each prompt equal transformers'."""
    n = model.args.num_layers
    for ids in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([list(ids)]), output_hidden_states=True)
        out = prefill_hidden(model, [list(ids)], hidden_layers=range(n + 1))
        for j in range(n + 1):
            torch.testing.assert_close(out.layers[j], ref.hidden_states[j][0], rtol=tol, atol=tol)
        torch.testing.assert_close(model.compute_logits(out.hidden), ref.logits[0], rtol=tol, atol=tol)


def assert_greedy_matches_generate(model, hf, prompts: Sequence[Sequence[int]], max_new_tokens: int = 14) -> None:
    """Paged greedy decoding over pages of 3 equals HF `generate`, and so does speculative decoding with the target
    as its own draft (which must then accept every draft)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    ref = [hf.generate(torch.tensor([list(p)]), max_new_tokens=max_new_tokens, do_sample=False)[0, len(p):].tolist()
           for p in prompts]
    plain = LLMEngine(model, page_size=3, num_pages=128).generate(prompts, params)
    assert [o.output_ids for o in plain] == ref
    spec = SpecEngine(model, DraftModelProposer(model), 3, page_size=3, num_pages=128)
    assert [o.output_ids for o in spec.generate(prompts, params)] == ref
    assert spec.stats.metrics.acceptance_rate == 1.0


def assert_precompute_stores_hidden(model, model_dir: Path, prompts: Sequence[Sequence[int]], out: Path) -> None:
    """mtp-precompute's pipeline over the prompts (all tokens in the loss) writes, per sample, the model's own final
    hidden states, within bf16 storage rounding."""
    samples = [Sample(f"s{i}", list(p), [1] * len(p)) for i, p in enumerate(prompts)]
    cfg = PrecomputeConfig(out=str(out), shard_tokens=64, batch_tokens=64, val_fraction=0.0, progress=False)
    precompute(model, samples, cfg, tokenizer_fingerprint="t", chat_template_fingerprint="c", model_dir=model_dir,
               data_info={})
    ds = PrecomputedDataset(out, split="all")
    assert len(ds) == len(prompts)
    for i in range(len(ds)):
        item = ds[i]
        ref = prefill_hidden(model, [item["input_ids"].tolist()]).hidden.to(torch.bfloat16)
        torch.testing.assert_close(item["hidden"].float(), ref.float(), rtol=0, atol=2e-2)


def assert_head_trains_and_drafts_losslessly(model, head, prompts: Sequence[Sequence[int]], k: int = 2,
                                             steps: int = 8, max_new_tokens: int = 10) -> None:
    """`steps` Adam steps of the two-step unrolled loss on the prompts' hidden states lower the loss; the head then
    drafts k tokens a step and greedy speculative decoding equals plain greedy decoding."""
    lens = [len(p) for p in prompts]
    out = prefill_hidden(model, prompts, hidden_layers=head.aux_layers)
    aux = torch.cat([out.layers[j] for j in head.aux_layers], -1) if head.aux_layers else None
    ids = torch.tensor([t for p in prompts for t in p])
    cfg = LossConfig(steps=2, w_tok=1.0, chunk_size=16)
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(steps):
        loss, _ = unrolled_loss(head, out.hidden, ids, torch.ones_like(ids), lens, cfg, aux_hidden=aux)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0], losses
    head.eval()
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    ref = [o.output_ids for o in LLMEngine(model, page_size=3, num_pages=128).generate(prompts, params)]
    spec = SpecEngine(model, HeadProposer(head), k, page_size=3, num_pages=128)
    assert [o.output_ids for o in spec.generate(prompts, params)] == ref
