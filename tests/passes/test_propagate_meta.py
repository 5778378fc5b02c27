"""propagate_meta: every node gets its op key, module scope, parameter name, source line and example facts.

An analysis: ``check`` asserts no code changes (delta 0, modified False),
every node carries the keys, and a second run writes the same values.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from amp_fx.ir import meta
from amp_fx.passes.propagate_meta import propagate_meta
from pass_check import check

KEYS = (meta.OP, meta.INPLACE, meta.MODULE_PATH, meta.MODULE_STACK, meta.SOURCE, meta.VALUE)  # VALUE: is_tensor, is_float, ...


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("offset", torch.zeros(4))

    def forward(self, x):
        return F.softmax(self.proj(x) * self.scale + self.offset, -1)


class Model(nn.Module):
    """Embedding at the root's child, a nested Linear inside Attn, an in-place op at the root."""

    def __init__(self):
        super().__init__()
        self.attn = Attn()
        self.emb = nn.Embedding(10, 4)

    def forward(self, ids, x):
        h = self.emb(ids) + self.attn(x)
        return h.relu_()


def _inputs():
    return torch.randint(0, 10, (2,)), torch.randn(2, 4)


def _by_name(gm):
    return {n.name: n.meta for n in gm.graph.nodes}


def test_module_paths_and_stacks_innermost_first():
    gm = check(propagate_meta, Model(), _inputs(), delta=0, expect_modified=False, meta_keys=KEYS)
    nodes = _by_name(gm)
    assert nodes["linear"][meta.MODULE_PATH] == "attn.proj"
    assert nodes["linear"][meta.MODULE_STACK] == [("attn.proj", nn.Linear), ("attn", Attn)]
    assert nodes["mul"][meta.MODULE_PATH] == "attn" and nodes["embedding"][meta.MODULE_PATH] == "emb"
    assert nodes["relu_"][meta.MODULE_PATH] == "" and nodes["relu_"][meta.MODULE_STACK] == []


def test_op_keys_are_canonical_and_in_place_ops_are_flagged():
    gm = check(propagate_meta, Model(), _inputs(), delta=0, expect_modified=False, meta_keys=KEYS)
    ops = {n.name: (n.meta[meta.OP], n.meta[meta.INPLACE]) for n in gm.graph.nodes if n.op.startswith("call")}
    assert ops == {"embedding": ("embedding", False), "linear": ("linear", False), "mul": ("mul", False),
                   "add": ("add", False), "softmax": ("softmax", False), "add_1": ("add", False),
                   "relu_": ("relu", True)}


def test_parameters_and_buffers_carry_their_name_and_owner():
    gm = check(propagate_meta, Model(), _inputs(), delta=0, expect_modified=False, meta_keys=KEYS)
    attrs = {n.meta[meta.PARAM]: n.meta[meta.MODULE_PATH] for n in gm.graph.nodes if n.op == "get_attr"}
    assert attrs == {"emb.weight": "emb", "attn.proj.weight": "attn.proj", "attn.proj.bias": "attn.proj",
                     "attn.scale": "attn", "attn.offset": "attn"}
    assert all(meta.PARAM not in n.meta for n in gm.graph.nodes if n.op != "get_attr")


def test_example_inputs_say_floatness_shape_and_dtype():
    ids, x = _inputs()
    gm = check(propagate_meta, Model(), (ids, x), example_inputs=(ids, x), delta=0, meta_keys=KEYS)
    known = {n.name: n for n in gm.graph.nodes}
    facts = {name: (meta.is_float(known[name]), meta.shape(known[name]), meta.ORIG_DTYPE.get(known[name])) for name in ("ids", "x")}
    assert facts == {"ids": (False, (2,), torch.int64), "x": (True, (2, 4), torch.float32)}
    unknown = {n.name: n for n in check(propagate_meta, Model(), (ids, x), delta=0, meta_keys=KEYS).graph.nodes}
    assert meta.is_float(unknown["ids"]) is None and meta.shape(unknown["ids"]) is None  # never guessed


def test_source_names_the_user_line_that_made_the_node():
    gm = check(propagate_meta, Model(), _inputs(), delta=0, meta_keys=KEYS)
    source = _by_name(gm)["linear"][meta.SOURCE]
    assert __file__.rsplit("/", 1)[-1] in source and "self.proj(x)" in source and "in forward" in source
