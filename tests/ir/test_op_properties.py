"""The op registry (amp_fx/ir/op_properties.py): where the passes' old op lists disagreed, what it answers now, and why.

Before the registry, two passes kept their own "commutes with rounding" lists:
``fuse_precision`` (which ops a fused norm's low result may pass through) and
``minimize_casts`` (which ops may move from fp32 to low).  Both ask one
question -- may this op run low where its result is rounded low anyway,
forward *and* backward? -- and the lists disagreed.  The tests below pin the
old lists, the registry's answer for every op where they differed, and run
each op to show the answer is what the op does.
"""

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from amp_fx.ir import meta, op_properties, tables
from amp_fx.ir.op_keys import canonical_op

# -- the two lists as the passes had them before the registry ------------------------------------
# Views that joined DATA_MOVEMENT after the registry (a write through one must reach what it views).
LATER_DATA_MOVEMENT = {"diagonal", "as_strided", "unfold", "movedim", "moveaxis", "swapaxes", "swapdims", "adjoint",
                       "tensor_split", "hsplit", "vsplit", "dsplit",
                       # shape queries as torch.export records them, classed with size/dim/numel in issue 26
                       "sym_size", "sym_stride", "sym_numel", "sym_storage_offset"}
OLD_FUSE = (tables.DATA_MOVEMENT - LATER_DATA_MOVEMENT) | {"relu", "relu6", "neg", "abs", "max_pool1d", "max_pool2d", "max_pool3d",
                                   "adaptive_max_pool1d", "adaptive_max_pool2d"}
OLD_MINIMIZE = {  # _MOVABLE's "exact" tag
    "relu", "relu6", "neg", "abs", "sign", "clamp", "clamp_min", "clamp_max", "hardtanh", "threshold",
    "view", "reshape", "flatten", "unflatten", "permute", "transpose", "t", "contiguous", "squeeze", "unsqueeze",
    "narrow", "select", "slice", "flip", "roll", "clone", "detach", "identity", "pad", "constant_pad_nd", "tril",
    "triu", "alias", "unsafe_view", "_unsafe_view", "getitem", "cat", "stack",
}
MAX_POOLS = ("max_pool1d", "max_pool2d", "max_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d")


def _rows(forward, backward, why, *ops):
    return {op: (forward, backward, why) for op in ops}


# op -> (rounding_forward, backward, why), for every op on which the old lists disagreed, and relu6
# (on both, but its backward is not exact).
ANSWERS = {
    # -- on fuse_precision's list only --
    **_rows(True, "sums", "copies values forward; its backward sums the copies' gradients, rounded in the low dtype "
            "(the cast form sums in fp32)", "expand", "expand_as", "repeat", "index_select", "gather", "scatter",
            "setitem", "embedding"),
    "embedding_bag": (False, "sums", "sums or averages the rows it selects"),
    **_rows(True, "routes", "a window's max is exact forward; its gradient goes to the max, which a tie rounding makes "
            "can move to another element", *MAX_POOLS),
    **_rows(True, "moves", "moves values and gradients by position: exact (minimize_casts never moves it: not free there)",
            "split", "chunk", "unbind", "split_with_sizes", "masked_select", "view_as", "lift_fresh_copy", "getattr"),
    **_rows(True, "none", "no gradient reaches its input: a shape, a fresh tensor, integers", "zeros_like", "ones_like",
            "empty_like", "full_like", "new_zeros", "new_ones", "new_empty", "new_full", "size", "dim", "numel",
            "one_hot"),
    # -- on minimize_casts' list only --
    "sign": (True, "none", "sign(round(x)) == sign(x) except where x underflows to zero; its gradient is zero"),
    **_rows(True, "masks", "clamps exactly forward (rounding is monotone); its backward zeroes the gradient past a bound, "
            "and rounding carries an input within half an ulp across it", "clamp", "clamp_min", "clamp_max", "hardtanh"),
    "threshold": (False, "masks", "an input just above the threshold rounds onto it and becomes the value"),
    **_rows(True, "moves", "concatenates distinct values (a cat of copies sums: refused per use)", "cat", "stack"),
    # -- on both, answered otherwise now --
    "relu6": (True, "masks", "hardtanh(0, 6): an input just below 6 rounds onto it, where the gradient is zeroed"),
}


def _fuse_passes(op):  # what fuse_precision lets a fused norm's result pass through now
    props = op_properties.of(op)
    return props.exact_under_rounding or (props.rounding_forward and props.backward == "routes")


def test_every_op_the_old_lists_disagreed_on_has_an_answer_with_its_reason():
    assert (OLD_FUSE ^ OLD_MINIMIZE) <= set(ANSWERS)
    for op, (forward, backward, why) in ANSWERS.items():
        props = op_properties.of(op)
        assert (props.rounding_forward, props.backward) == (forward, backward), f"{op}: {why}"


def test_both_passes_now_ask_one_question_except_that_fuse_precision_lets_max_pooling_through():
    differ = {op for op in OLD_FUSE | OLD_MINIMIZE | set(ANSWERS) if _fuse_passes(op) != op_properties.exact_under_rounding(op)}
    assert differ == set(MAX_POOLS)


