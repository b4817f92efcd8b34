"""What the GPU check's groups share: the PASS/FAIL record, the tolerance, relative error, a random Llama checkpoint,
teacher-forced logits through the paged cache, the agreement rule of two greedy runs, and one target under check
(loaded once on both attention backends, with the prompts every per-model group uses)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from mtp_train.engine import LLMEngine, ModelRunner, SamplingParams, Sequence, prefill_hidden
from mtp_train.models import load_model

DT = torch.bfloat16
# bf16 kernels accumulate in different orders: compare with a tolerance scaled to the values
TOL = 3e-2


@dataclass
class Checks:
    """The record of a run: each check printed as PASS/FAIL with its measured detail when it is made."""

    results: list[tuple[str, bool, str]] = field(default_factory=list)  # (name, passed, detail) in order

    def __call__(self, name: str, ok: bool, detail: str) -> None:
        self.results.append((name, ok, detail))
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)

    @property
    def passed(self) -> int:
        return sum(ok for _, ok, _ in self.results)

    @property
    def failed(self) -> int:
        return len(self.results) - self.passed


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| over max |b|, in float32."""
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def random_checkpoint(out: Path, **shape: Any) -> Path:
    """A random Llama of `shape` (LlamaConfig fields) in bf16, saved to `out`."""
    import transformers

    cfg = transformers.LlamaConfig(**shape)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(DT)
    model.save_pretrained(out, safe_serialization=True)
    return out


def teacher_forced(model: Any, vocab: int, steps: int = 24, page_size: int = 4) -> list[torch.Tensor]:
    """The same teacher-forced tokens through the model's paged cache: `steps` decode logits (4, V), then the
    logits (16, V) of a verify step of 4 new tokens per sequence."""
    runner = ModelRunner.create(model, num_pages=256, page_size=page_size)
    ss = [Sequence.new(i, torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(i)).tolist())
          for i, n in enumerate((3, 17, 40, 65))]
    runner.run(ss)
    out = []
    for step in range(steps):
        for i, s in enumerate(ss):
            s.token_ids.append((step * 31 + i * 7) % vocab)
        out.append(runner.run(ss).logits)
    for i, s in enumerate(ss):
        s.token_ids.extend([(i + j) % vocab for j in range(4)])
    out.append(runner.run(ss, logits="all").logits)
    return out


def agreement(ref: Any, seqs: list[list[int]], a_out: list[Any], b_out: list[Any]) -> tuple[int, int]:
    """(identical outputs, outputs that diverge where `ref`'s logits are a near-tie between the two tokens).

    bf16 kernels differ in summation order, so a divergence is accepted only at such a near-tie (random weights
    have many)."""
    agree = ties = 0
    for s, a, b in zip(seqs, a_out, b_out):
        i = next((j for j, (x, y) in enumerate(zip(a.output_ids, b.output_ids)) if x != y), None)
        if i is None:
            agree += 1
            continue
        ctx = s + a.output_ids[:i]
        logits = ref.compute_logits(prefill_hidden(ref, [ctx]).hidden[-1:])[0].float()
        gap = (logits[a.output_ids[i]] - logits[b.output_ids[i]]).abs().item()
        ties += gap <= TOL * logits.abs().max().item()
    return agree, ties


class Target:
    """A model under check: its folder, loaded in bf16 on CUDA with the torch and the FlashInfer backend (each on
    first use), three prompts of 7, 130 and 33 random tokens, and both backends' greedy answers to them."""

    GREEDY = SamplingParams(max_new_tokens=32, ignore_eos=True)

    def __init__(self, tag: str, path: Path) -> None:
        self.tag, self.path = tag, path
        self.generator = torch.Generator().manual_seed(0)  # the prompts, then the throughput group's batches

    @cached_property
    def torch_model(self) -> Any:
        return load_model(self.path, dtype=DT, device="cuda", backend="torch")

    @cached_property
    def flashinfer_model(self) -> Any:
        return load_model(self.path, dtype=DT, device="cuda", backend="flashinfer")

    @cached_property
    def vocab(self) -> int:
        return self.torch_model.args.vocab_size

    @cached_property
    def seqs(self) -> list[list[int]]:
        return [torch.randint(0, self.vocab, (n,), generator=self.generator).tolist() for n in (7, 130, 33)]

    @cached_property
    def greedy(self) -> tuple[list[Any], list[Any], int, int]:
        """(torch's answers, FlashInfer's, identical count, near-tie count): 32 greedy tokens per prompt."""
        gt = LLMEngine(self.torch_model, kv_cache_gb=1, cuda_graphs=False).generate(self.seqs, self.GREEDY)
        gf = LLMEngine(self.flashinfer_model, kv_cache_gb=1).generate(self.seqs, self.GREEDY)
        agree, ties = agreement(self.torch_model, self.seqs, gt, gf)
        return gt, gf, agree, ties
