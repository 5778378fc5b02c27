"""The pass contract and its runner: kinds, requires / ensures, who runs the dtype analysis, and every graph change inside.

Each contract breach is made by a small pass declared here, run through the
public runner (``run_passes``, or a direct call of a declared pass), and the
error must name the pass.  The declared kinds are checked against
docs/design.md's table and each pass's docstring.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import amp_fx.ir.pass_manager as pass_manager
from amp_fx.converter.pipeline import AFTER_REPORT, build_pipeline, rewrite_graph
from amp_fx.ir import meta
from amp_fx.ir.analysis import analyse
from amp_fx.ir.config import make_config
from amp_fx.ir.pass_manager import PassContext, PassError, PassResult, amp_pass, run_passes, spec_of
from amp_fx.frontend.tracing import trace_model
from amp_fx.passes.analyse_dtypes import analyse_dtypes
from amp_fx.passes.assign_precision import assign_precision
from amp_fx.passes.propagate_meta import propagate_meta

ROOT = Path(__file__).resolve().parents[2]


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.fc(x))


def _traced(example: bool = True):
    x = torch.randn(2, 8)
    gm, route = trace_model(Small(), example_inputs=(x,) if example else None)
    ctx = PassContext(config=make_config("O1", dtype=torch.bfloat16), example_inputs=(x,) if example else None, route=route)
    return gm, ctx


def _painted(example: bool = True):
    gm, ctx = _traced(example)
    return run_passes(gm, ctx, [propagate_meta, assign_precision, analyse_dtypes]), ctx


def _node(gm: fx.GraphModule, op: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.meta.get(meta.OP) == op)


@pytest.fixture
def analyses(monkeypatch):
    """Counts the dtype analyses the runner runs (the passes here run none)."""
    calls = []

    def counting(gm, ctx=None, *args, **kwargs):
        calls.append(gm)
        return analyse(gm, ctx, *args, **kwargs)

    monkeypatch.setattr(pass_manager, "analyse", counting)
    return calls


# --------------------------------------------------------------------------
# What a pass reports is checked
# --------------------------------------------------------------------------
@amp_pass(kind="rewrite", requires=("meta",))
def adds_a_node_quietly(gm, ctx):
    relu = _node(gm, "relu")
    with gm.graph.inserting_after(relu):
        gm.graph.call_function(torch.neg, (relu,))
    return PassResult(gm, False)


@amp_pass(kind="rewrite", requires=("meta",))
def retargets_quietly(gm, ctx):
    _node(gm, "relu").target = torch.sigmoid
    return PassResult(gm, False)


def test_a_rewrite_that_lies_about_modified_is_caught_and_named():
    gm, ctx = _painted()
    with pytest.raises(PassError, match=r"'adds_a_node_quietly' reported modified=False, yet the graph has \d+ nodes"):
        run_passes(gm, ctx, [adds_a_node_quietly])


def test_a_lie_the_node_count_cannot_see_is_caught_when_verifying():
    gm, ctx = _painted()
    ctx.verify = True
    with pytest.raises(PassError, match=r"'retargets_quietly' reported modified=False, yet node 'relu'"):
        retargets_quietly(gm, ctx)  # a declared pass called directly runs under the same contract


@amp_pass(kind="analysis")
def analysis_that_adds_a_node(gm, ctx):
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        gm.graph.call_function(torch.neg, (output.args[0],))
    return PassResult(gm, False)


@amp_pass(kind="analysis")
def analysis_that_says_it_changed(gm, ctx):
    return PassResult(gm, True)


def test_an_analysis_that_changes_the_graph_is_caught():
    gm, ctx = _painted()
    with pytest.raises(PassError, match=r"'analysis_that_adds_a_node' is an analysis, yet the graph has"):
        run_passes(gm, ctx, [analysis_that_adds_a_node])
    gm, ctx = _painted()
    with pytest.raises(PassError, match=r"'analysis_that_says_it_changed' is an analysis but reported modified=True"):
        run_passes(gm, ctx, [analysis_that_says_it_changed])


@amp_pass(kind="repaint", requires=("paint",))
def repaints_quietly(gm, ctx):
    meta.DECISION.set(_node(gm, "relu"), "fp32")
    return PassResult(gm, False)


def test_a_repaint_that_hides_its_change_is_caught_when_verifying():
    gm, ctx = _painted()
    ctx.verify = True
    with pytest.raises(PassError, match=r"'repaints_quietly' reported no change, yet node 'relu' was repainted"):
        run_passes(gm, ctx, [repaints_quietly])


# --------------------------------------------------------------------------
# Requires and ensures
# --------------------------------------------------------------------------
def test_a_pass_missing_a_required_property_is_refused_with_its_name():
    gm, ctx = _traced()
    with pytest.raises(PassError, match=r"'assign_precision' requires 'meta'.*Run propagate_meta first"):
        run_passes(gm, ctx, [assign_precision])
    with pytest.raises(PassError, match=r"'assign_precision' requires 'meta'"):
        assign_precision(gm, ctx)  # called directly: the same refusal
    assert not any(meta.DECISION.on(n) for n in gm.graph.nodes)  # refused before it ran


@amp_pass(kind="analysis", ensures=("paint",))
def forgets_its_paint(gm, ctx):
    return PassResult(gm, False)


def test_a_pass_that_does_not_ensure_what_it_declares_is_caught():
    gm, ctx = _traced()
    with pytest.raises(PassError, match=r"'forgets_its_paint' ensures 'paint'.*node 'x' lacks it"):
        run_passes(gm, ctx, [propagate_meta, forgets_its_paint])


def test_an_undeclared_pass_and_a_failing_pass_are_named():
    def plain(gm, ctx):
        return PassResult(gm, False)

    @amp_pass(kind="analysis")
    def boom(gm, ctx):
        raise ValueError("no such thing")

    gm, ctx = _painted()
    with pytest.raises(PassError, match=r"'plain' declares no contract: declare it with @amp_pass"):
        run_passes(gm, ctx, [plain])
    with pytest.raises(PassError, match=r"amp_fx pass 'boom' failed: ValueError: no such thing"):
        run_passes(gm, ctx, [boom])


def test_a_spec_names_only_known_kinds_and_properties():
    with pytest.raises(ValueError, match="pass kind 'transform'"):
        amp_pass(kind="transform")
    with pytest.raises(ValueError, match=r"unknown pass properties \['shapes'\]"):
        amp_pass(kind="rewrite", requires=("shapes",))


# --------------------------------------------------------------------------
# The runner owns the dtype analysis
# --------------------------------------------------------------------------
@amp_pass(kind="analysis", requires=("dtypes",))
def notes_dtypes(gm, ctx):
    """Writes only a key of its own: what the stored analysis says of the relu's input."""
    relu = _node(gm, "relu")
    relu.meta["noted dtype"] = meta.float_dtype(relu.args[0])
    return PassResult(gm, False)


