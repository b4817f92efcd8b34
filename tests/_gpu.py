"""Skip marks for tests that need CUDA and FlashInfer (they run on GPU machines, e.g. through launch/gpu_check)."""

from __future__ import annotations

import importlib

import pytest
import torch


def flashinfer_on_cuda(module: str = "flashinfer") -> bool:
    """True when CUDA is present and `module` (flashinfer or a submodule) imports."""
    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module(module)
    except Exception:  # a broken install (missing CUDA libraries, JIT failures) counts as absent
        return False
    return True


def needs_flashinfer(module: str = "flashinfer") -> pytest.MarkDecorator:
    return pytest.mark.skipif(not flashinfer_on_cuda(module), reason="needs CUDA and flashinfer")
