"""The front end: module scope recorded, leaf modules honoured, clear errors for untraceable models and bad input."""

import pytest
import torch
import torch.nn as nn

import amp_fx
from probes import captured_because
import zoo


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.fc(x))


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent Python control flow
            return x * 2
        return x


def test_untraceable_model_report_names_module_line_and_ways_out():
    _, message = captured_because(DataDependent(), "'gate'")
    assert "'gate'" in message
    assert "test_tracing_errors.py" in message and "if x.sum() > 0" in message
    assert "leaf_modules=" in message and "example_inputs=" in message and "backend='amp_fx'" in message


def test_leaf_modules_way_out_works():
    gm = amp_fx.convert(DataDependent(), "O1", leaf_modules=[Gate])
    x = torch.randn(2, 4)
    assert any(r.op.endswith("Gate") for r in gm.amp_report.nodes if r.op)
    by_name = amp_fx.convert(DataDependent(), "O1", leaf_modules=["gate"])
    assert by_name(x).shape == (2, 4)


def test_module_paths_and_source_lines_are_recorded():
    gm = amp_fx.convert(zoo.SDPABlock(), "O1")
    qkv = next(r for r in gm.amp_report.nodes if r.module == "qkv" and r.op == "linear")
    assert qkv.source and "zoo.py" in qkv.source and "self.qkv" in qkv.source


@pytest.mark.parametrize("kwargs, error, message", [
    ({"level": "O4"}, ValueError, "unknown level 'O4'"),
    ({"level": "O1", "dtype": torch.float32}, ValueError, "not a low-precision dtype"),
    ({"level": "O1", "dtype": "int8"}, ValueError, "not a low-precision dtype"),
    ({"level": "O1", "on_unknown_op": "ignore"}, ValueError, "on_unknown_op"),
    ({"level": "O1", "pad_gemm": "yes"}, ValueError, "pad_gemm"),
])
def test_bad_options_are_refused_with_the_fix(kwargs, error, message):
    with pytest.raises(error, match=message):
        amp_fx.convert(zoo.MLP(), **kwargs)


def test_non_module_and_meta_device_are_refused():
    with pytest.raises(TypeError, match="expects a torch.nn.Module"):
        amp_fx.convert(lambda x: x, "O1")
    with torch.device("meta"):
        meta_model = zoo.MLP()
    with pytest.raises(ValueError, match="meta device"):
        amp_fx.convert(meta_model, "O1")


def test_level_names_are_case_insensitive_and_strings_name_dtypes():
    gm = amp_fx.convert(zoo.MLP(), "o2", dtype="fp16")
    assert gm.amp_config.level == "O2" and gm.amp_config.dtype == torch.float16
