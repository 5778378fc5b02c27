"""Hypothesis strategies that build small random modules touching every op-table category.

A :class:`Program` is a straight-line list of :class:`Step` over numbered
slots ``v0, v1, ...`` of three kinds: ``f`` float values of shape (N, D),
``i`` integer index values of shape (N,) in [0, N), ``b`` bool masks of
shape (N, D).  :class:`FuzzModel` runs a program in its ``forward``, so fx
traces it into a plain straight-line graph.

The generator tracks what the fp32 model does, so that every program is
valid PyTorch whose fp32 run is a fair reference:

- each float slot's dtype in the fp32 model: user casts (``x.to(bf16)``,
  ``x.half()``, ``x.double()``) make mixed-dtype slots; an op with fp32
  parameters reads ``.float()`` of a slot that is not fp32 (the model's
  own cast, as a real model would write it);
- alias groups: ``x.float()`` returns ``x`` itself when ``x`` is fp32 and
  a copy otherwise, so whether a user cast aliases depends on precision.
  In-place ops therefore never touch a group a cast has read (neither
  autocast nor amp_fx can keep that aliasing), and never parameters;
- integer and bool values derive from the inputs only, never from computed
  floats, whose rounding would change indices and masks between precisions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

__all__ = ["N", "D", "OPS", "Op", "Step", "Program", "FuzzModel", "build_model", "programs", "make_inputs", "CATEGORIES"]

N, D = 4, 8  # tiny: fp16 GEMMs are emulated on CPU
_VOCAB = N + 2  # embedding rows


@dataclass(frozen=True)
class Op:
    """One vocabulary entry: input kinds, output kind, table category, and how to build and run it."""

    ins: str  # kinds of the slot arguments, e.g. "ff" or "fi"
    out: str  # kind of the result
    category: str  # the op table the interesting node belongs to (for coverage)
    fn: Callable[..., Any]  # fn(model, key, *values) -> value
    make: Optional[Callable[[], nn.Module]] = None  # a submodule holding this step's parameters
    params: bool = False  # reads fp32 parameters: its float input must be fp32 in the fp32 model
    inplace: bool = False  # writes into its first argument
    cast: Optional[torch.dtype] = None  # a user cast to this dtype (None: not a cast)
    result: str = "promote"  # float result dtype in the fp32 model: promote | fp32 | cast | first


class _Bmm(nn.Module):
    """Holds a (2, D, D) weight that ``torch.bmm`` reads (a GEMM on a bare parameter)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, D, D) / D ** 0.5)


def _m(model: nn.Module, key: str) -> nn.Module:
    return model.mods[key]


def _exp_(model, key, a):
    a.clamp_(-3.0, 3.0)
    return a.exp_()


