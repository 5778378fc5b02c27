"""The op tables are valid data, and op_keys maps every spelling of an op to one canonical name."""

import itertools

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import amp_fx
from amp_fx.ir import tables
from amp_fx.ir.op_keys import canonical_op, is_inplace, module_op_name

# Canonical names that are not ATen op names: torch-level composites the
# autocast reference lists by their Python name.
PYTHON_LEVEL_NAMES = {"cross_entropy", "normalize", "softmin", "interpolate", "rtruediv", "multi_head_attention",
                      "lstm_cell", "gru_cell", "getitem", "setitem", "identity", "pad", "getattr", "size", "dim",
                      "grid_sampler", "chain_matmul", "slice", "lift_fresh_copy", "unsafe_view",
                      "_guards_fn"}  # the shape-guard module of an unlifted torch.export graph


def test_tables_are_disjoint():
    pairs = list(itertools.combinations(tables.all_tables().items(), 2))
    assert len(pairs) == 10  # low, fp32, promote, banned, follow
    for (a, ta), (b, tb) in pairs:
        assert not set(ta) & set(tb), f"{a} and {b} share {set(ta) & set(tb)}"


@pytest.mark.parametrize("category, table", list(tables.all_tables().items()))
def test_every_key_is_canonical_and_has_a_reason(category, table):
    assert len(table) >= {"low": 39, "fp32": 89, "promote": 14, "banned": 1, "follow": 170}[category], len(table)
    for name, reason in table.items():
        assert reason.strip(), name
        # a custom op is keyed "ns::name" (tests/ir/test_custom_ops.py checks those entries)
        assert hasattr(torch.ops.aten, name) or name in PYTHON_LEVEL_NAMES or name in tables.CUSTOM_OPS, \
            f"{category}: {name!r} is not canonical"


def _node_of(fn, *args):
    class M(nn.Module):
        def forward(self, x):
            return fn(x)

    gm = fx.symbolic_trace(M())
    node = [n for n in gm.graph.nodes if n.op.startswith("call")][-1]
    return canonical_op(node, gm), is_inplace(node, gm)


@pytest.mark.parametrize("fn, expected", [
    (lambda x: torch.matmul(x, x), "matmul"),
    (lambda x: x.matmul(x), "matmul"),
    (lambda x: x @ x, "matmul"),
    (lambda x: F.linear(x, x), "linear"),
    (lambda x: torch._C._nn.linear(x, x), "linear"),
    (lambda x: x.softmax(-1), "softmax"),
    (lambda x: F.softmax(x, -1), "softmax"),
    (lambda x: x.float(), "float"),
    (lambda x: x.to(torch.float16), "to"),
    (lambda x: torch.norm(x), "norm"),
    (lambda x: torch.cdist(x, x), "cdist"),
    (lambda x: torch.chain_matmul(x, x), "chain_matmul"),
    (lambda x: torch.tensordot(x, x, 1), "tensordot"),
    (lambda x: torch.einsum("ij,jk", x, x), "einsum"),
    (lambda x: torch.linalg.multi_dot([x, x]), "linalg_multi_dot"),
    (lambda x: 1.0 / x, "rtruediv"),
    (lambda x: x / 2, "div"),
    (lambda x: x ** 2, "pow"),
    (lambda x: F.cross_entropy(x, x), "cross_entropy"),
])
def test_spellings_map_to_one_name(fn, expected):
    assert _node_of(fn)[0] == expected


def test_multi_head_attention_forward_maps_to_the_modules_name():
    """F.multi_head_attention_forward takes a dozen tensors: a call node of it, not a trace, shows its name."""
    graph = fx.Graph()
    node = graph.call_function(F.multi_head_attention_forward, (graph.placeholder("x"),))
    assert (canonical_op(node), is_inplace(node)) == ("multi_head_attention", False)
    assert module_op_name(nn.MultiheadAttention(2, 1)) == canonical_op(node)


def test_in_place_spellings_are_flagged():
    assert _node_of(lambda x: x.exp_()) == ("exp", True)
    assert _node_of(lambda x: torch.relu_(x)) == ("relu", True)
    assert _node_of(lambda x: F.relu(x, inplace=True)) == ("relu", True)
    assert _node_of(lambda x: x.exp()) == ("exp", False)


