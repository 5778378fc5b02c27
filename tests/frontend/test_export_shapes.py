"""The export route's shape notes tell the truth: dynamic from the range constraints, fixed with the line that fixed it.

The model loops over its sequence length in Python, as transformers' CPU
Mamba scan does (``for index in range(seq_len)``): symbolic tracing fails
on it (the export route is taken), and torch.export specialises the length
to the example's.  Issue 26, item 4.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.nn as nn

import amp_fx
from amp_fx.errors import AmpValueError


class Scan(nn.Module):
    """A running state over the sequence, by a Python loop: the length is fixed; the batch stays dynamic."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, input_ids):
        h = self.proj(self.embed(input_ids))
        state = torch.zeros_like(h[:, 0])
        outputs = []
        for index in range(h.shape[1]):  # the line that fixes the length
            state = 0.5 * state + h[:, index]
            outputs.append(state)
        flat = torch.stack(outputs, 1).reshape(h.shape[0], -1, 8)  # reads the (dynamic) batch size
        return self.head(flat)


LOOP_LINE = next(i for i, line in enumerate(inspect.getsourcelines(Scan.forward)[0], inspect.getsourcelines(Scan.forward)[1])
                 if "the line that fixes the length" in line)


def _ids(size: int, length: int) -> torch.Tensor:
    return torch.randint(0, 16, (size, length), generator=torch.Generator().manual_seed(size * 100 + length))


@pytest.fixture(scope="module")
def converted():
    torch.manual_seed(0)
    model = Scan()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, example_kwarg_inputs={"input_ids": _ids(2, 6)})
    return model, gm, [str(w.message) for w in caught]


def test_the_notes_list_what_the_range_constraints_keep_dynamic(converted):
    """The batch is dynamic (its range constraint, [2, inf]); the length is not listed as dynamic."""
    _, gm, _ = converted
    notes = gm.amp_report.notes
    assert "torch.export: dynamic dimensions (?) in input_ids[?, 6]" in notes, notes
    assert "torch.export: range constraints input_ids.shape[0] in [2, inf]" in notes, notes


def test_a_fixed_length_is_named_with_the_line_that_fixed_it(converted):
    """The warning and the report say input_ids.shape[1] == 6 is fixed, and where: this file's loop line."""
    _, gm, warned = converted
    where = f"test_export_shapes.py:{LOOP_LINE} in forward"
    message = next(m for m in warned if m.startswith("torch.export kept input_ids.shape[1] == 6 static"))
    assert where in message and "for index in range(h.shape[1])" in message, message
    assert message in gm.amp_report.notes


def test_another_length_raises_naming_input_dimension_size_and_line(converted):
    """A call with length 7: AmpValueError naming input_ids.shape[1], the example's 6, and the loop line."""
    model, gm, _ = converted
    with pytest.raises(AmpValueError) as caught:
        gm(input_ids=_ids(3, 7))
    message = str(caught.value)
    assert message.startswith("input_ids.shape[1] is 7, but the converted module only accepts 6 there"), message
    assert f"the model fixes that size at " in message and f"test_export_shapes.py:{LOOP_LINE}" in message
    # another batch is fine, and agrees with autocast (the same bf16 GEMMs on the same inputs; fp32 elsewhere)
    ids = _ids(3, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(ids)
    torch.testing.assert_close(gm(input_ids=ids), expected.float(), rtol=1.6e-2, atol=1e-3)  # 2 bf16 ulps


def test_shape_queries_are_not_unknown_ops(converted):
    """sym_size (export's read of the dynamic batch) is a shape query, not an op nobody decided."""
    _, gm, _ = converted
    ops = {r.op for r in gm.amp_report.nodes}
    assert "sym_size" in ops  # the reshape reads the batch size: the case is there
    assert "sym_size" not in gm.amp_report.unknown_ops, gm.amp_report.unknown_ops
