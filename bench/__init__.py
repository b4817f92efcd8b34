"""Benchmarks and experiments on this machine, each a module run from the checkout's root as `python -m bench.<name>`
(or through its `make` target); each prints one JSON object as its last line.

    engine           our engine against transformers: prefill, decode, verify cost       make bench-engine
    cpu_kernels      each native CPU kernel against the torch operators it replaces     make bench-kernels
    precompute       stage one against per-sample HF forwards and torch.save files      make bench-precompute
    train            training throughput and MFU of the mtp head                         make bench-train
    chain_attention  the chained training attention: diagonal against masked             make bench-chain
    block_attention  a block drafter's training attention against one dense masked SDPA  make bench-block
    attention_memory what the training attentions keep, backward's largest tensor   python -m bench.attention_memory
    head_train_step  one training step per token of each head type, against eagle3    make bench-head-train
    regenerate       batched greedy decoding against transformers' batched generate     make bench-regenerate
    spec             speculative decoding with a trained head against plain decoding    make bench-spec
    step             where a speculative step goes, part by part, against a decode step  make bench-step
    head_step        a chain head's engine step in one native call against op by op     make bench-head-step
    tau              τ of several trained heads on the same prompts, paired by request  make bench-tau
    remote           the regeneration client's own cost against a local mtp-serve       make bench-remote
    tree             a head's τ over the dynamic-tree grid beside its chains             make bench-tree
    tree_rules       EAGLE-2's choice of a tree's nodes against other rules              python -m bench.tree_rules
    memory_plan      GPU memory per rank and disk per million tokens                     make bench-memory
    train_memory     measured peak memory of mtp-train runs against the memory plan     make bench-train-memory
    scale            each stage's seconds to its first sample and peak RSS against N     make bench-scale
    ablation_norms   the RMSNorm-restored mtp head against eagle1                        make ablation
    curve/           τ of each head type against its training tokens (a package)         make curve

common.py holds what they share (paths, the parser, timing, the report, config composition, a small precompute
folder, a head run on held-out prompts); floor.c is the memory-read floor cpu_kernels compares its gemv with.
docs/benchmarks.md says what each measures and how to read it.
"""
