"""Pictures of real model sizes: a 12-layer GPT-2 drawn as one box per transformer block, fitting 2000x2000 px.

Through ``amp_fx.draw``: the default groups a graph that would not fit into module blocks (each block's nodes,
decisions and casts summed, every node in exactly one box), the HTML page opens a block to its nodes, and the
options (``group=None`` / ``"module"`` / a depth, ``max_size``) do what they say.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest
import torch
import transformers

import amp_fx
from amp_fx.ir import meta

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def gpt12():
    config = transformers.GPT2Config(n_layer=12, n_embd=32, n_head=4, vocab_size=128, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    return amp_fx.convert(model, "O1", dtype=torch.bfloat16, example_kwarg_inputs={"input_ids": torch.randint(0, 128, (2, 16))})


def _size(svg_text):
    width, height = re.search(r'<svg [^>]*width="(\d+)" height="(\d+)"', svg_text).groups()
    return int(width), int(height)


def _boxes(svg_text):
    """id -> (class, y, texts) of every box (node or block) in a built-in SVG."""
    root = ET.fromstring(svg_text)
    return {g.get("id"): (g.get("class"), float(g.find(f"{SVG}rect").get("y")), [t.text for t in g.findall(f"{SVG}text")])
            for g in root.iter(f"{SVG}g")}


def test_a_12_layer_gpt_fits_2000_px_as_one_box_per_transformer_block(gpt12, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # the built-in layout, whatever the machine has
    nodes = list(gpt12.graph.nodes)
    assert len(nodes) > 700  # the picture this replaces: one box per node, tens of thousands of px tall
    ungrouped = open(amp_fx.draw(gpt12, str(tmp_path / "all.svg"), group=None)).read()
    assert _size(ungrouped)[1] > 20000 and len(_boxes(ungrouped)) == len(nodes)

    svg = open(amp_fx.draw(gpt12, str(tmp_path / "gpt.svg"))).read()
    width, height = _size(svg)
    assert width <= 2000 and height <= 2000
    boxes = _boxes(svg)
    blocks = {ident: box for ident, box in boxes.items() if box[0].startswith("block")}
    titles = [box[2][0] for box in blocks.values()]
    assert [t for t in titles if t.startswith("transformer.h.")] == [f"transformer.h.{i}" for i in range(12)]
    # Every node is in exactly one box: the block labels' node counts and the single nodes add up to the graph.
    counted = sum(int(box[2][1].split()[0]) for box in blocks.values()) + (len(boxes) - len(blocks))
    assert counted == len(nodes)
    # Each transformer block's casts are summed: its label counts the inserted casts of its module subtree.
    casts_in_h3 = sum(1 for n in nodes if meta.INSERTED.get(n) and meta.DECISION.get(n) == "cast"
                      and (meta.MODULE_PATH.get(n) or "").startswith("transformer.h.3."))
    h3 = next(box for box in blocks.values() if box[2][0] == "transformer.h.3")
    assert casts_in_h3 > 0 and h3[2][2].startswith(f"{casts_in_h3} casts")
    # The blocks follow the model, top to bottom.
    ys = [next(box for box in blocks.values() if box[2][0] == f"transformer.h.{i}")[1] for i in range(12)]
    assert ys == sorted(ys) and len(set(ys)) == 12


def test_the_html_page_opens_each_block_to_its_nodes(gpt12, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    page = open(amp_fx.draw(gpt12, str(tmp_path / "gpt.html"), summary=amp_fx.summary(gpt12))).read()
    overview = page[page.index("<svg"):page.index("</svg>") + 6]
    links = re.findall(r'<a href="#(block-\d+)-nodes">', overview)
    sections = dict(re.findall(r'<details id="(block-\d+)-nodes">(.*?)</details>', page, flags=re.S))
    assert links and set(links) == set(sections)
    h0 = next(ident for ident, body in sections.items() if "<summary>transformer.h.0 - " in body)
    inside = {n.name for n in gpt12.graph.nodes if (meta.MODULE_PATH.get(n) or "").startswith("transformer.h.0.")}
    drawn = set(_boxes(sections[h0][sections[h0].index("<svg"):]))
    assert inside <= drawn  # the section draws the block's own nodes, weights and casts included
    assert "openBlock" in page and "GEMM FLOPs" in page


def test_group_options_and_bad_values(gpt12, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    depth2 = _boxes(open(amp_fx.draw(gpt12, str(tmp_path / "d2.svg"), group=2)).read())
    assert "transformer.h" in [box[2][0] for box in depth2.values()]  # all twelve layers in one box
    small = amp_fx.convert(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)), "O1",
                           dtype=torch.bfloat16)
    assert not any(c.startswith("block") for c, _, _ in _boxes(open(amp_fx.draw(small, str(tmp_path / "s.svg"))).read()).values())
    grouped = _boxes(open(amp_fx.draw(small, str(tmp_path / "m.svg"), group="module")).read())
    assert {texts[0] for c, _, texts in grouped.values() if c.startswith("block")} == {"0", "2"}
    # A smaller bound groups a graph that fits 2000 px, down to what fits.
    tight = open(amp_fx.draw(gpt12, str(tmp_path / "t.svg"), max_size=(2000, 1000))).read()
    assert _size(tight)[1] <= 1000
    dot = open(amp_fx.draw(gpt12, str(tmp_path / "g.dot"))).read()
    assert '"block-' in dot and "transformer.h.11" in dot and dot.count(" -> ") < 60
    for bad in ({"group": "modules"}, {"group": 0}, {"group": True}, {"max_size": (2000,)}, {"max_size": (0, 10)}):
        with pytest.raises(amp_fx.AmpValueError, match="group must|max_size must"):
            amp_fx.draw(gpt12, str(tmp_path / "x.svg"), **bad)