@amp_pass(kind="rewrite", requires=("meta", "dtypes"), ensures=("dtypes",))
def widens_before_relu(gm, ctx):
    """Feeds the relu a float64 copy of its input: the rewritten graph's dtypes differ."""
    relu = _node(gm, "relu")
    with gm.graph.inserting_before(relu):
        wide = gm.graph.call_method("to", (relu.args[0], torch.float64))
    wide.meta.update({meta.OP: "to", meta.DECISION: "cast", meta.REASON: "test"})
    relu.args = (wide,)
    return PassResult(gm, True)


def test_the_runner_recomputes_dtypes_after_a_rewrite_and_not_after_an_analysis(analyses):
    gm, ctx = _traced()
    gm = run_passes(gm, ctx, [propagate_meta, assign_precision, analyse_dtypes, notes_dtypes])
    assert len(analyses) == 1  # before analyse_dtypes, which requires it; none after the analysis notes_dtypes
    relu = _node(gm, "relu")
    assert relu.meta["noted dtype"] == torch.bfloat16  # the linear runs low
    first = ctx.analysis
    gm = run_passes(gm, ctx, [widens_before_relu, notes_dtypes])
    assert len(analyses) == 2 and ctx.analysis is not first  # once, after the rewrite that ensures it
    assert relu.meta["noted dtype"] == torch.float64  # the later pass saw the rewritten graph's dtypes
    assert meta.float_dtype(relu) == torch.float64 and meta.value_of(relu) is ctx.analysis.values[relu]


