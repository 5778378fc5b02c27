"""torch's alias ops get their target's rule: ``torch.special.expm1`` is decided as ``expm1``, as autocast decides it.

Before amp_fx/ir/op_aliases.py an alias was an unknown op: it followed its
input (bf16) where autocast, which sees only the target (the alias is a
CompositeImplicitAutograd call of it), runs the target in fp32.
"""

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import amp_fx
from amp_fx.ir import op_keys, tables
from amp_fx.ir.op_aliases import ALIASES


class _Calls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


_SAMPLES = {"Tensor": lambda: torch.rand(3, 3) + 0.5, "Scalar": lambda: 2, "int": lambda: 1, "float": lambda: 0.5,
            "bool": lambda: False}


def _decomposes_to(op):
    """The one op torch runs for ``op`` (CompositeImplicitAutograd) on a small sample, or None."""
    args = op._schema.arguments
    if any(a.is_out or (a.kwarg_only and not a.has_default_value()) for a in args):
        return None
    needed = [a for a in args if not a.kwarg_only and not a.has_default_value()]
    if any(str(a.type) not in _SAMPLES for a in needed):
        return None
    samples = [_SAMPLES[str(a.type)]() for a in needed]  # made outside the recording: only op's own calls count
    calls = _Calls()
    try:
        with calls:
            op(*samples)
    except Exception:  # a sample this op does not take: no evidence either way
        return None
    called = [f for f in calls.ops if f._opname not in ("detach", "alias", "lift_fresh")]
    return called[0] if len(called) == 1 else None


def _signatures(packet):
    return {tuple(str(a.type) for a in getattr(packet, name)._schema.arguments) for name in packet.overloads()}


def _dispatcher_aliases():
    """{alias: target} for every unlisted ATen op torch runs as one call of another op with the same arguments."""
    found = {}
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, rest = qualified.partition("::")
        name, _, overload = rest.partition(".")
        if namespace != "aten" or name.startswith("_") or name.endswith("_") or tables.table_of(name) != "unknown":
            continue
        try:
            if not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeImplicitAutograd"):
                continue
            op = getattr(getattr(torch.ops.aten, name), overload or "default")
        except (AttributeError, RuntimeError):
            continue
        target = _decomposes_to(op)
        if target is None or target._opname == name:
            continue
        target_packet = getattr(torch.ops.aten, target._opname)
        if _signatures(getattr(torch.ops.aten, name)) & _signatures(target_packet):
            found[name] = target._opname
    return found


def test_every_alias_torch_runs_as_a_listed_op_is_listed():
    """Torch's dispatcher, not a list, says which ops are aliases: each whose target is in a table is resolved."""
    missing = {}
    found = _dispatcher_aliases()
    # torch 2.13 has 52 (special_expm1, arccos, ...): an empty or shrunken set means the search broke, not that
    # every alias is listed (its samples were once made inside the recording and it found none).
    assert len(found) == 52 if torch.__version__.startswith("2.13.") else len(found) >= 40, sorted(found)
    assert {"special_expm1": "expm1", "arccos": "acos", "special_i0": "i0"}.items() <= found.items()
    for alias, target in found.items():
        canonical = op_keys.op_name_of(f"aten.{target}")
        resolved = op_keys.op_name_of(f"aten.{alias}")
        # Decided as its target: the same table (linalg_matmul is matmul, which on 2-D samples runs as mm: both low).
        if tables.table_of(canonical) in ("low", "fp32", "promote") and tables.table_of(resolved) != tables.table_of(canonical):
            missing[alias] = canonical
    # eigvals is one linalg_eig call but not an alias of it (it returns only the eigenvalues)
    missing.pop("linalg_eigvals", None)
    assert not missing, f"aliases decided as unknown ops, add them to amp_fx/ir/op_aliases.py: {missing}"
    for alias, target in ALIASES.items():
        assert hasattr(torch.ops.aten, alias) and hasattr(torch.ops.aten, target), (alias, target)
        assert tables.table_of(alias) == "unknown", f"{alias} has its own table entry: not an alias to list"
        assert tables.table_of(target) != "unknown", f"{alias}'s target {target} is in no table: leave it unlisted"


def _x():
    return torch.rand(4, 4) * 0.5 + 0.25


