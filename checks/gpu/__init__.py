"""The GPU check: FlashInfer against the torch attention backend, our engine's features on CUDA, and tokens/s.

One entry runs every group: `bash launch/gpu_check.sh` on a CUDA machine (it makes FlashInfer importable, then runs
`python -m checks.gpu [--model models/smollm2-135m-instruct]`). Each check prints PASS/FAIL with its measured error;
the last line is {"passed": N, "failed": M} and the exit code is 1 when any check failed. A group that crashes is
reported as a failed check and the next group runs. The groups, one module each:

  per model (a small random Llama, then SmolLM2: the converted folder when present, else a random model of its
  exact shape), all in bf16:
    backends.py         packed prefill, paged decode, verify and greedy generation: FlashInfer = torch; our model
                        (FlashInfer) = transformers
    speculative.py      speculative decoding (self-draft, an untrained mtp head, a width-4 tree) = plain greedy;
                        fused chain sampling runs
    cuda_graphs.py      CUDA graphs leave greedy and speculative output unchanged; batch-1 decode tokens/s with and
                        without them (goal on SmolLM2: >= 520)
    throughput.py       prefill and decode tokens/s of both backends (printed)
  once:
    deepseek.py         DeepSeek-V2 (MLA over the latent-only paged cache, MoE) at FlashInfer's MLA widths
    tree_mask.py        claim (c): verify time by rows 1-64 with the tree mask against a chain (tree_cost.py times it)
    chain_attention.py  the heads' chained training attention, diagonal against masked, in bf16
    train_memory.py     the memory plan against real mtp-train runs (eagle3, dflash; 4k, 8k; activation
                        checkpointing on and off); the chain and block training attentions against their references
    train_step.py       a block drafter's position-grouped token loss = the per-step path (fp32, bf16; both ce_impl);
                        mtp-train recipe=speculators-eagle3 (Muon, ZeRO 0, bf16) runs, its draft lm_head stays frozen
    tensor_parallel.py  with two or more GPUs: tp=2 over NCCL (tp_worker.py is each rank) = one GPU

common.py holds the PASS/FAIL record (`Checks`), the tolerance, a random checkpoint, teacher-forced logits, the
near-tie rule of two greedy runs and `Target`, one model under check loaded once per backend.
"""
