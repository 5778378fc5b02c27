"""Training on real data (scikit-learn's digits): O1 and O2 reach O0's test accuracy within 1.5 points."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("sklearn")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples"))

import train_digits  # noqa: E402



@pytest.mark.slow
def test_o1_o2_match_o0_accuracy_on_digits():
    data = train_digits.load_digits()
    assert len(data[1]) == 1397 and len(data[3]) == 400
    base = train_digits.train("O0", None, data, epochs=6)
    assert base.accuracy >= 95.0  # a CNN that learned the task, so the comparison means something
    for api, level, dtype in [("gradscaler", "O1", torch.bfloat16), ("gradscaler", "O2", torch.float16),
                              ("apex", "O2", torch.bfloat16), ("apex", "O1", torch.float16)]:
        result = train_digits.train(level, dtype, data, epochs=6, api=api)
        assert abs(result.accuracy - base.accuracy) <= 1.5, (api, level, dtype, result, base)
        # fp16 scales (dynamically, 2**16 to start); bf16 needs no scaling: its scale stays 1, no skips.
        if dtype == torch.bfloat16:
            assert result.final_scale == 1.0 and result.skipped == 0
        else:
            assert result.final_scale >= 2.0**10
