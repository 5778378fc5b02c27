"""Rewrite: give an O2/O3 module low-precision parameters and buffers, once.

At O2 and O3 the converted module owns low-precision copies of the model's
floating parameters and buffers (``convert`` hands this pass a copy, so the
user's model keeps its fp32 tensors, which become the fp32 masters at O2).
Under ``keep_batchnorm_fp32`` the parameters and statistics of
normalisation ops stay fp32: the ops whose registry row has a ``norm``,
custom ops ``amp_fx.register_op(..., norm=)`` gave one included.  Which
tensors belong to a norm is read from the graph (the tensors a norm node
consumes, or the whole leaf module it calls), so it works on symbolic and
``torch.export`` graphs alike.

Buffers: ``convert`` hands over a copy whose buffers are the model's own
tensors (:mod:`amp_fx.converter.buffer_state`), so a buffer is never re-typed in
place: a buffer cast low becomes a new tensor of the converted module, and one
that keeps its dtype stays the model's.  A floating buffer the forward writes
in place outside a norm (an EMA, a float step counter) keeps its dtype:
accumulated state would lose precision at every update in the low dtype
(autocast keeps it fp32 too).

Records ``ctx.source_dtypes``: state-dict key -> original dtype (every key
of a tensor held under two names, tied weights included), so
``state_dict()`` can hand back the model's dtypes.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.node import map_arg

from amp_fx.ir import meta, op_properties
from amp_fx.ir.analysis import alias_root
from amp_fx.ir.dtype_constants import holds_dtype_extreme
from amp_fx.ir.pass_manager import PassContext, PassResult, amp_pass

__all__ = ["cast_params", "norm_tensor_names"]


def norm_tensor_names(gm: fx.GraphModule) -> set[str]:
    """Names of the parameters and buffers that normalisation ops consume (the op registry's ``norm`` rows)."""
    names: set[str] = set()
    for node in gm.graph.nodes:
        if op_properties.of(meta.OP.get(node)).norm is None:
            continue
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            prefix = f"{node.target}."
            names.update(prefix + n for n, _ in module.named_parameters())
            names.update(prefix + n for n, _ in module.named_buffers())
        map_arg((node.args, node.kwargs), lambda n: names.add(n.meta[meta.PARAM]) if meta.PARAM.get(n) else None)
    return names


def _written_tensors(gm: fx.GraphModule) -> set[int]:
    """ids of the parameters and buffers the forward writes into: in-place ops, ``out=``, declared writes, through views."""
    written: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.meta.get(meta.INPLACE) and node.args and isinstance(node.args[0], fx.Node):
            written.append(node.args[0])
        if isinstance(node.kwargs.get("out"), fx.Node):
            written.append(node.kwargs["out"])
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        for i, argument in enumerate(schema.arguments if schema is not None else ()):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, fx.Node):
                written.append(value)
    ids = set()
    for root in {alias_root(node) for node in written}:
        if root.op == "get_attr":
            try:
                ids.add(id(gm.get_buffer(str(root.target))))
            except AttributeError:
                try:
                    ids.add(id(gm.get_parameter(str(root.target))))
                except AttributeError:
                    pass
    return ids


def _replace_buffer(gm: fx.GraphModule, names: list[str], tensor: torch.Tensor) -> None:
    """Register ``tensor`` under every name of a buffer (the old tensor may be the model's: never re-typed)."""
    for name in names:
        owner, _, leaf = name.rpartition(".")
        (gm.get_submodule(owner) if owner else gm)._buffers[leaf] = tensor


@amp_pass(kind="rewrite", requires=("meta", "paint"), invalidates=("dtypes",))
def cast_params(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """Cast floating parameters and buffers to the low dtype (norms kept fp32 when asked, written buffers kept)."""
    low = ctx.low
    norms = norm_tensor_names(gm)
    keep = set(norms) if ctx.config.keep_batchnorm_fp32 else set()
    # read only by the model's autocast(enabled=False) regions (honour_autocast_regions marks them): stay fp32
    keep |= {n.meta[meta.PARAM] for n in gm.graph.nodes if meta.KEEP_FP32.get(n) and meta.PARAM.get(n)}
    written = _written_tensors(gm)
    source_dtypes = ctx.source_dtypes
    cast = 0
    kept_float64: list[str] = []
    kept_written: list[str] = []
    # Each tensor once, with every name it has (a tied weight is one tensor under two keys).
    tensors: dict[int, tuple[torch.Tensor, list[str], bool]] = {}
    for is_param, named in ((True, gm.named_parameters(remove_duplicate=False)), (False, gm.named_buffers(remove_duplicate=False))):
        for name, tensor in named:
            tensors.setdefault(id(tensor), (tensor, [], is_param))[1].append(name)
    for tensor, names, is_param in tensors.values():
        if tensor.dtype == torch.float64:  # never cast, as autocast never casts float64
            kept_float64.append(names[0])
            continue
        if not tensor.is_floating_point() or tensor.dtype == low or keep.intersection(names):
            continue
        if not is_param and any(holds_dtype_extreme(name, tensor, low) for name in names):
            continue  # torch.tensor(finfo(fp32).min) frozen by the trace: retarget_dtype_constants gives it low's value
        if not is_param and id(tensor) in written and not norms.intersection(names):
            kept_written.append(names[0])
            continue
        for name in names:
            source_dtypes.setdefault(name, tensor.dtype)
        if is_param:
            tensor.data = tensor.data.to(low)  # the parameter is the converted module's own copy
        else:
            _replace_buffer(gm, names, tensor.detach().to(low))
        cast += 1
    for node in gm.graph.nodes:
        name = meta.PARAM.get(node)
        if node.op == "get_attr" and name and meta.is_float(node):
            attr = gm
            for atom in name.split("."):
                attr = getattr(attr, atom)
            meta.ORIG_DTYPE.set(node, attr.dtype)
            if attr.dtype != getattr(node.meta.get("val"), "dtype", attr.dtype):
                del node.meta["val"]  # a stale fp32 example value would make a later run cast it again
    stats = {"tensors_cast": cast, "kept_fp32": len(keep), "kept_float64": kept_float64, "kept_written": kept_written}
    if kept_written:
        stats["report_lines"] = [f"buffers written in place in forward keep their dtype (shared with the model): {', '.join(kept_written)}"]
    return PassResult(gm, cast > 0, stats)