@pytest.mark.parametrize("module, name", [
    (nn.Linear(2, 2), "linear"), (nn.Conv2d(1, 1, 1), "conv2d"), (nn.ConvTranspose1d(1, 1, 1), "conv_transpose1d"),
    (nn.LayerNorm(2), "layer_norm"), (nn.BatchNorm2d(2), "batch_norm"), (nn.SyncBatchNorm(2), "batch_norm"),
    (nn.LSTM(2, 2), "lstm"), (nn.GRU(2, 2), "gru"), (nn.RNN(2, 2, nonlinearity="relu"), "rnn_relu"),
    (nn.LSTMCell(2, 2), "lstm_cell"), (nn.MultiheadAttention(2, 1), "multi_head_attention"),
    (nn.Embedding(2, 2), "embedding"), (nn.ReLU(), "relu"), (nn.GELU(), "gelu"), (nn.SiLU(), "silu"),
    (nn.LeakyReLU(), "leaky_relu"), (nn.MaxPool2d(2), "max_pool2d"), (nn.AdaptiveAvgPool2d(1), "adaptive_avg_pool2d"),
    (nn.CrossEntropyLoss(), "cross_entropy"), (nn.BCELoss(), "binary_cross_entropy"), (nn.Softmax(), "softmax"),
])
def test_modules_map_to_their_op(module, name):
    assert module_op_name(module) == name


@pytest.mark.parametrize("target, expected", [
    (torch.ops.aten.addmm.default, ("addmm", False)),
    (torch.ops.aten._softmax.default, ("softmax", False)),
    (torch.ops.aten.native_layer_norm.default, ("layer_norm", False)),
    (torch.ops.aten.exp_.default, ("exp", True)),
    (torch.ops.aten._to_copy.default, ("to", False)),
    (torch.ops.aten.convolution.default, ("convolution", False)),
    (torch.ops.aten.cross_entropy_loss.default, ("cross_entropy", False)),
])
def test_aten_overloads_map_to_canonical_names(target, expected):
    graph = fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(target, (x,))
    assert (canonical_op(node), is_inplace(node)) == expected


class CudnnConvolutions(nn.Module):
    """cuDNN's own convolution entry points, called as a CUDA model (or a CUDA graph's ATen ops) calls them."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3, 3, 3))
        self.wt = nn.Parameter(torch.randn(4, 3, 3, 3))

    def forward(self, x):
        # (padding, stride, dilation, groups, benchmark, deterministic, allow_tf32)
        y = torch.cudnn_convolution(x, self.w, [1, 1], [1, 1], [1, 1], 1, False, False, True)
        # (padding, output_padding, stride, dilation, groups, benchmark, deterministic, allow_tf32)
        return torch.cudnn_convolution_transpose(y, self.wt, [1, 1], [0, 0], [1, 1], [1, 1], 1, False, False, True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cudnn_convolutions_run_low_as_cuda_autocast_lists_them(dtype):
    """cudnn_convolution(_transpose) are on CUDA autocast's lower_precision_fp list: low, with their inputs cast."""
    ops = ["cudnn_convolution", "cudnn_convolution_transpose"]
    assert all(tables.table_of(op) == "low" for op in ops)
    # The ATen overloads (torch.export and AOT graphs) take the same canonical names.
    for op in ops:
        graph = fx.Graph()
        node = graph.call_function(getattr(torch.ops.aten, op).default, (graph.placeholder("x"),))
        assert canonical_op(node) == op
    # The torch-level calls, traced and converted without running (there is no CPU kernel to run them).
    gm = amp_fx.convert(CudnnConvolutions(), "O1", dtype=dtype)
    records = {r.name: r for r in gm.amp_report.nodes}  # the nodes are named after their op
    assert [records[op].decision for op in ops] == ["low", "low"]
    assert [records[op].dtype for op in ops] == [str(dtype).removeprefix("torch.")] * 2
    conv, transpose = (next(n for n in gm.graph.nodes if n.name == op) for op in ops)
    # x and both weights arrive through casts inserted to the low dtype; the transpose takes the
    # convolution's low output as it is.
    for cast in (conv.args[0], conv.args[1], transpose.args[1]):
        assert records[cast.name].inserted and cast.args[-1] == dtype, cast.format_node()
    assert transpose.args[0] is conv
    with pytest.raises((NotImplementedError, RuntimeError)):  # why test_table_dtypes.py cannot run them here
        CudnnConvolutions()(torch.randn(1, 3, 8, 8))
