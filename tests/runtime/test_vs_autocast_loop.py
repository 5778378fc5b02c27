"""The README's O1 loop against torch.autocast + GradScaler, side by side (examples/train_vs_autocast.py)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples"))

import train_vs_autocast  # noqa: E402

CASES = [(task, dtype) for task in ("digits", "char_lm") for dtype in (torch.float16, torch.bfloat16)]
IDS = [f"{task}-{str(dtype)[6:]}" for task, dtype in CASES]


@pytest.mark.parametrize("task,dtype", CASES, ids=IDS)
def test_final_loss_within_one_percent_of_autocast_after_40_steps(task, dtype):
    row = train_vs_autocast.compare(task, dtype, steps=40)
    assert row["autocast"] < 0.8 * row["first"]  # both really trained
    assert row["rel_diff"] <= 0.01, row


@pytest.mark.slow
def test_final_loss_within_one_percent_of_autocast_after_200_steps():
    for task, dtype in CASES:
        row = train_vs_autocast.compare(task, dtype, steps=200)
        assert row["autocast"] < 0.1 * row["first"]
        assert row["rel_diff"] <= 0.01, row