OPS: dict[str, Op] = {
    # GEMMs and convolutions (LOW)
    "linear": Op("f", "f", "low", lambda m, k, a: _m(m, k)(a), make=lambda: nn.Linear(D, D), params=True, result="fp32"),
    "linear_shared": Op("f", "f", "low", lambda m, k, a: F.linear(a, m.shared), params=True, result="fp32"),
    "matmul_shared_t": Op("f", "f", "low", lambda m, k, a: a @ m.shared.t(), params=True, result="fp32"),
    "matmul_shared": Op("f", "f", "low", lambda m, k, a: torch.matmul(a, m.shared) * 0.5, params=True, result="fp32"),
    "matmul2": Op("ff", "f", "low", lambda m, k, a, b: (a @ b.type_as(a).t()) @ a * 0.1, result="first"),
    "bmm": Op("f", "f", "low", lambda m, k, a: torch.bmm(a.view(2, N // 2, D), _m(m, k).weight).view(N, D),
              make=_Bmm, params=True, result="fp32"),
    "conv1d": Op("f", "f", "low", lambda m, k, a: _m(m, k)(a.view(N, 1, D)).view(N, D),
                 make=lambda: nn.Conv1d(1, 1, 3, padding=1), params=True, result="fp32"),
    "conv2d": Op("f", "f", "low", lambda m, k, a: _m(m, k)(a.view(1, 1, N, D)).view(N, D),
                 make=lambda: nn.Conv2d(1, 1, 3, padding=1), params=True, result="fp32"),
    # norms (FP32: layer/group norm; batch norm FOLLOWS, a leaf module)
    "layer_norm": Op("f", "f", "fp32", lambda m, k, a: _m(m, k)(a), make=lambda: nn.LayerNorm(D), params=True, result="fp32"),
    "layer_norm_f": Op("f", "f", "fp32", lambda m, k, a: F.layer_norm(a, (D,))),
    "group_norm": Op("f", "f", "fp32", lambda m, k, a: _m(m, k)(a), make=lambda: nn.GroupNorm(2, D), params=True, result="fp32"),
    "batch_norm": Op("f", "f", "follow", lambda m, k, a: _m(m, k)(a), make=lambda: nn.BatchNorm1d(D), params=True, result="fp32"),
    # softmax family and reductions (FP32; mean FOLLOWS)
    "softmax": Op("f", "f", "fp32", lambda m, k, a: a.softmax(-1)),
    "log_softmax": Op("f", "f", "fp32", lambda m, k, a: F.log_softmax(a, dim=-1)),
    "sum": Op("f", "f", "fp32", lambda m, k, a: a + a.sum(-1, keepdim=True) * 0.125),
    "logsumexp": Op("f", "f", "fp32", lambda m, k, a: a - torch.logsumexp(a, -1, keepdim=True)),
    "mean": Op("f", "f", "follow", lambda m, k, a: a - a.mean(-1, keepdim=True)),
    # pointwise math (exp is FP32, the rest FOLLOW)
    "exp": Op("f", "f", "fp32", lambda m, k, a: a.clamp(-3.0, 3.0).exp()),
    "relu": Op("f", "f", "follow", lambda m, k, a: torch.relu(a)),
    "tanh": Op("f", "f", "follow", lambda m, k, a: a.tanh()),
    "mul_scalar": Op("f", "f", "follow", lambda m, k, a: a * 0.5),
    "add_scalar": Op("f", "f", "follow", lambda m, k, a: a + 1.0),
    "add": Op("ff", "f", "follow", lambda m, k, a, b: a + b),
    "mul": Op("ff", "f", "follow", lambda m, k, a, b: a * b),
    # PROMOTE ops over mixed inputs
    "addcmul": Op("fff", "f", "promote", lambda m, k, a, b, c: torch.addcmul(a, b, c, value=0.5)),
    "atan2": Op("ff", "f", "promote", lambda m, k, a, b: torch.atan2(a, b)),
    "cat": Op("ff", "f", "promote", lambda m, k, a, b: torch.cat([a[:, : D // 2], b[:, D // 2:]], -1)),
    "stack": Op("ff", "f", "promote", lambda m, k, a, b: torch.stack([a, b]).mean(0)),
    # user casts (the model's own; they make the mixed dtypes)
    "to_bf16": Op("f", "f", "cast", lambda m, k, a: a.to(torch.bfloat16), cast=torch.bfloat16, result="cast"),
    "half": Op("f", "f", "cast", lambda m, k, a: a.half(), cast=torch.float16, result="cast"),
    "float": Op("f", "f", "cast", lambda m, k, a: a.float(), cast=torch.float32, result="cast"),
    "double": Op("f", "f", "cast", lambda m, k, a: a.double(), cast=torch.float64, result="cast"),
    # views and reshapes (data movement)
    "view": Op("f", "f", "view", lambda m, k, a: a.contiguous().view(N * D).view(N, D)),
    "reshape_t": Op("f", "f", "view", lambda m, k, a: a.reshape(N, 2, D // 2).transpose(1, 2).reshape(N, D)),
    "unsqueeze": Op("f", "f", "view", lambda m, k, a: a.unsqueeze(0).squeeze(0)),
    "t_t": Op("f", "f", "view", lambda m, k, a: a.t().contiguous().t()),
    # indexing with integer tensors; integer values beside floats
    "index": Op("fi", "f", "index", lambda m, k, a, i: a[i]),
    "index_select": Op("fi", "f", "index", lambda m, k, a, i: a.index_select(0, i)),
    "gather": Op("fi", "f", "index", lambda m, k, a, i: a.gather(1, (i % D).unsqueeze(1).expand(N, D))),
    "embedding": Op("i", "f", "index", lambda m, k, i: _m(m, k)(i), make=lambda: nn.Embedding(_VOCAB, D), result="fp32"),
    "int_shift": Op("i", "i", "int", lambda m, k, i: (i + 1) % N),
    "int_flip": Op("i", "i", "int", lambda m, k, i: i.flip(0)),
    # bool masks beside floats
    "mask_from_ids": Op("i", "b", "bool", lambda m, k, i: (i > 1).unsqueeze(1).expand(N, D)),
    "mask_not": Op("b", "b", "bool", lambda m, k, b: ~b),
    "mask_and": Op("bb", "b", "bool", lambda m, k, b, c: b & c),
    "masked_fill": Op("fb", "f", "bool", lambda m, k, a, b: a.masked_fill(b, 0.0), result="first"),
    "where": Op("bff", "f", "bool", lambda m, k, b, a, c: torch.where(b, a, c)),
    "mul_mask": Op("fb", "f", "bool", lambda m, k, a, b: a * b, result="first"),
    "mask_float": Op("b", "f", "bool", lambda m, k, b: b.float(), result="fp32"),
    # in-place ops (relu_/add_/mul_ follow; exp_ is FP32 and is made out of place)
    "relu_": Op("f", "f", "inplace", lambda m, k, a: a.relu_(), inplace=True, result="first"),
    "relu_fn_inplace": Op("f", "f", "inplace", lambda m, k, a: F.relu(a, inplace=True), inplace=True, result="first"),
    "add_": Op("ff", "f", "inplace", lambda m, k, a, b: a.add_(b), inplace=True, result="first"),
    "mul_": Op("f", "f", "inplace", lambda m, k, a: a.mul_(0.5), inplace=True, result="first"),
    "exp_": Op("f", "f", "inplace", _exp_, inplace=True, result="first"),
}

# The bool mask of the float input; only while that input is unmutated (see _choices).
_MASK_FROM_X = Op("f", "b", "bool", lambda m, k, a: a > 0)
OPS["mask_from_x"] = _MASK_FROM_X

CATEGORIES = sorted({op.category for op in OPS.values()})
_SHARED = frozenset({"linear_shared", "matmul_shared_t", "matmul_shared"})


@dataclass(frozen=True)
class Step:
    """``v{n} = op(v{args})``; ``upcast`` reads ``.float()`` of the first argument; ``rebind=False``
    keeps using the mutated argument instead of an in-place op's result (``h.relu_()`` on its own line)."""

    op: str
    args: tuple[int, ...]
    upcast: bool = False
    rebind: bool = True


@dataclass(frozen=True)
class Program:
    """Inputs (``x`` always, ``ids``/``mask`` optional), steps, and the slots the model returns."""

    inputs: tuple[str, ...]
    steps: tuple[Step, ...]
    outputs: tuple[int, ...]

    def __repr__(self) -> str:
        lines = [f"Program(inputs={self.inputs}, outputs={self.outputs})"]
        first = len(self.inputs)
        for n, step in enumerate(self.steps, start=first):
            args = ", ".join(f"v{a}" + (".float()" if step.upcast and i == 0 else "") for i, a in enumerate(step.args))
            suffix = "" if step.rebind else f"   # result unused: v{n} is v{step.args[0]}"
            lines.append(f"  v{n} = {step.op}({args}){suffix}")
        return "\n".join(lines)

    def uses_shared(self) -> bool:
        return any(step.op in _SHARED for step in self.steps)


class FuzzModel(nn.Module):
    """Runs a :class:`Program` (build one with :func:`build_model`); fx traces the loop into a straight-line graph."""

    def __init__(self, program: Program):
        super().__init__()
        self.program = program
        self.mods = nn.ModuleDict()
        if program.uses_shared():
            self.shared = nn.Parameter(torch.randn(D, D) / D ** 0.5)
        for index, step in enumerate(program.steps):
            make = OPS[step.op].make
            if make is not None:
                self.mods[f"s{index}"] = make()

    def run(self, inputs: tuple) -> Any:
        values = list(inputs)
        for index, step in enumerate(self.program.steps):
            op = OPS[step.op]
            args = [values[a] for a in step.args]
            if step.upcast:
                args[0] = args[0].float()
            out = op.fn(self, f"s{index}", *args)
            values.append(values[step.args[0]] if op.inplace and not step.rebind else out)
        outs = tuple(values[o] for o in self.program.outputs)
        return outs[0] if len(outs) == 1 else outs


# fx cannot trace ``*inputs``: one signature per number of inputs.
class _Fuzz1(FuzzModel):
    def forward(self, x):
        return self.run((x,))


class _Fuzz2(FuzzModel):
    def forward(self, x, extra):
        return self.run((x, extra))


class _Fuzz3(FuzzModel):
    def forward(self, x, ids, mask):
        return self.run((x, ids, mask))


def build_model(program: Program, seed: int = 0) -> FuzzModel:
    """The module that runs ``program``, its parameters drawn from ``seed``."""
    torch.manual_seed(seed)
    return (_Fuzz1, _Fuzz2, _Fuzz3)[len(program.inputs) - 1](program)


def make_inputs(program: Program, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Fresh inputs for ``program`` (call again for every run: in-place ops may write into them)."""
    gen = torch.Generator().manual_seed(seed)
    made = {
        "x": lambda: torch.randn(N, D, generator=gen),
        "ids": lambda: torch.randint(0, N, (N,), generator=gen),
        "mask": lambda: torch.rand(N, D, generator=gen) > 0.5,
    }
    return tuple(made[name]() for name in program.inputs)


@dataclass
class _Slot:
    kind: str
    dtype: Optional[torch.dtype]  # float dtype in the fp32 model
    group: int  # alias group
    is_input_x: bool = False


def _result_dtype(op: Op, dtypes: list[torch.dtype]) -> torch.dtype:
    if op.result == "cast":
        return op.cast
    if op.result == "fp32":
        return torch.float32
    if op.result == "first" or len(dtypes) == 1:
        return dtypes[0]
    out = dtypes[0]
    for dtype in dtypes[1:]:
        out = torch.promote_types(out, dtype)
    return out


@st.composite
def programs(draw: Callable, max_steps: int = 8, ops: Optional[list[str]] = None) -> Program:
    """A random valid :class:`Program` of 1..``max_steps`` steps over ``ops`` (default: all)."""
    names = sorted(ops or OPS)
    inputs = ["x"] + [name for name in ("ids", "mask") if draw(st.booleans())]
    slots = [_Slot("f", torch.float32, 0, is_input_x=True)]
    slots += [_Slot("i" if name == "ids" else "b", None, len(slots) + k) for k, name in enumerate(inputs[1:])]
    touched: set[int] = set()  # alias groups a cast has read: no in-place ops on them from now on
    x_mutated = False
    steps = []
    for _ in range(draw(st.integers(1, max_steps))):
        by_kind = {kind: [n for n, s in enumerate(slots) if s.kind == kind] for kind in "fib"}
        mutable = [n for n in by_kind["f"] if slots[n].group not in touched]
        usable = [name for name in names if all(by_kind[kind] for kind in OPS[name].ins)
                  and (not OPS[name].inplace or mutable) and not (name == "mask_from_x" and x_mutated)]
        name = draw(st.sampled_from(usable))
        op = OPS[name]
        if name == "mask_from_x":
            args = (0,)
        else:
            first = mutable if op.inplace else by_kind[op.ins[0]]
            args = (draw(st.sampled_from(first)),)
            for kind in op.ins[1:]:
                pool = by_kind[kind]
                if op.inplace:  # reading memory it writes would overlap
                    pool = [n for n in pool if slots[n].group != slots[args[0]].group]
                if not pool:
                    break
                args += (draw(st.sampled_from(pool)),)
            if len(args) != len(op.ins):
                continue
        upcast = op.params and slots[args[0]].dtype != torch.float32
        rebind = draw(st.booleans()) if op.inplace else True
        float_args = [slots[a] for a in args if slots[a].kind == "f"]
        # casts (the op's own, an upcast, type_as in matmul2) read these groups
        if op.cast is not None or upcast:
            touched.add(slots[args[0]].group)
        if name == "matmul2":
            touched.update(s.group for s in float_args)
        if op.inplace and slots[args[0]].is_input_x:
            x_mutated = True
        if op.out == "f":
            dtypes = [torch.float32] if upcast else [s.dtype for s in float_args] or [torch.float32]
            dtype = _result_dtype(op, dtypes)
        else:
            dtype = None
        aliases = op.inplace or op.category == "view" or op.cast is not None
        group = slots[args[0]].group if aliases else len(slots)
        slots.append(_Slot(op.out, dtype, group, is_input_x=aliases and slots[args[0]].is_input_x))
        steps.append(Step(name, args, upcast, rebind))
    last = len(slots) - 1
    extra = draw(st.lists(st.sampled_from(range(len(slots))), max_size=2, unique=True))
    outputs = tuple(dict.fromkeys([last, *extra]))
    return Program(tuple(inputs), tuple(steps), outputs)
