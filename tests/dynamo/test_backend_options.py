"""A misspelt backend option is refused with every valid option named, the backend's own ones included."""

import pytest
import torch

import amp_fx
import zoo


def _message(error: pytest.ExceptionInfo) -> str:
    return str(error.value)


def test_misspelt_option_lists_every_valid_option():
    with pytest.raises(TypeError) as error:
        amp_fx.backend(levle="O1", inner="aot_eager")
    message = _message(error)
    assert "'levle'" in message and "Did you mean 'level'?" in message
    for name in ("level", "inner", "policy", "dtype", "pad_gemm", "keep_batchnorm_fp32", "cast_model_outputs"):
        assert f"'{name}'" in message.split("Valid options are", 1)[1]


def test_misspelt_option_through_torch_compile_options():
    model, example, _ = zoo.build("mlp")
    with pytest.raises(Exception, match=r"unknown conversion option.*'levle'.*Valid options are") as error:
        torch.compile(model, backend="amp_fx", options={"levle": "O1", "inner": "aot_eager"})(*example)
    assert all(f"'{name}'" in _message(error) for name in ("level", "inner", "policy"))


def test_known_options_are_accepted():
    be = amp_fx.backend(level="O1", inner="aot_eager", policy={"op:softmax": "fp32"}, keep_batchnorm_fp32=False)
    assert be.config.keep_batchnorm_fp32 is False and be.inner_name == "aot_eager"
