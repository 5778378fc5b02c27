"""Logging: one ``amp_fx.passes.<pass>`` logger per pass with a DEBUG line after it, and AMP_FX_DEBUG_DIR dumps to bisect by pass."""

import logging

import torch

import amp_fx
import zoo
from amp_fx.ir.config import make_config
from amp_fx.converter.pipeline import AFTER_REPORT, build_pipeline


def _pass_names(level):
    """The passes convert() runs, in order: the level's pipeline, then those that run after the report."""
    pipeline = build_pipeline(make_config(level, dtype=torch.bfloat16), own_params=level in ("O2", "O3"))
    return [p.__name__ for p in [*pipeline, *AFTER_REPORT]]


def test_a_debug_line_after_every_pass_on_its_own_logger(caplog):
    model, _, _ = zoo.build("mlp")
    caplog.set_level(logging.DEBUG, logger="amp_fx")
    amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    after = [(r.name, r.getMessage()) for r in caplog.records if r.getMessage().startswith("after ")]
    names = _pass_names("O1")
    assert [name for name, _ in after] == [f"amp_fx.passes.{n}" for n in names]
    assert all(message.startswith(f"after {n}:") for (_, message), n in zip(after, names))
    # 6 weight casts, the input's and O1's fp32 output cast.
    assert "'casts_inserted': 8" in dict(after)["amp_fx.passes.insert_casts"]
    # Nothing below INFO reaches the "amp_fx" logger's parent unless asked: quiet by default.
    caplog.clear()
    caplog.set_level(logging.INFO, logger="amp_fx")
    amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    assert not [r for r in caplog.records if r.name.startswith("amp_fx")]


def test_debug_dir_holds_each_pass_before_and_after(tmp_path, monkeypatch):
    model, _, _ = zoo.build("mlp")
    dump = tmp_path / "dump"
    monkeypatch.setenv("AMP_FX_DEBUG_DIR", str(dump))
    converted = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    names = _pass_names("O1")
    files = sorted(p.name for p in dump.iterdir())
    assert files == sorted(f"{i:02d}_{n}_{stage}.py" for i, n in enumerate(names) for stage in ("before", "after"))
    code = {(i, stage): (dump / f"{i:02d}_{n}_{stage}.py").read_text() for i, n in enumerate(names) for stage in ("before", "after")}
    # A chain: each pass starts from what the previous one left, and the last one left the converted module.
    for i in range(1, len(names)):
        assert code[(i, "before")] == code[(i - 1, "after")]
    assert code[(len(names) - 1, "after")].strip() == converted.code.strip()
    # Bisecting: the casts appear exactly at insert_casts.
    at = names.index("insert_casts")
    assert "torch.bfloat16" not in code[(at, "before")] and code[(at, "after")].count(".to(torch.bfloat16)") == 6
    # Analyses change no code.
    assert code[(0, "before")] == code[(0, "after")]
