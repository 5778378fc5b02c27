"""The summary a person reads first: GEMM FLOPs in low precision, casts, parameter and activation bytes.

FLOPs and activation sizes need shapes: the converted graph is run once on
fake tensors (no memory, no compute) with :class:`torch.utils.flop_counter.FlopCounterMode`
counting each node's GEMM FLOPs (matmul, linear, conv, attention), and the
dtype a GEMM ran in is the dtype of its result.  Inputs come from
``example_inputs`` or, when ``convert`` was given example inputs, from the
shapes recorded on the graph inputs; without either, those figures are
"unknown".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence, Union

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from amp_fx.ir import gemm_rows, meta, op_properties
from amp_fx.ir.cast_nodes import is_inserted_cast
from amp_fx.inspection.values import plain_containers
from amp_fx.converter.report import ConversionReport, build_report
from amp_fx.passes.propagate_meta import eval_mode
from amp_fx.errors import AmpTypeError

__all__ = ["summary", "Summary"]

_CALLS = ("call_function", "call_method", "call_module")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _human(n: Optional[float], unit: str = "B") -> str:
    if n is None:
        return "unknown"
    for prefix in ("", "K", "M", "G", "T"):
        if abs(n) < 1024 or prefix == "T":
            return f"{n:.0f} {unit}" if prefix == "" else f"{n:.1f} {prefix}{unit}"
        n /= 1024
    return f"{n} {unit}"


def _flops(n: Optional[int]) -> str:
    if n is None:
        return "unknown"
    for prefix, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {prefix}FLOP"
    return f"{n} FLOP"


@dataclass
class Summary:
    """Headline figures of one conversion (``str()`` prints them; ``to_dict()`` is JSON-ready)."""

    level: str
    dtype: Optional[str]
    decisions: dict[str, int]
    casts: int
    weight_casts: int
    cast_bytes: Optional[int]
    gemm_flops: dict[str, int] = field(default_factory=dict)  # dtype -> GEMM FLOPs per forward
    params: dict[str, dict[str, int]] = field(default_factory=dict)  # dtype -> {"tensors", "elements", "bytes"}
    buffers: dict[str, dict[str, int]] = field(default_factory=dict)
    master_bytes: int = 0  # fp32 master weights kept outside the module (O2)
    activations: dict[str, int] = field(default_factory=dict)  # dtype -> bytes of values made per forward
    shapes_known: bool = False
    unknown_ops: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    fp8_gemms: int = 0  # GEMMs run as scaled fp8 GEMMs (passes/fp8_gemms.py)
    fp8_flop_share: Optional[float] = None  # their share of GEMM FLOPs, from the GEMMs' shapes
    fp8_candidates: Optional[int] = None  # the GEMMs fp8 was decided for, when fp8 was asked (fp8= or a policy)

    @property
    def low_flop_share(self) -> Optional[float]:
        """Share of GEMM FLOPs that ran in a low dtype (None when unknown or no GEMM)."""
        total = sum(self.gemm_flops.values())
        if not self.shapes_known or total == 0:
            return None
        return sum(v for k, v in self.gemm_flops.items() if k in ("float16", "bfloat16")) / total

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, with ``low_flop_share`` included."""
        return dict(asdict(self), low_flop_share=self.low_flop_share)

    def __str__(self) -> str:
        share = self.low_flop_share
        total = sum(self.gemm_flops.values()) if self.shapes_known else None
        if share is not None:
            gemm = f"{share:.1%} of {_flops(total)} in low precision (" + ", ".join(
                f"{k} {_flops(v)}" for k, v in sorted(self.gemm_flops.items())) + ")"
        elif self.shapes_known:
            gemm = "no GEMMs"
        else:
            gemm = "unknown (needs shapes: pass example_inputs)"
        d = self.decisions
        lines = [
            f"amp_fx summary: level {self.level}, low dtype {self.dtype}",
            f"  GEMM FLOPs per forward: {gemm}",
            f"  nodes: low {d.get('low', 0)}, fp32 {d.get('fp32', 0)}, follow {d.get('follow', 0)}, promote {d.get('promote', 0)}",
            f"  casts per forward: {self.casts} ({self.weight_casts} of weights), {_human(self.cast_bytes)} read+written",
            "  parameters: " + (", ".join(f"{k} {v['tensors']} tensors / {v['elements']:,} elements / {_human(v['bytes'])}"
                                          for k, v in sorted(self.params.items())) or "none"),
        ]
        if self.buffers:
            lines.append("  buffers: " + ", ".join(f"{k} {_human(v['bytes'])}" for k, v in sorted(self.buffers.items())))
        if self.master_bytes:
            lines.append(f"  fp32 master weights: {_human(self.master_bytes)}")
        if self.shapes_known:
            lines.append("  activations made per forward (upper bound of what autograd keeps): "
                         + (", ".join(f"{k} {_human(v)}" for k, v in sorted(self.activations.items())) or "none"))
        else:
            lines.append("  activations: unknown (needs shapes: pass example_inputs)")
        if self.fp8_gemms or self.fp8_candidates is not None:
            share = "" if self.fp8_flop_share is None else f", {self.fp8_flop_share:.1%} of GEMM FLOPs"
            of = "" if self.fp8_candidates is None else f" of {self.fp8_candidates}"
            lines.append(f"  fp8 GEMMs: {self.fp8_gemms}{of}{share}")
        if self.unknown_ops:
            lines.append(f"  ops in no table (decided by the level or on_unknown_op, a custom op by its inputs' "
                         f"dtypes: the report's rows say how): {self.unknown_ops}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def _by_dtype(tensors: Sequence[torch.Tensor]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for t in tensors:
        row = out.setdefault(_name(t.dtype), {"tensors": 0, "elements": 0, "bytes": 0})
        row["tensors"] += 1
        row["elements"] += t.numel()
        row["bytes"] += t.numel() * t.element_size()
    return out




def _inputs_from_meta(gm: fx.GraphModule) -> Optional[list]:
    """Zero tensors shaped like the graph inputs, when ``convert`` recorded their shapes; else None."""
    shapes = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        shape, dtype = meta.shape(node), meta.ORIG_DTYPE.get(node)
        if meta.is_tensor(node) is False and node.args:
            shapes.append(("default", node.args[0]))
            continue
        if shape is None or not isinstance(dtype, torch.dtype):
            return None
        shapes.append((tuple(int(s) for s in shape), dtype))
    return [value if shape == "default" else torch.zeros(shape, dtype=value) for shape, value in shapes]


class _Measure(fx.Interpreter):
    """Runs the graph on fake tensors, recording each node's GEMM FLOPs and result."""

    def __init__(self, gm: fx.GraphModule, counter: Any):
        super().__init__(gm, garbage_collect_values=False)
        self.counter = counter
        self.flops: dict[fx.Node, int] = {}

    def fetch_args_kwargs_from_env(self, n: fx.Node) -> tuple[tuple, dict]:
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        return plain_containers(args), plain_containers(kwargs)

    def run_node(self, n: fx.Node) -> Any:
        before = self.counter.get_total_flops()
        result = super().run_node(n)
        self.flops[n] = self.counter.get_total_flops() - before
        return result


def _registered_gemm_formulas() -> dict:
    """FLOP formulas of register_op GEMMs (torch's counter sees a custom op, not the GEMM inside it)."""
    packets = {op: gemm_rows.op_packet(op) for op in op_properties.registered_gemms()}
    return {packet: gemm_rows.flop_formula(op_properties.registered_gemms()[op])
            for op, packet in packets.items() if packet is not None}


def _measure(gm: fx.GraphModule, inputs: Optional[Sequence[Any]], out: Summary) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with eval_mode(gm), mode:
            args = list(inputs) if inputs is not None else _inputs_from_meta(gm)
            if args is None:
                return
            counter = FlopCounterMode(display=False, custom_mapping=_registered_gemm_formulas())
            interpreter = _Measure(gm, counter)
            with counter:
                interpreter.run(*args)
    except Exception as error:  # the figures are optional: say why they are missing
        out.notes.append(f"shapes unknown: running the graph on fake inputs failed ({type(error).__name__}: {error})")
        return
    out.shapes_known = True
    cast_total = 0
    for node, value in interpreter.env.items():
        tensors = [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
        if interpreter.flops.get(node) and tensors:
            key = _name(next((t.dtype for t in tensors if t.is_floating_point()), tensors[0].dtype))
            out.gemm_flops[key] = out.gemm_flops.get(key, 0) + interpreter.flops[node]
        if node.op not in _CALLS:
            continue
        for t in tensors:
            if t._base is None:  # views share their base's memory
                out.activations[_name(t.dtype)] = out.activations.get(_name(t.dtype), 0) + t.numel() * t.element_size()
        if is_inserted_cast(node) and tensors and node.all_input_nodes:
            source = interpreter.env.get(node.all_input_nodes[0])
            if isinstance(source, torch.Tensor):
                cast_total += tensors[0].numel() * (source.element_size() + tensors[0].element_size())
    out.cast_bytes = cast_total


def summary(converted: Union[fx.GraphModule, ConversionReport], example_inputs: Optional[Sequence[Any]] = None) -> Summary:
    """Summarise a conversion: GEMM FLOP share in low precision, casts and their bytes, parameter and activation bytes.

    ``converted`` is what :func:`amp_fx.convert` returned (a report alone,
    e.g. the compiler backend's, gives the cast and decision counts only).
    ``example_inputs`` give the shapes; without them the shapes ``convert``
    recorded are used, and without those the FLOP and memory figures are
    unknown.  Nothing is computed for real: the graph runs on fake tensors.
    """
    if isinstance(converted, ConversionReport):
        report, gm = converted, None
    elif isinstance(converted, fx.GraphModule):
        gm = converted
        report = getattr(gm, "amp_report", None) or build_report(gm, level="?", dtype=None, route="?", passes={})
    else:
        raise AmpTypeError(f"summary expects a converted module or its ConversionReport, got {type(converted).__name__}")
    totals = report.totals()
    out = Summary(
        level=report.level, dtype=report.dtype,
        decisions={d: totals[f"{d}_nodes"] for d in ("low", "fp32", "follow", "promote")},
        casts=totals["casts_inserted"], weight_casts=totals["weight_casts"], cast_bytes=totals["cast_bytes_per_forward"],
        unknown_ops=dict(totals["unknown_ops"]),
    )
    fp8 = report.passes.get("fp8_gemms", {})
    out.fp8_gemms, out.fp8_flop_share = fp8.get("fp8", 0), fp8.get("fp8_flop_share") if fp8.get("fp8") else None
    out.fp8_candidates = fp8.get("candidates") if fp8.get("asked") else None  # "0 of 2" says fp8 was asked, and missed
    if gm is None:
        out.notes.append("from a report alone: pass the converted module for FLOPs, parameters and memory")
        return out
    out.params = _by_dtype([p for _, p in gm.named_parameters()])
    out.buffers = _by_dtype([b for _, b in gm.named_buffers()])
    masters = getattr(gm, "amp_fx_masters", None) or {}
    out.master_bytes = sum(t.numel() * t.element_size() for t in masters.values())
    _measure(gm, example_inputs, out)
    return out
