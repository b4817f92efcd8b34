"""checks/gpu/train_memory.py on CPU: the GPU check's training-memory group runs its plans and trainings end to end
on a tiny target (its pass band is the GPU's business; here each case must plan, train and report a peak), and the
bf16 attention comparison runs."""

from __future__ import annotations

import pytest

from checks.gpu.common import Checks
from checks.gpu.train_memory import attention_bf16, plan_against_run
from tests.conftest import make_chat_target

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
def test_plan_against_run_dry_run_on_cpu(tmp_path):
    target = make_chat_target(tmp_path / "target", num_layers=7)
    check = Checks()
    record = plan_against_run(check, target, tmp_path / "work", cases=(("eagle3", 64, False), ("dflash", 64, True)),
                              tol=100.0, device="cpu")
    assert check.failed == 0, check.results
    assert sorted(record) == ["dflash/64/ckpt", "eagle3/64/plain"]
    for row in record.values():
        assert row["measured_gib"] > 0.1 and row["planned_gib"] > 0.1, row


def test_attention_bf16_dry_run_on_cpu():
    check = Checks()
    attention_bf16(check, device="cpu", n=256, steps=2)
    assert check.failed == 0 and check.passed == 2, check.results
