"""checks/gpu/train_step.py on CPU: the GPU check's training-step group runs end to end on a tiny target (the
grouped loss against the per-step path in float32, and `recipe=speculators-eagle3` with Muon for a few steps), so
the prepared CUDA check is known to run before a GPU ever does."""

from __future__ import annotations

import pytest
import torch

from checks.gpu.common import Checks
from checks.gpu.train_step import grouped_loss_check, muon_recipe_check
from tests.conftest import make_chat_target

pytestmark = pytest.mark.usefixtures("one_thread")


def test_grouped_loss_check_dry_run_on_cpu(tmp_path):
    target = make_chat_target(tmp_path / "target", num_layers=7)
    check = Checks()
    grouped_loss_check(check, target, device="cpu", rows=96, dtypes=(torch.float32,))
    assert check.failed == 0 and check.passed == 4, check.results


@pytest.mark.slow
def test_muon_recipe_check_dry_run_on_cpu(tmp_path):
    target = make_chat_target(tmp_path / "target", num_layers=7)
    check = Checks()
    muon_recipe_check(check, target, tmp_path / "work", device="cpu", length=64, steps=3)
    assert check.failed == 0 and check.passed == 2, check.results