def test_the_decisions_that_changed_are_these_and_only_ever_keep_fp32():
    """Each change is tested against fp64 in tests/ir/test_op_property_decisions.py."""
    universe = OLD_FUSE | OLD_MINIMIZE | set(ANSWERS)
    fuse_lost = {op for op in universe if op in OLD_FUSE and not _fuse_passes(op)}
    fuse_gained = {op for op in universe if op not in OLD_FUSE and _fuse_passes(op)}
    assert fuse_lost == {"relu6", "expand", "expand_as", "repeat", "index_select", "gather", "scatter", "setitem",
                         "embedding", "embedding_bag"}
    # Gained: sign (its gradient is zero; forward exact but on underflow); cat/stack never reach the
    # check (a fused norm's result is not their first argument, a list is).
    assert fuse_gained == {"sign", "cat", "stack"}
    # minimize_casts moves only free ops: those that run in either precision, and PROMOTE ops.
    movable = {op for op in universe if op_properties.of(op).either_precision or op in tables.PROMOTE}
    minimize_lost = {op for op in movable if op in OLD_MINIMIZE and not op_properties.exact_under_rounding(op)}
    minimize_gained = {op for op in movable if op not in OLD_MINIMIZE and op_properties.exact_under_rounding(op)}
    assert minimize_lost == {"clamp", "clamp_min", "clamp_max", "hardtanh", "relu6", "threshold"}
    assert minimize_gained == set()


# -- the answers, run: each op on round(x) against the op on x ---------------------------------------
def _grid(*shape):
    torch.manual_seed(0)
    return torch.randn(*shape) * 2


IDX = torch.tensor([0, 0, 1, 3])
def _at(value):  # an input of value(eps), eps the low dtype's: within half an ulp of a kink, so rounding crosses it
    return lambda eps: torch.full((4, 6), value(eps))


# op -> (callable on a (4, 6) tensor, a (dtype's eps -> input) on which a non-exact answer shows, or None: random data)
RUN = {
    "relu": (F.relu, None), "neg": (torch.neg, None), "abs": (torch.abs, None), "sign": (torch.sign, None),
    "t": (lambda x: x.t(), None), "flip": (lambda x: x.flip(0), None), "pad": (lambda x: F.pad(x, (1, 2)), None),
    "tril": (torch.tril, None), "getitem": (lambda x: x[1:3, ::2], None), "masked_select": (lambda x: x[x > 0], None),
    "cat": (lambda x: torch.cat([x[:2], x[2:]], 1), None), "stack": (lambda x: torch.stack([x[:2], x[2:]]), None),
    "split": (lambda x: x.split(2)[1], None),
    "clamp": (lambda x: x.clamp(-1, 1), _at(lambda eps: 1 + 0.3 * eps)),  # rounds onto the bound: passes a gradient
    "clamp_max": (lambda x: x.clamp_max(1), _at(lambda eps: 1 + 0.3 * eps)),
    "hardtanh": (F.hardtanh, _at(lambda eps: 1 - 0.2 * eps)),  # rounds onto 1, where hardtanh's gradient is zero
    "relu6": (F.relu6, _at(lambda eps: 6 - eps)),
    "threshold": (lambda x: F.threshold(x, 0.5, -2.0), _at(lambda eps: 0.5 + 0.1 * eps)),
    # two values of a window tie once rounded: the gradient goes to the first, not to the max
    "max_pool2d": (lambda x: F.max_pool2d(x[None], 2)[0], lambda eps: torch.tensor([[1.0, 1 + 0.3 * eps] * 3] * 4)),
    "expand": (lambda x: x[:, :1].expand(4, 6), None), "repeat": (lambda x: x.repeat(2, 1), None),
    "index_select": (lambda x: x.index_select(0, IDX), None), "gather": (lambda x: x.gather(0, IDX[:, None].expand(4, 6)), None),
    "embedding": (lambda x: F.embedding(IDX, x), None),
    "movedim": (lambda x: x.movedim(0, 1), None), "diagonal": (lambda x: x.diagonal(), None),
    # overlapping windows: the shared elements' gradients sum
    "unfold": (lambda x: x.unfold(1, 3, 1), None),
}


def _forward_exact(fn, x, low):
    return torch.equal(fn(x.to(low)), fn(x).to(low))


def _backward_exact(fn, x, low):
    """The backward run in the low dtype at round(x) gives exactly the fp32 backward at x (same incoming gradient)."""
    grads = []
    for dtype, value in ((low, x.to(low)), (torch.float32, x)):
        value = value.detach().requires_grad_()
        out = fn(value)
        torch.manual_seed(1)
        out.backward(torch.randn(out.shape).to(low).to(dtype))
        grads.append(value.grad.float())
    return torch.equal(*grads)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", sorted(RUN))
def test_each_answer_is_what_the_op_does(op, low):
    fn, telling = RUN[op]
    props = op_properties.of(op)
    x = _grid(4, 6) if telling is None else telling(torch.finfo(low).eps)
    assert _forward_exact(fn, x, low) == props.rounding_forward
    if props.rounding_forward:
        assert _backward_exact(fn, x, low) == (props.backward in ("moves", "none"))


