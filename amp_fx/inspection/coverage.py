"""``amp_fx.coverage``: the share of GEMM FLOPs that actually ran in each dtype, measured where the kernels run.

A conversion report says what amp_fx *decided*; code that runs outside a
graph (a Dynamo graph break, a frame Dynamo skipped) or a model that was
never converted (plain ``torch.autocast``) has no report.  This module
counts at dispatch instead: a ``TorchDispatchMode`` sees every ATen op that
runs, below autocast and autograd, on every route (a converted module, a
``torch.compile``\\ d one, eager autocast), so the numbers of two routes can
be compared.

Counted ops are the GEMMs of :data:`torch.utils.flop_counter.flop_registry`
(``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``convolution`` and its backward,
``_scaled_mm``, the fused scaled-dot-product-attention kernels and their
backwards), CPU's fused attention kernel and its backward
(``_scaled_dot_product_flash_attention_for_cpu``: 2·B·H·L·S·(E+Ev) forward,
twice that backward, causal masks not discounted), ``mv``, ``dot`` and
``vdot`` (``a @ v``, ``v @ v``), ``_trilinear`` (``F.bilinear``), plus oneDNN's fused LSTM layer (``mkldnn_rnn_layer``, which is
how CPU autocast runs a bf16 ``nn.LSTM``) and its backward.  ``linear`` and ``matmul`` reach
dispatch as ``addmm``/``mm``/``bmm``.  An op's dtype is that of its first
tensor input (``_scaled_mm``'s fp8 operands count as fp8).  GEMMs that
inductor fuses into its own kernels never reach dispatch and are not seen.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from amp_fx.errors import AmpTypeError
from amp_fx.graph_ops.outer_autocast import no_outer_autocast
from amp_fx.ir import gemm_rows, op_properties

__all__ = ["Coverage", "GemmCounter", "coverage"]

_LOW = (torch.float16, torch.bfloat16)


def _lstm_layer_flops(args: tuple, kwargs: dict, out: Any) -> int:
    """``mkldnn_rnn_layer(input, w_ih, w_hh, ...)``: 2·T·B·4H·(I+H) multiply-adds for one direction of one layer."""
    input, w_ih, w_hh = args[0], args[1], args[2]
    steps_and_batch = input.numel() // input.shape[-1]
    return 2 * steps_and_batch * (w_ih.numel() + w_hh.numel())


def _cpu_attention_flops(args: tuple, kwargs: dict, out: Any) -> int:
    """CPU's fused SDPA kernel on q (B,H,L,E), k (B,H,S,E), v (B,H,S,Ev): Q·Kᵀ and P·V, 2·B·H·L·S·(E+Ev).

    A causal mask is not discounted (torch's flop counter does not either).
    """
    query, key, value = args[0], args[1], args[2]
    batch_heads_rows = query.numel() // query.shape[-1]  # B·H·L
    return 2 * batch_heads_rows * key.shape[-2] * (query.shape[-1] + value.shape[-1])


def _cpu_attention_backward_flops(args: tuple, kwargs: dict, out: Any) -> int:
    """The fused SDPA backward (grad_out, q, k, v, ...): the gradients of both GEMMs of each side, twice the forward."""
    return 2 * _cpu_attention_flops(args[1:4], kwargs, out)


def _trilinear_flops(args: tuple, kwargs: dict, out: Any) -> int:
    """``_trilinear`` (what ``F.bilinear`` runs): one multiply-add per point of the three inputs' joint index space.

    Each input is unsqueezed at its ``expand`` dims, so the three broadcast to
    that space (N·O·I·J for bilinear's input1 (N,I), weight (O,I,J), input2 (N,J)).
    """
    shapes = []
    for tensor, expand in zip(args[:3], args[3:6]):
        shape = list(tensor.shape)
        for dim in sorted(expand):
            shape.insert(dim, 1)
        shapes.append(shape)
    points = 1
    for size in torch.broadcast_shapes(*shapes):
        points *= size
    return 2 * points


def _shape_of(value: Any) -> Any:
    return value.shape if isinstance(value, torch.Tensor) else value


def _formulas() -> dict:
    from torch.utils.flop_counter import flop_registry

    formulas: dict[Any, Callable] = {}
    for packet, formula in flop_registry.items():
        formulas[packet] = lambda args, kwargs, out, _formula=formula: _formula(*args, **kwargs, out_val=out)
    extra = {
        "_scaled_dot_product_flash_attention_for_cpu": _cpu_attention_flops,
        "_scaled_dot_product_flash_attention_for_cpu_backward": _cpu_attention_backward_flops,
        "mv": lambda args, kwargs, out: 2 * args[0].numel(),  # (M,N)·(N): M·N multiply-adds
        "dot": lambda args, kwargs, out: 2 * args[0].numel(),
        "vdot": lambda args, kwargs, out: 2 * args[0].numel(),
        "_trilinear": _trilinear_flops,
    }
    for name, formula in extra.items():
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None and packet not in formulas:
            formulas[packet] = formula
    for op, sig in op_properties.registered_gemms().items():  # register_op GEMMs: opaque to torch's counter
        packet, formula = gemm_rows.op_packet(op), gemm_rows.flop_formula(sig)
        if packet is not None:
            formulas[packet] = lambda args, kwargs, out, _formula=formula: _formula(
                *tree_map(_shape_of, args), out_shape=_shape_of(out), **tree_map(_shape_of, kwargs))
    rnn_layer = getattr(torch.ops.aten, "mkldnn_rnn_layer", None)
    if rnn_layer is not None:
        formulas[rnn_layer] = _lstm_layer_flops
    rnn_backward = getattr(torch.ops.aten, "mkldnn_rnn_layer_backward", None)
    if rnn_backward is not None:  # the gradients of the inputs and of the weights: twice the forward's GEMMs
        formulas[rnn_backward] = lambda args, kwargs, out: 2 * _lstm_layer_flops(args, kwargs, out)
    return formulas


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclasses.dataclass
class Coverage:
    """GEMM FLOPs by dtype, and by op and dtype, counted at dispatch over one measured run.

    ``flops`` maps a dtype name (``"bfloat16"``, ``"float32"``,
    ``"float8_e4m3fn"``) to FLOPs; ``by_op`` maps ``(op, dtype)`` to FLOPs;
    ``calls`` maps ``(op, dtype)`` to the number of calls.
    """

    flops: dict[str, int] = dataclasses.field(default_factory=dict)
    by_op: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    calls: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> int:
        """All GEMM FLOPs counted."""
        return sum(self.flops.values())

    def share(self, dtype: Any) -> float:
        """The share (0..1) of GEMM FLOPs that ran in ``dtype`` (a torch.dtype or its name); 0.0 when nothing ran."""
        name = _dtype_name(dtype) if isinstance(dtype, torch.dtype) else str(dtype)
        return self.flops.get(name, 0) / self.total if self.total else 0.0

    @property
    def low_share(self) -> float:
        """The share of GEMM FLOPs that ran in a 16-bit or 8-bit float dtype (anything below fp32)."""
        if not self.total:
            return 0.0
        wide = ("float32", "float64")
        return sum(f for name, f in self.flops.items() if name not in wide) / self.total

    def add(self, op: str, dtype: torch.dtype, flops: int) -> None:
        """Count one GEMM call."""
        name = _dtype_name(dtype)
        self.flops[name] = self.flops.get(name, 0) + flops
        self.by_op[(op, name)] = self.by_op.get((op, name), 0) + flops
        self.calls[(op, name)] = self.calls.get((op, name), 0) + 1

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        return {"total_flops": self.total, "low_share": self.low_share, "flops": dict(self.flops),
                "by_op": [{"op": op, "dtype": dtype, "flops": f, "calls": self.calls[(op, dtype)]}
                          for (op, dtype), f in sorted(self.by_op.items())]}

    def __str__(self) -> str:
        if not self.total:
            return "GEMM coverage: no GEMM ran"
        lines = [f"GEMM coverage: {self.low_share:.1%} of {_flops(self.total)} ran below fp32"]
        for name, f in sorted(self.flops.items(), key=lambda item: -item[1]):
            lines.append(f"  {name:>14}: {f / self.total:6.1%}  ({_flops(f)})")
        for (op, name), f in sorted(self.by_op.items(), key=lambda item: -item[1]):
            lines.append(f"    {op} {name}: {self.calls[(op, name)]} call(s), {_flops(f)}")
        return "\n".join(lines)

    __repr__ = __str__


def _flops(count: int) -> str:
    for unit, size in (("GFLOP", 10 ** 9), ("MFLOP", 10 ** 6), ("kFLOP", 10 ** 3)):
        if count >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count} FLOP"


class GemmCounter(TorchDispatchMode):
    """A dispatch mode that adds every GEMM that runs to a :class:`Coverage`.

    Use it as a context manager around any code (``with GemmCounter() as c:
    ...; print(c.coverage)``).  Dynamo keeps compiling and running compiled
    code under it (it declares itself invisible to compile internals), and
    fake tensors Dynamo traces with are not counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.coverage = Coverage()
        self._formulas = _formulas()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Without this, Dynamo stops compiling (and runs eagerly) any frame while the mode is on the stack.
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self._formulas.get(func.overloadpacket)
        if formula is not None:
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if tensors and not any(isinstance(t, torch._subclasses.FakeTensor) for t in tensors):
                self.coverage.add(func.overloadpacket.__name__, tensors[0].dtype, int(formula(args, kwargs, out)))
        return out


def coverage(model: Callable, *args: Any, backward: bool = False, loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
             **kwargs: Any) -> Coverage:
    """Run ``model(*args, **kwargs)`` once and return the share of GEMM FLOPs that ran in each dtype.

    Works on any callable: an ``amp_fx.convert``\\ ed module, a
    ``torch.compile``\\ d one (compile it with a warm-up call first if its
    compilation should not be measured: compiling runs no real GEMM, so it
    is not counted either way), or an eager model inside your own
    ``torch.autocast`` block, for comparison.

    Args:
        backward: also run the backward pass (of ``loss_fn(output)``, or of
            the sum of the output's floating-point tensors) and count its
            GEMMs.  Gradients accumulate into ``.grad`` as in training.  The
            loss and the backward run outside any autocast the caller entered
            (the forward inside it), as a training step runs them: under
            autocast, the backward of an ``enabled=False`` region would run low.
        loss_fn: turns the output into a scalar loss; implies ``backward``.
    """
    if not callable(model):
        raise AmpTypeError(f"coverage() measures a callable model, got {type(model).__name__}")
    backward = backward or loss_fn is not None
    with GemmCounter() as counter:
        output = model(*args, **kwargs)
        if backward:
            with no_outer_autocast():  # as a training step runs them: after the forward's autocast block
                loss = loss_fn(output) if loss_fn is not None else _sum_of(output)
                loss.backward()
    return counter.coverage


def _sum_of(output: Any) -> torch.Tensor:
    tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not tensors:
        raise AmpTypeError("coverage(backward=True) found no output tensor that requires grad; pass loss_fn=")
    return sum(t.float().sum() for t in tensors)