# Per alias whose target is in a LOW, FP32 or PROMOTE table: (a call of the alias, the same call of its target).
CALLS = {
    "special_expm1": (lambda x, y: torch.special.expm1(x), lambda x, y: torch.expm1(x)),
    "special_log1p": (lambda x, y: torch.special.log1p(x), lambda x, y: torch.log1p(x)),
    "special_erfinv": (lambda x, y: torch.special.erfinv(x), lambda x, y: torch.erfinv(x)),
    "special_log_softmax": (lambda x, y: torch.special.log_softmax(x, 0), lambda x, y: torch.log_softmax(x, 0)),
    "special_softmax": (lambda x, y: torch.special.softmax(x, 0), lambda x, y: torch.softmax(x, 0)),
    "special_logsumexp": (lambda x, y: torch.special.logsumexp(x, 0), lambda x, y: torch.logsumexp(x, 0)),
    "arccos": (lambda x, y: torch.arccos(x), lambda x, y: torch.acos(x)),
    "arcsin": (lambda x, y: x.arcsin(), lambda x, y: x.asin()),
    "arctan2": (lambda x, y: torch.arctan2(x, y), lambda x, y: torch.atan2(x, y)),
    "concat": (lambda x, y: torch.concat([x, y]), lambda x, y: torch.cat([x, y])),
    "concatenate": (lambda x, y: torch.concatenate([x, y]), lambda x, y: torch.cat([x, y])),
    "linalg_matmul": (lambda x, y: torch.linalg.matmul(x, y), lambda x, y: torch.matmul(x, y)),
    "det": (lambda x, y: torch.det(x + 2 * torch.eye(4)), lambda x, y: torch.linalg.det(x + 2 * torch.eye(4))),
    "inverse": (lambda x, y: torch.inverse(x + 2 * torch.eye(4)), lambda x, y: torch.linalg.inv(x + 2 * torch.eye(4))),
    "slogdet": (lambda x, y: torch.slogdet(x + 2 * torch.eye(4))[1],
                lambda x, y: torch.linalg.slogdet(x + 2 * torch.eye(4))[1]),
    "pinverse": (lambda x, y: torch.pinverse(y), lambda x, y: torch.linalg.pinv(y)),  # no bf16 kernel on CPU
}


def test_every_alias_with_a_decided_target_has_a_case():
    decided = {a for a, t in ALIASES.items() if tables.table_of(t) in ("low", "fp32", "promote")}
    assert decided == set(CALLS), decided ^ set(CALLS)


class _One(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, y):
        return self.fn(x.to(torch.bfloat16), y)  # the op reads a bf16 value and an fp32 one


def _runs(fn, route, x, y):
    """(amp_fx's O1 output dtype, its report rows for the op, torch.autocast's output dtype), bf16 on CPU."""
    model = _One(fn)
    with torch.autocast("cpu", torch.bfloat16):
        autocast_dtype = model(x, y).dtype
    kwargs = {"example_inputs": (x, y)} if route == "export" else {}
    gm = amp_fx.convert(model, level="O1", dtype=torch.bfloat16, cast_model_outputs=None, **kwargs)
    rows = [(r.op, r.decision, r.rule) for r in gm.amp_report.nodes if not r.inserted and r.decision not in ("none",)
            and r.op not in ("to", "add", "mul", "eye", "getitem")]
    return gm(x, y).dtype, rows, autocast_dtype, gm.amp_report.unknown_ops


@pytest.mark.parametrize("alias", sorted(CALLS))
@pytest.mark.parametrize("route", ["symbolic", "export"])
def test_an_alias_is_decided_as_its_target_as_autocast_decides_it(alias, route):
    """The alias and its target: the same amp_fx decision and dtype, and the same torch.autocast dtype.

    amp_fx's tables are CUDA autocast's; CPU autocast (this test's reference) runs
    some of them in bf16 (acos, asin, erfinv, ...): where it does, it does so for
    the alias too, and where it agrees with the table on the target it agrees on
    the alias, which the direct comparison below checks.
    """
    x, y = _x(), _x()
    alias_fn, target_fn = CALLS[alias]
    got, rows, autocast, unknown = _runs(alias_fn, route, x, y)
    want, target_rows, autocast_target, _ = _runs(target_fn, route, x, y)
    assert not unknown, f"{alias} is an unknown op: {unknown}"
    assert rows == target_rows and rows, f"{alias}: {rows} against its target's {target_rows}"
    assert got == want, f"{alias}: amp_fx gives {got}, and {want} for its target"
    # Autocast decides the alias as its target, or (pinverse: CPU autocast lists the alias itself fp32, and
    # runs linalg_pinv as bf16 matmuls) as amp_fx does.
    assert autocast == autocast_target or got == autocast, f"{alias}: autocast {autocast}, target {autocast_target}"
    if want == autocast_target:
        assert got == autocast