# -- per use, and the registry's own consistency -------------------------------------------------------
def _nodes(fn):
    gm = fx.symbolic_trace(fn)
    for node in gm.graph.nodes:
        node.meta[meta.OP] = canonical_op(node, gm)
    return {node.name: node for node in gm.graph.nodes}


def test_exact_under_rounding_is_decided_per_use_for_gathers_and_copies():
    nodes = _nodes(lambda x, i: (x[0], x[i], torch.cat([x, x]), torch.cat([x, x.t()]), F.max_pool2d(x, 2)))
    exact = {name: op_properties.exact_under_rounding_at(node) for name, node in nodes.items()
             if node.op in ("call_function", "call_method")}
    assert exact == {"getitem": True, "getitem_1": False, "cat": False, "t": True, "cat_1": True, "max_pool2d": False}
    assert op_properties.exact_under_rounding_at(nodes["max_pool2d"], routes=True)


def test_the_registry_is_consistent_with_the_tables_and_itself():
    assert len(tables.DATA_MOVEMENT) >= 70 and len(op_properties.known_ops()) >= 340  # what the loops below walk
    for op in tables.DATA_MOVEMENT:
        props = op_properties.of(op)
        assert props.backward != "computes" and props.may_alias and props.data_movement, op
    for op in op_properties.known_ops():
        props = op_properties.of(op)
        assert props.backward in op_properties.BACKWARD_KINDS
        # fp8: the GEMMs verified bit for bit against torchao (tests/fp8/test_fp8_torchao.py)
        assert props.fp8 is (op in ("linear", "matmul", "mm", "addmm")) and (not props.fp8 or props.gemm is not None), op
        assert not props.cast_hoistable or (props.exact_under_rounding and props.data_movement), op
        assert not props.view or props.may_alias, op
        assert not props.native_promotion or props.either_precision, op
        # A GEMM row is a low op's, or what fp8_gemms makes of one (pad_gemm lists those after it; no table decides them).
        assert props.gemm is None or props.table == "low" or op in ("fp8_linear", "fp8_matmul"), op
    assert set(op_properties.NAMED_CASTS) < op_properties.CAST_OPS and all(op_properties.of(c).may_alias for c in op_properties.CAST_OPS)
    assert {op for op in tables.NORM_OPS if op_properties.of(op).norm == "statistics"} == {"layer_norm", "group_norm", "rms_norm"}
    assert {op for op in tables.NORM_OPS if op_properties.of(op).norm == "input_dtype"} == {"batch_norm", "instance_norm"}
    assert all(op_properties.of(op).weight_bias_args for op in op_properties.FUSED_FORMS)
    assert op_properties.of("module_hook_enter").hook == "boundary" and op_properties.of("module_hook_value").hook == "value"
    # The dtype-only analysis reads float_result: a low or fp32 op makes a float (linear, softmax of integer-free
    # input), except the reductions that keep an integer input's dtype (sum of an int tensor is int); follow ops do not.
    float_result = {op: op_properties.of(op).float_result for op in ("linear", "softmax", "exp", "sum", "cumsum", "pow", "add", "relu")}
    assert float_result == {"linear": True, "softmax": True, "exp": True, "sum": False, "cumsum": False, "pow": False,
                            "add": False, "relu": False}
    # Data movement keeps its first input's dtype, except where an index tensor comes first (F.embedding, one_hot).
    keeps = {op: op_properties.of(op).keeps_first_dtype for op in ("view", "transpose", "getitem", "embedding", "one_hot", "add")}
    assert keeps == {"view": True, "transpose": True, "getitem": True, "embedding": False, "one_hot": False, "add": False}
    unknown = op_properties.of("pkg.blocks.Attention")
    assert unknown.table == "unknown" and not unknown.exact_under_rounding and unknown == op_properties.OpProperties("pkg.blocks.Attention")


def test_every_pass_asks_the_registry_and_keeps_no_op_list_of_its_own():
    import pathlib
    import re

    import amp_fx.passes

    gone = ["_VIEWS", "_HOISTABLE", "_MOVABLE", "_PROMOTING_FOLLOW", "_EXACT_UNDER_ROUNDING", "_COMMUTES_WITH_ROUNDING",
            "_STAT_NORMS", "_FOLLOWING_NORMS", "_HOOK_OPS", "_ARGS", "_WEIGHT_BIAS_POSITIONS", "ALIASING_OPS", "CHECK_OPS",
            "_GROWING", "_NAMED_CASTS", "_NON_FLOAT_RESULT", "_TUPLE_RESULT", "_HOOK_TOKENS", "_FLOAT_RESULT"]
    folders = [pathlib.Path(amp_fx.passes.__path__[0]), pathlib.Path(op_properties.__file__).parent]
    for path in [p for folder in folders for p in folder.glob("*.py")]:
        if path.name == "op_properties.py":
            continue
        defined = set(re.findall(r"^(\w+)\s*(?::[^=\n]+)?=", path.read_text(), re.M))
        assert not defined & set(gone), (path.name, defined & set(gone))