@amp_pass(kind="repaint", requires=("paint", "dtypes"), ensures=("dtypes",))
def repaints_relu_with_its_analysis(gm, ctx):
    relu = _node(gm, "relu")
    meta.DECISION.set(relu, "fp32")
    return PassResult(gm, True, analysis=analyse(gm, ctx))  # of the final paint: the runner stores it


@amp_pass(kind="repaint", requires=("paint", "dtypes"), ensures=("dtypes",))
def repaints_relu_with_a_stale_analysis(gm, ctx):
    stale = analyse(gm, ctx)
    meta.DECISION.set(_node(gm, "relu"), "fp32")
    return PassResult(gm, True, analysis=stale)  # of the paint before: the runner analyses again


def test_the_runner_stores_a_passs_analysis_only_when_it_is_of_the_final_paint(analyses):
    gm, ctx = _painted()
    gm = run_passes(gm, ctx, [repaints_relu_with_its_analysis])
    assert len(analyses) == 1  # analyse_dtypes' only: the offered analysis was stored, not recomputed
    assert ctx.analysis.decisions[_node(gm, "relu")] == "fp32"
    gm, ctx = _painted()
    gm = run_passes(gm, ctx, [repaints_relu_with_a_stale_analysis])
    assert len(analyses) == 3  # the stale offer was refused: analysed again
    assert ctx.analysis.decisions[_node(gm, "relu")] == "fp32"
    assert meta.float_dtype(_node(gm, "relu")) == torch.float32


def test_analyse_is_pure_and_the_runner_stores():
    gm, ctx = _traced()
    run_passes(gm, ctx, [propagate_meta, assign_precision])
    answer = analyse(gm, ctx)
    assert answer.values and ctx.analysis is None
    assert all(meta.value_of(n) is None for n in gm.graph.nodes)  # nothing written on the nodes
    run_passes(gm, ctx, [analyse_dtypes])
    assert ctx.analysis is not None and all(meta.value_of(n) is not None for n in gm.graph.nodes)


# --------------------------------------------------------------------------
# Every graph change inside the runner: checkpoint regions too
# --------------------------------------------------------------------------
class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.GELU())

    def forward(self, x):
        return checkpoint(self.block, self.inp(x), use_reentrant=False)


def test_checkpoint_regions_are_outlined_by_a_pass_after_the_report_is_read():
    x = torch.randn(2, 8)
    gm, route = trace_model(Checkpointed(), example_inputs=(x,))
    ctx = PassContext(config=make_config("O1", dtype=torch.bfloat16), example_inputs=(x,), route=route)
    inline = {n.name for n in gm.graph.nodes if meta.CHECKPOINT.get(n) is not None and n.op.startswith("call")}
    gm, report = rewrite_graph(gm, ctx, own_params=False)
    stats = ctx.stats["outline_checkpoints"]
    assert stats["regions"] == 1 and stats["modified"]
    assert "outline_checkpoints" not in report.passes  # the report's table is the pipeline's, read before outlining
    names = {r.name for r in report.nodes}
    assert inline and inline <= names and not inline & {n.name for n in gm.graph.nodes}  # listed inline, now outlined
    assert any(n.op == "call_module" and meta.OP.get(n) == "checkpoint" for n in gm.graph.nodes)
    assert any(note.startswith("checkpointed region kept") for note in report.notes)


# --------------------------------------------------------------------------
# The declared kinds are what the docs say
# --------------------------------------------------------------------------
def _every_pass() -> list:
    configs = [make_config(level, dtype=torch.bfloat16, pad_gemm=True, cache_casts=True) for level in ("O0", "O1", "O2")]
    found = {}
    for config in configs:
        for own in (True, False):
            for p in [*build_pipeline(config, own_params=own), *AFTER_REPORT]:
                found[p.__name__] = p
    return list(found.values())


def test_every_pass_declares_its_contract():
    passes = _every_pass()
    # Every module in passes/ holds a pass that some pipeline runs (none is forgotten by build_pipeline).
    files = {path.stem for path in (ROOT / "passes").glob("*.py")} - {"__init__"}
    assert files <= {p.__module__.rsplit(".", 1)[-1] for p in passes}, files
    assert all(spec_of(p) is not None for p in passes), [p.__name__ for p in passes if spec_of(p) is None]


