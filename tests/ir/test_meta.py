"""amp_fx.ir.meta: one record per value (the flat facts read it), one inheritance rule for new nodes."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

import amp_fx
from amp_fx.ir import meta
from amp_fx.ir.cast_nodes import CastBuilder, is_inserted_cast
from amp_fx.passes.analyse_dtypes import analyse_dtypes
from amp_fx.passes.propagate_meta import propagate_meta
from pass_check import prepare


class _Shapes(fx.Interpreter):
    """Runs the graph and records the shape of every tensor each node really makes."""

    def __init__(self, gm):
        super().__init__(gm)
        self.shapes = {}

    def run_node(self, node):
        result = super().run_node(node)
        if isinstance(result, torch.Tensor):
            self.shapes[node] = tuple(result.shape)
        return result


class Affine(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)

    def forward(self, x):
        return self.fc(x).relu()


class Batched(nn.Module):
    def forward(self, a, b):
        return torch.bmm(a, b) * 2


def _recorded_and_real(gm, inputs):
    recorder = _Shapes(gm)
    with torch.no_grad():
        recorder.run(*inputs)
    return {n.name: (meta.shape(n), recorder.shapes[n]) for n in gm.graph.nodes if n in recorder.shapes}


def test_a_padded_gemm_records_the_shape_the_padded_graph_makes():
    """pad_gemm grows a GEMM's N (27 -> 32) and its operands' K: each rewritten node's one record says so."""
    example = (torch.randn(2, 5, 13),)
    gm = amp_fx.convert(Affine(13, 27), "O1", dtype=torch.bfloat16, example_inputs=example, pad_gemm=True)
    linear = next(n for n in gm.graph.nodes if meta.OP.get(n) == "linear")
    assert meta.PADDED.get(linear) == {"K": (13, 16), "N": (27, 32)}
    shapes = _recorded_and_real(gm, example)
    assert shapes["linear"] == ((2, 5, 32), (2, 5, 32))  # the analysis said (2, 5, 27) before the rewrite
    assert meta.value_of(linear).shape == (2, 5, 32) and meta.value_of(linear) is linear.meta[meta.VALUE]
    pads = [n for n in gm.graph.nodes if meta.OP.get(n) in ("pad_cast", "unpad")]
    assert len(pads) == 4  # x, weight and bias padded in their casts; the result sliced back
    wrong = {name: pair for name, pair in shapes.items() if pair[0] is not None and pair[0] != pair[1]}
    assert not wrong, wrong
    assert all(shapes[n.name][0] is not None for n in pads)


def test_a_padded_batched_gemm_and_its_activation_pad_record_their_shapes():
    example = (torch.randn(3, 5, 13), torch.randn(3, 13, 27))
    gm = amp_fx.convert(Batched(), "O1", dtype=torch.bfloat16, example_inputs=example, pad_gemm=True)
    assert gm.amp_report.passes["pad_gemm"]["padded"] == 1
    shapes = _recorded_and_real(gm, example)
    assert shapes["bmm"] == ((3, 5, 32), (3, 5, 32))
    wrong = {name: pair for name, pair in shapes.items() if pair[0] is not None and pair[0] != pair[1]}
    assert not wrong, wrong


def test_the_flat_facts_read_the_one_record():
    graph = fx.Graph()
    node = graph.placeholder("x")
    assert (meta.is_tensor(node), meta.is_float(node), meta.float_dtype(node), meta.shape(node)) == (None,) * 4
    assert meta.value_of(node) is None and not meta.container(node) and meta.unknown(node) is None
    info = meta.ValueInfo(True, True, torch.bfloat16, torch.bfloat16, (2, 3))
    meta.store_value(node, info)
    assert meta.value_of(node) is info and node.meta["amp_fx.value"] is info
    assert (meta.is_tensor(node), meta.is_float(node), meta.float_dtype(node), meta.shape(node)) == \
           (True, True, torch.bfloat16, (2, 3))
    # A rewrite changes one fact: a new record, still the analysis's, the old one untouched for whoever holds it.
    new = meta.note_value(node, shape=(2, 8))
    assert new is not info and info.shape == (2, 3) and meta.value_of(node) is new
    assert (meta.shape(node), meta.float_dtype(node)) == ((2, 8), torch.bfloat16)
    assert meta.float_dtype(3) is None and meta.shape(None) is None  # not a node: nothing known


def test_propagate_meta_writes_a_first_record_the_analysis_replaces():
    model = Affine(4, 8)
    gm, ctx = prepare(model, propagate_meta, example_inputs=(torch.randn(2, 4),))
    propagate_meta(gm, ctx)
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert (meta.is_float(x), meta.shape(x), meta.float_dtype(x)) == (True, (2, 4), None)
    assert meta.value_of(x) is None  # read off the trace: not the analysis's answer
    analyse_dtypes(gm, ctx)
    assert meta.value_of(x) is not None and meta.float_dtype(x) == torch.float32 and meta.shape(x) == (2, 4)


def test_inherit_copies_the_place_and_the_value_facts_by_one_rule():
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta.update({meta.MODULE_PATH: "enc.fc", meta.MODULE_STACK: [("enc.fc", nn.Linear)], meta.SOURCE: "m.py:3",
                   "stack_trace": "trace", meta.ORIG_DTYPE: torch.float32, "val": "fake", meta.DECISION: "low"})
    meta.store_value(x, meta.ValueInfo(True, True, torch.float32, torch.float32, (4, 4)))
    cast = graph.call_method("to", (x, torch.bfloat16))
    meta.inherit(cast, x, float_dtype=torch.bfloat16)
    assert (meta.MODULE_PATH.get(cast), meta.MODULE_STACK.get(cast), meta.SOURCE.get(cast)) == \
           ("enc.fc", [("enc.fc", nn.Linear)], "m.py:3")
    assert cast.meta["stack_trace"] == "trace" and not meta.DECISION.on(cast)  # the paint is the caller's
    assert (meta.is_float(cast), meta.shape(cast), meta.float_dtype(cast)) == (True, (4, 4), torch.bfloat16)
    assert meta.value_of(cast) is None  # the analysis's answer is the analysis's to give
    assert not meta.ORIG_DTYPE.on(cast) and "val" not in cast.meta  # a cast makes another tensor
    read = graph.call_method("view_as", (x, x))
    meta.inherit(read, x, same_value=True)
    assert meta.ORIG_DTYPE.get(read) == torch.float32 and read.meta["val"] == "fake" and meta.float_dtype(read) is None
    grown = graph.call_function(torch.constant_pad_nd, (x, [0, 4]))
    meta.inherit(grown, x, float_dtype=meta.float_dtype(x), shape=(4, 8))
    assert (meta.shape(grown), meta.float_dtype(grown)) == ((4, 8), torch.float32)


def test_a_cast_of_an_analysed_value_gets_the_analysis_answer_in_its_dtype():
    graph = fx.Graph()
    x = graph.placeholder("x")
    meta.store_value(x, meta.ValueInfo(True, True, torch.float32, torch.float32, (4, 4)))
    builder = CastBuilder(graph)
    cast = builder.cast(x, torch.bfloat16)
    assert is_inserted_cast(cast) and meta.CAST_OF.get(cast) == ("x", torch.float32, torch.bfloat16)
    answer = meta.value_of(cast)
    assert answer is not None and (answer.float_dtype, answer.dtype, answer.shape) == (torch.bfloat16, torch.bfloat16, (4, 4))
