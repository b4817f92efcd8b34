"""Checks of this checkout on real hardware and beside real serving engines, each run from the checkout's root:

    gpu/                the GPU check, every group in one run: `bash launch/gpu_check.sh` (python -m checks.gpu)
    gpu_train_check.py  the GPU head-training recipe: `bash launch/gpu_train_check.sh`
    check_vllm.py       vLLM serving our exported heads beside our engine: `make check-vllm`
    check_vllm_serve.py     regeneration through `vllm serve` against our greedy answers: `make check-vllm-serve`
    check_vllm_capture.py   stage one captured inside vLLM against our precompute: `make check-vllm-capture`
    check_vllm_fleet.py     training straight from `vllm serve` (data.source=fleet): `make check-vllm-fleet`
    check_vllm_foreign.py   an EAGLE-3 head for a family our engine lacks, end to end: `make check-vllm-foreign`
    vllm_side.py        check_vllm's half that runs inside vLLM's own venv (vLLM and the standard library only)

The launchers (training on one node, several nodes, SLURM, and the GPU entries) are in launch/.
"""