def _design_kinds() -> dict[str, str]:
    text = (ROOT / "docs" / "design.md").read_text()
    kinds = {}
    for line in text.splitlines():
        match = re.match(r"\|\s*(`[a-z0-9_]+`(?:,\s*`[a-z0-9_]+`)*)\s*\|\s*(analysis|repaint|rewrite)\s*\|", line)
        if match:
            for name in re.findall(r"`([a-z0-9_]+)`", match.group(1)):
                kinds[name] = match.group(2)
    return kinds


def test_design_table_and_pass_docstrings_give_each_pass_its_declared_kind():
    kinds = _design_kinds()
    for p in _every_pass():
        kind = spec_of(p).kind
        assert kinds.get(p.__name__) == kind, f"docs/design.md: {p.__name__} is a {kind}"
        doc = importlib.import_module(p.__module__).__doc__
        assert doc.split(":")[0].strip().lower() == kind, f"{p.__module__}'s docstring should start with {kind.title()}:"


def _design_rows() -> dict[str, tuple[set, set, set]]:
    """docs/design.md's pass table: name -> (requires, ensures, invalidates)."""
    rows = {}
    for line in (ROOT / "docs" / "design.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 4 or cells[1] not in ("analysis", "repaint", "rewrite"):
            continue
        said = {"ensures": set(), "invalidates": set()}
        for part in filter(None, (p.strip() for p in cells[3].split(";"))):
            verb, _, props = part.partition(" ")
            said[verb] = {p.strip() for p in props.split(",")}
        for name in re.findall(r"`([a-z0-9_]+)`", cells[0]):
            rows[name] = ({p.strip() for p in cells[2].split(",") if p.strip()}, said["ensures"], said["invalidates"])
    return rows


def test_design_table_gives_each_pass_its_declared_requires_ensures_and_invalidates():
    rows = _design_rows()
    for p in _every_pass():
        spec = spec_of(p)
        declared = (set(spec.requires), set(spec.ensures), set(spec.invalidates))
        assert rows.get(p.__name__) == declared, f"docs/design.md's row for {p.__name__} should say {declared}"


def _pipeline_order() -> list[str]:
    """Every pass of every level's pipeline, and AFTER_REPORT's, in the one order they all keep."""
    import graphlib

    sorter = graphlib.TopologicalSorter()
    for level in ("O0", "O1", "O2", "O3"):
        for own in (True, False):
            config = make_config(level, dtype=torch.bfloat16, pad_gemm=True, cache_casts=True)
            names = [p.__name__ for p in [*build_pipeline(config, own_params=own), *AFTER_REPORT]]
            for before, after in zip(names, names[1:]):
                sorter.add(after, before)
    return list(sorter.static_order())


def _map_order() -> list[str]:
    """The pass names of docs/design.md's map picture, read column by column, top to bottom."""
    text = (ROOT / "docs" / "design.md").read_text()
    picture = text.split("## The map", 1)[1].split("```", 2)[1].splitlines()[1:]
    rows = picture[1:]  # under the header, one column of text per stage
    starts = [m.start() for m in re.finditer(r"(?<!\S)(?<=\s\s)\S", rows[0])]  # where each column's text begins
    assert len(starts) == 4, rows[0]
    found = []
    for row, line in enumerate(rows):
        for match in re.finditer(r"[a-z0-9]+(?:_[a-z0-9]+)+", line):
            column = max(i for i, start in enumerate(starts) if start <= match.start())
            found.append((column, row, match.start(), match.group()))
    return [name for *_, name in sorted(found)]


def test_the_design_map_draws_every_pass_in_pipeline_order():
    """docs/design.md's map picture names each pass of the pipeline, in its order, and nothing else (issue 43)."""
    order = _pipeline_order()
    assert len(order) == 17 and {"share_cast_grads", "outline_checkpoints", "cast_params", "minimize_casts"} <= set(order)
    drawn = _map_order()
    assert drawn == order, f"docs/design.md's map: draw {sorted(set(order) - set(drawn))}, " \
                           f"drop {sorted(set(drawn) - set(order))}, in the order {order}"
