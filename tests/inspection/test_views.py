"""Views of a conversion: diff, networkx graph, drawing and summary, on a small graph whose numbers are known."""

import os
import re
import stat
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.nn as nn

import amp_fx
from amp_fx.ir import tables
from amp_fx.inspection.draw import COLOURS, dot_source

SVG = "{http://www.w3.org/2000/svg}"


class LinearNorm(nn.Module):
    """fc (Linear 4->3, runs low) then norm (LayerNorm, runs fp32): casts whose bytes are counted by hand below."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.norm = nn.LayerNorm(3)

    def forward(self, x):
        return self.norm(self.fc(x))


@pytest.fixture
def known():
    model = LinearNorm()
    x = torch.randn(2, 4)
    converted = amp_fx.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,))
    return model, x, converted


# Cast bytes by hand (numel x (source bytes + target bytes)):
#   x (2,4) fp32->bf16 48, fc.weight (3,4) 72, fc.bias (3,) 18, fc output (2,3) bf16->fp32 36.
HAND_CAST_BYTES = {"x": 48, "fc_weight": 72, "fc_bias": 18, "linear": 36}


def test_to_networkx_carries_node_attributes_and_cast_bytes(known):
    model, x, converted = known
    graph = amp_fx.to_networkx(converted)
    assert set(graph.nodes) == {n.name for n in converted.graph.nodes}
    linear, norm = graph.nodes["linear"], graph.nodes["layer_norm"]
    assert (linear["op"], linear["module"], linear["decision"], linear["shape"]) == ("linear", "fc", "low", (2, 3))
    assert (norm["op"], norm["module"], norm["decision"], norm["shape"]) == ("layer_norm", "norm", "fp32", (2, 3))
    # linear's dtype is what torch.autocast gives; layer_norm is on the CUDA fp32 list (CPU autocast differs).
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_linear = model.fc(x)
    assert linear["dtype"] == str(ref_linear.dtype).replace("torch.", "") == "bfloat16"
    assert norm["dtype"] == "float32" and tables.table_of("layer_norm") == "fp32"
    # Every cast's bytes sit on its one incoming edge; other edges carry 0.
    into_casts = {u: d["cast_bytes"] for u, v, d in graph.edges(data=True) if graph.nodes[v]["inserted"]}
    assert into_casts == HAND_CAST_BYTES
    assert all(d["cast_bytes"] == 0 for u, v, d in graph.edges(data=True) if not graph.nodes[v]["inserted"])
    assert sum(d["cast_bytes"] for *_, d in graph.edges(data=True)) == sum(HAND_CAST_BYTES.values()) == converted.amp_report.cast_bytes


def test_diff_marks_exactly_the_inserted_casts(known):
    model, _, converted = known
    text = amp_fx.diff(model, converted)
    marked = [line for line in text.splitlines() if "# <- amp_fx" in line]
    assert all(line.startswith("+") for line in marked)
    names = {re.match(r"\+\s*(\w+) =", line).group(1) for line in marked}
    assert names == {n.name for n in converted.graph.nodes if n.meta.get("amp_fx.inserted")}
    assert len(marked) == 4
    assert any("weight cast: fc_weight float32 -> bfloat16, 72 B" in line for line in marked)
    # The original call is removed and the rewritten one added; fx's "= None" tails are gone.
    assert any(line.startswith("-") and "linear(x, fc_weight, fc_bias)" in line for line in text.splitlines())
    assert "= None" not in text
    # A GraphModule works as the "before" too, and gives the same diff.
    from amp_fx.frontend.tracing import trace_model

    assert amp_fx.diff(trace_model(model)[0], converted).splitlines()[2:] == text.splitlines()[2:]


def test_summary_counts_flops_casts_params_and_activations():
    class TwoLinear(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 8)
            self.b = nn.Linear(8, 2)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    model, x = TwoLinear(), torch.randn(3, 4)
    # b pinned fp32: a does 2*3*4*8 = 192 FLOPs low, b 2*3*8*2 = 96 in fp32.
    converted = amp_fx.convert(model, "O1", dtype=torch.bfloat16, example_inputs=(x,), policy={"module:b": "fp32"})
    s = amp_fx.summary(converted)
    assert s.gemm_flops == {"bfloat16": 192, "float32": 96}
    assert s.low_flop_share == pytest.approx(192 / 288)
    assert (s.casts, s.weight_casts) == (4, 2)  # x, a.weight, a.bias to bf16; relu output back to fp32
    assert s.cast_bytes == 12 * 6 + 32 * 6 + 8 * 6 + 24 * 6 == converted.amp_report.cast_bytes
    assert s.params == {"float32": {"tensors": 4, "elements": 32 + 8 + 16 + 2, "bytes": 4 * 58}}
    # Values made per forward: bf16 casts 12+32+8, linear 24, relu 24 elements; fp32 cast 24 + linear 6.
    assert s.activations == {"bfloat16": 2 * (12 + 32 + 8 + 24 + 24), "float32": 4 * (24 + 6)}
    text = str(s)
    assert "66.7% of 288 FLOP in low precision" in text and "casts per forward: 4 (2 of weights), 456 B" in text


def test_summary_without_shapes_says_unknown_and_o2_counts_low_params():
    model = LinearNorm()
    converted = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    s = amp_fx.summary(converted)
    assert s.low_flop_share is None and s.cast_bytes is None and "unknown (needs shapes" in str(s)
    # Shapes can come late, from the summary's own example inputs.
    assert amp_fx.summary(converted, (torch.randn(2, 4),)).gemm_flops == {"bfloat16": 2 * 2 * 4 * 3}
    o2 = amp_fx.convert(model, "O2", dtype=torch.bfloat16)
    s2 = amp_fx.summary(o2)
    assert s2.params["bfloat16"]["bytes"] == 2 * 15 and s2.params["float32"]["bytes"] == 4 * 6  # LayerNorm kept fp32
    assert s2.master_bytes == 4 * 21
    # A report alone (what the compiler backend keeps) gives the counts.
    assert amp_fx.summary(converted.amp_report).casts == converted.amp_report.totals()["casts_inserted"]


def _boxes(svg_text):
    root = ET.fromstring(svg_text)
    boxes = {}
    for group in root.iter(f"{SVG}g"):
        rect = group.find(f"{SVG}rect")
        texts = [t.text for t in group.findall(f"{SVG}text")]
        boxes[group.get("id")] = (group.get("class").split()[1], rect.get("fill"), float(rect.get("y")), texts)
    return root, boxes


def test_builtin_svg_colours_labels_and_layers(known, tmp_path, monkeypatch):
    _, _, converted = known
    monkeypatch.setenv("PATH", str(tmp_path))  # no Graphviz here, whatever the machine has
    path = amp_fx.draw(converted, str(tmp_path / "graph.svg"))
    root, boxes = _boxes(open(path).read())
    assert set(boxes) == {n.name for n in converted.graph.nodes}
    assert boxes["linear"][:2] == ("low", COLOURS["low"][0])
    assert boxes["layer_norm"][:2] == ("fp32", COLOURS["fp32"][0])
    casts = {n.name for n in converted.graph.nodes if n.meta.get("amp_fx.inserted")}
    assert {name for name, box in boxes.items() if box[0] == "cast"} == casts
    assert "fc" in boxes["linear"][3] and "norm" in boxes["layer_norm"][3]
    for node in converted.graph.nodes:  # every edge points down the page
        for source in node.all_input_nodes:
            assert boxes[source.name][2] < boxes[node.name][2]
    html_path = amp_fx.draw(converted, str(tmp_path / "graph.html"), summary=amp_fx.summary(converted))
    page = open(html_path).read()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "GEMM FLOPs" in page
    with pytest.raises(RuntimeError, match="Graphviz"):
        amp_fx.draw(converted, str(tmp_path / "g.svg"), engine="graphviz")


def test_graphviz_path_feeds_dot_source_to_dot(known, tmp_path, monkeypatch):
    _, _, converted = known
    source = dot_source(converted)
    assert 'subgraph "cluster_fc"' in source and 'subgraph "cluster_norm"' in source
    assert '"x" -> "to" [label="48 B"]' in source
    assert f'"linear" [label="linear: linear\\nfc\\nbfloat16 2x3", fillcolor="{COLOURS["low"][0]}"' in source
    # A fake `dot` on PATH: records what it was fed and answers with an SVG.
    fake = tmp_path / "bin" / "dot"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\ncat > "{tmp_path}/fed.dot"\necho \'<?xml version="1.0"?>\'\necho \'<svg id="from-dot"></svg>\'\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    out = amp_fx.draw(converted, str(tmp_path / "g.svg"))
    assert open(out).read().strip() == '<svg id="from-dot"></svg>'
    assert (tmp_path / "fed.dot").read_text() == source
    assert "from-dot" not in open(amp_fx.draw(converted, str(tmp_path / "b.svg"), engine="builtin")).read()
    assert open(amp_fx.draw(converted, str(tmp_path / "g.dot"))).read() == source
