"""Map any fx node to a canonical op name such as ``"linear"`` or ``"softmax"``.

This is the one place that knows how the same op looks in different graphs:
``torch.matmul``, ``x.matmul``, ``x @ y`` (``operator.matmul``) and
``aten.matmul.default`` are all ``"matmul"``; ``nn.Linear`` as a leaf module,
``F.linear`` (which Dynamo shows as ``torch._C._nn.linear``) and
``aten.linear.default`` are all ``"linear"``.  Canonical names are the ATen
names used by PyTorch's autocast op reference, so one table serves every graph.
"""

from __future__ import annotations

import operator
import re
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.nn as nn
from torch._library.custom_ops import CustomOpDef

from amp_fx.ir.op_aliases import target_of  # torch's alias ops are their targets (special_expm1 is expm1)
from amp_fx.ir.op_properties import CAST_OPS  # ops that are themselves casts (re-exported; defined with every op property)

__all__ = ["canonical_op", "is_inplace", "CAST_OPS", "module_op_name", "op_name_of", "callable_op_name",
           "TORCH_NAMESPACES", "custom_overload", "is_custom_op"]

# Namespaces of PyTorch's own operators: their ops are named by the bare op name (``aten.mm.default``
# is ``"mm"``), so one table serves every route.  An op of any other namespace is a custom op
# (``torch.library``) and is named ``"ns::name"`` on every route: the qualified name torch itself
# uses, which no ATen name can collide with (``transformers::grouped_mm_fallback``).
TORCH_NAMESPACES = frozenset({
    "aten", "prims", "prim", "quantized", "_quantized", "quantized_decomposed", "quantization", "_quant",
    "mkldnn", "mkldnn_prepacked", "mkl", "onednn", "sparse", "symm_mem", "static_runtime", "c10d",
    "_c10d_functional", "_c10d_functional_autograd", "_dtensor", "inductor", "inductor_prims", "higher_order",
    "profiler", "debugprims", "rngprims", "_native", "debug_mode_ops", "export", "_test",
})

# ATen spellings that mean the same op as a torch-level name.
_ATEN_ALIASES = {
    "_softmax": "softmax",
    "_log_softmax": "log_softmax",
    "native_layer_norm": "layer_norm",
    "native_group_norm": "group_norm",
    "native_batch_norm": "batch_norm",
    "_native_batch_norm_legit": "batch_norm",
    "_native_batch_norm_legit_no_training": "batch_norm",
    "_native_batch_norm_legit_functional": "batch_norm",
    "cudnn_batch_norm": "batch_norm",
    "_batch_norm_with_update": "batch_norm",
    "_batch_norm_no_update": "batch_norm",
    "cross_entropy_loss": "cross_entropy",
    "_to_copy": "to",
    "_thnn_fused_lstm_cell": "lstm_cell",
    "_thnn_fused_gru_cell": "gru_cell",
    "_scaled_dot_product_flash_attention": "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention_for_cpu": "scaled_dot_product_attention",
    "_scaled_dot_product_efficient_attention": "scaled_dot_product_attention",
    "_scaled_dot_product_cudnn_attention": "scaled_dot_product_attention",
    "_native_multi_head_attention": "multi_head_attention",
    "grid_sampler_2d": "grid_sampler",
    "grid_sampler_3d": "grid_sampler",
    "_fused_rms_norm": "rms_norm",
    "index_put_": "index_put",
    "pow_": "pow",
}

# Python-level names (torch.nn.functional, torch.functional, Tensor methods)
# whose canonical ATen name differs.
_PY_ALIASES = {
    "multi_head_attention_forward": "multi_head_attention",
    "layer_norm_fp32_stats": "layer_norm",  # amp_fx's fused form (passes/fuse_precision.py), converted again
    "multi_dot": "linalg_multi_dot",
    "vecdot": "linalg_vecdot",
    "linalg_cross": "cross",
    "vector_norm": "linalg_vector_norm",
    "matrix_norm": "linalg_matrix_norm",
    "grid_sample": "grid_sampler",
    "upsample": "interpolate",
    "upsample_bilinear": "interpolate",
    "upsample_nearest": "interpolate",
    "__matmul__": "matmul",
    "__rmatmul__": "matmul",
    "__pow__": "pow",
    "__rpow__": "pow",
    "__rtruediv__": "rtruediv",
    "__rdiv__": "rtruediv",
    "true_divide": "div",
    "binary_cross_entropy_with_logits": "binary_cross_entropy_with_logits",
}

_OPERATOR_NAMES = {
    operator.matmul: "matmul",
    operator.add: "add",
    operator.iadd: "add",
    operator.sub: "sub",
    operator.isub: "sub",
    operator.mul: "mul",
    operator.imul: "mul",
    operator.truediv: "div",
    operator.itruediv: "div",
    operator.floordiv: "floor_divide",
    operator.pow: "pow",
    operator.neg: "neg",
    operator.getitem: "getitem",
    operator.setitem: "setitem",
    operator.mod: "remainder",
    operator.eq: "eq",
    operator.ne: "ne",
    operator.lt: "lt",
    operator.le: "le",
    operator.gt: "gt",
    operator.ge: "ge",
    operator.and_: "bitwise_and",
    operator.or_: "bitwise_or",
    operator.xor: "bitwise_xor",
    operator.invert: "bitwise_not",
    operator.abs: "abs",
}
_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.setitem}

# Module types, most specific first where subclasses share a base.
_MODULE_NAMES: list[tuple[type, Any]] = [
    (nn.Linear, "linear"),
    (nn.Bilinear, "bilinear"),
    (nn.Conv1d, "conv1d"),
    (nn.Conv2d, "conv2d"),
    (nn.Conv3d, "conv3d"),
    (nn.ConvTranspose1d, "conv_transpose1d"),
    (nn.ConvTranspose2d, "conv_transpose2d"),
    (nn.ConvTranspose3d, "conv_transpose3d"),
    (nn.LayerNorm, "layer_norm"),
    (nn.GroupNorm, "group_norm"),
    (nn.modules.batchnorm._BatchNorm, "batch_norm"),
    (nn.modules.instancenorm._InstanceNorm, "instance_norm"),
    (nn.LSTM, "lstm"),
    (nn.GRU, "gru"),
    (nn.RNN, lambda m: "rnn_relu" if m.nonlinearity == "relu" else "rnn_tanh"),
    (nn.LSTMCell, "lstm_cell"),
    (nn.GRUCell, "gru_cell"),
    (nn.RNNCell, lambda m: "rnn_relu_cell" if m.nonlinearity == "relu" else "rnn_tanh_cell"),
    (nn.MultiheadAttention, "multi_head_attention"),
    (nn.EmbeddingBag, "embedding_bag"),
    (nn.Embedding, "embedding"),
    (nn.PReLU, "prelu"),
    (nn.Softmax, "softmax"),
    (nn.LogSoftmax, "log_softmax"),
    (nn.Softmin, "softmin"),
    (nn.Softplus, "softplus"),
    (nn.Upsample, "interpolate"),
    (nn.CosineSimilarity, "cosine_similarity"),
    (nn.CrossEntropyLoss, "cross_entropy"),
    (nn.NLLLoss, "nll_loss"),
    (nn.MSELoss, "mse_loss"),
    (nn.L1Loss, "l1_loss"),
    (nn.SmoothL1Loss, "smooth_l1_loss"),
    (nn.HuberLoss, "huber_loss"),
    (nn.KLDivLoss, "kl_div"),
    (nn.BCELoss, "binary_cross_entropy"),
    (nn.BCEWithLogitsLoss, "binary_cross_entropy_with_logits"),
    (nn.PoissonNLLLoss, "poisson_nll_loss"),
    (nn.CosineEmbeddingLoss, "cosine_embedding_loss"),
    (nn.HingeEmbeddingLoss, "hinge_embedding_loss"),
    (nn.MarginRankingLoss, "margin_ranking_loss"),
    (nn.MultiLabelMarginLoss, "multilabel_margin_loss"),
    (nn.MultiMarginLoss, "multi_margin_loss"),
    (nn.SoftMarginLoss, "soft_margin_loss"),
    (nn.TripletMarginLoss, "triplet_margin_loss"),
    (nn.ReLU, "relu"),
    (nn.ReLU6, "relu6"),
    (nn.LeakyReLU, "leaky_relu"),
    (nn.SiLU, "silu"),
    (nn.GELU, "gelu"),
    (nn.ELU, "elu"),
    (nn.SELU, "selu"),
    (nn.CELU, "celu"),
    (nn.Hardswish, "hardswish"),
    (nn.Hardsigmoid, "hardsigmoid"),
    (nn.Hardtanh, "hardtanh"),
    (nn.Dropout, "dropout"),
    (nn.Identity, "identity"),
    (nn.Flatten, "flatten"),
]
if hasattr(nn, "RMSNorm"):
    _MODULE_NAMES.append((nn.RMSNorm, "rms_norm"))

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def module_op_name(module: nn.Module) -> str:
    """Return the canonical op name of a leaf module (``nn.Conv2d`` -> ``"conv2d"``).

    torch.nn modules not in the map get their class name in snake_case
    (``nn.GELU`` -> ``"gelu"``, ``nn.MaxPool2d`` -> ``"max_pool2d"``); user
    modules get their qualified class name, which no table lists.
    """
    for module_type, name in _MODULE_NAMES:
        if isinstance(module, module_type):
            return name(module) if callable(name) else name
    cls = type(module)
    if cls.__name__ == "GuardsFn" and cls.__module__.startswith("torch.export"):
        return "_guards_fn"  # the shape guards of an unlifted torch.export module
    if cls.__module__.startswith("torch.nn"):
        return _snake_op_name(cls)
    return f"{cls.__module__}.{cls.__qualname__}"


def _strip_inplace(name: str) -> tuple[str, bool]:
    if name.endswith("_") and not name.endswith("__") and len(name) > 1:
        return name[:-1], True
    return name, False


def _function_name(target: Callable, args: tuple) -> tuple[str, bool]:
    if target in _OPERATOR_NAMES:
        name = _OPERATOR_NAMES[target]
        # 1 / x and 2 ** x: autocast lists __rtruediv__ and __rpow__ as fp32.
        if name == "div" and args and not isinstance(args[0], fx.Node):
            name = "rtruediv"
        return name, target in _INPLACE_OPERATORS
    if isinstance(target, CustomOpDef):  # the function @torch.library.custom_op returns
        target = target._opoverload
    custom = custom_overload(target)
    if custom is not None:
        return _qualified_name(target), _writes_first_argument(custom)
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        raw = target._opname if isinstance(target, torch._ops.OpOverload) else target._qualified_op_name.split("::")[-1]
        if raw in _ATEN_ALIASES:
            return _ATEN_ALIASES[raw], raw.endswith("_") and not raw.startswith("_")
        name, inplace = _strip_inplace(raw)
        return target_of(_ATEN_ALIASES.get(name, name)), inplace
    raw = getattr(target, "__name__", None) or type(target).__name__
    name, inplace = _strip_inplace(raw)
    return target_of(_PY_ALIASES.get(name, name)), inplace


def _qualified_name(target: Any) -> str:
    """``"ns::name"`` of an OpOverload or OpOverloadPacket, without the overload."""
    return target._qualified_op_name if isinstance(target, torch._ops.OpOverloadPacket) else target._schema.name


def custom_overload(target: Any) -> Optional[torch._ops.OpOverload]:
    """The overload a call of a custom (non-PyTorch) op runs, or None for anything else.

    A packet (Dynamo and symbolic tracing record ``torch.ops.ns.name``) stands for its
    ``default`` overload, or its only one.
    """
    if isinstance(target, torch._ops.OpOverload):
        return target if target.namespace not in TORCH_NAMESPACES else None
    if isinstance(target, torch._ops.OpOverloadPacket):
        namespace = target._qualified_op_name.split("::")[0]
        names = target.overloads()
        if namespace in TORCH_NAMESPACES or not names:
            return None
        return getattr(target, "default" if "default" in names else names[0])
    return None


def is_custom_op(op: Optional[str]) -> bool:
    """True for a canonical name of a custom op (``"ns::name"``), which :func:`op_name_of` keeps as written."""
    return bool(op) and "::" in op


def _writes_first_argument(op: torch._ops.OpOverload) -> bool:
    """The op's schema says it writes its first argument (``mutates_args`` names it)."""
    arguments = op._schema.arguments
    alias = arguments[0].alias_info if arguments else None
    return bool(alias is not None and alias.is_write)


_DUNDER_INPLACE = frozenset({"add", "sub", "mul", "truediv", "floordiv", "matmul", "pow", "and", "or", "xor"})


def _module_type_op_name(module_type: type) -> str:
    """The canonical op name of a torch.nn module class, as :func:`module_op_name` names its instances."""
    for known, name in _MODULE_NAMES:
        if issubclass(module_type, known) and not callable(name):
            return name
    return _snake_op_name(module_type)


def _snake_op_name(module_type: type) -> str:
    """A torch.nn class's op name in snake_case: ``GELU`` -> ``"gelu"``, ``MaxPool2d`` -> ``"max_pool2d"``."""
    snake = _CAMEL.sub("_", module_type.__name__).lower()
    return snake.replace("pool", "_pool").replace("__", "_")


def op_name_of(spelling: str) -> str:
    """The canonical name of an op however a user spells it: ``"torch.matmul"``, ``"F.softmax"``, ``"x.softmax_"``, ``"aten.softmax.int"``.

    A custom op is ``"ns::name"``, also when spelt ``"torch.ops.ns.name"`` or ``"ns.name.default"``.
    """
    spelling = spelling.strip()
    if "::" in spelling:
        return spelling.split(".")[0]  # "ns::name.overload" names the op
    parts = spelling.split(".")
    if parts[:2] == ["torch", "ops"]:
        parts = parts[2:]
    if len(parts) in (2, 3) and parts[0] not in TORCH_NAMESPACES and parts[0] not in _SPELLING_ROOTS \
            and isinstance(_op_packet(parts[0], parts[1]), torch._ops.OpOverloadPacket):
        return f"{parts[0]}::{parts[1]}"  # "transformers.grouped_mm_fallback[.default]", as str(target) prints it
    if len(parts) >= 3 and parts[-3] == "aten":  # an overload: "aten.softmax.int", "torch.ops.aten.add_.Tensor"
        parts = parts[:-1]
    module_type = getattr(nn, parts[-1], None)
    if isinstance(module_type, type) and issubclass(module_type, nn.Module):  # "nn.LayerNorm", "Softmax"
        return _module_type_op_name(module_type)
    resolved = _torch_object(parts)
    if resolved is not None:  # "torch.special.erfcx" is the op a graph names "special_erfcx"
        return callable_op_name(resolved)
    last = parts[-1]
    if last.startswith("__") and last.endswith("__") and len(last) > 4:  # "__add__", "__iadd__"
        last = last[2:-2]
        last = last[1:] + "_" if last.startswith("i") and last[1:] in _DUNDER_INPLACE else last
    name, _ = _strip_inplace(last)
    return target_of(_ATEN_ALIASES.get(name, _PY_ALIASES.get(name, name)))


_SPELLING_ROOTS = {"torch": torch, "F": torch.nn.functional}


def _op_packet(namespace: str, name: str) -> Any:
    """``torch.ops.<namespace>.<name>`` if that op is registered (looking it up registers nothing), else None."""
    if f"{namespace}::{name}" not in _registered_names():
        return None
    return getattr(getattr(torch.ops, namespace), name, None)


def _registered_names() -> set:
    """The qualified names (``"ns::name"``, no overload) of every op the dispatcher knows now."""
    return {n.split(".")[0] for n in torch._C._dispatch_get_all_op_names()}


def _torch_object(parts: list[str]) -> Optional[Callable]:
    """The function a dotted torch spelling names (``torch.special.erfcx``, ``F.gelu``), or None."""
    if len(parts) < 2 or parts[0] not in _SPELLING_ROOTS or parts[:2] == ["torch", "ops"]:
        return None  # "aten.x" and "torch.ops.aten.x.overload" keep their own rule
    value: Any = _SPELLING_ROOTS[parts[0]]
    for part in parts[1:]:
        value = getattr(value, part, None)
        if value is None:
            return None
    return value if callable(value) and not isinstance(value, type) else None


def callable_op_name(target: Callable) -> str:
    """The canonical name of the op a callable runs, as a ``call_function`` node of it is named.

    ``torch.softmax``, ``F.softmax`` and ``torch.ops.aten.softmax.int`` are all ``"softmax"``, so a
    policy keyed by one callable decides every spelling of its op, as an ``"op:"`` name does.
    """
    return _function_name(target, ())[0]


def _resolve(node: fx.Node, root: Optional[nn.Module]) -> tuple[Optional[str], bool]:
    if node.op == "call_function":
        name, inplace = _function_name(node.target, node.args)
        # Dynamo wraps the casts it sees; amp_fx's own cast helper is a cast.
        if getattr(node.target, "_amp_fx_cast", False):
            return "amp_cast", False
        if getattr(node.target, "_amp_fx_op", None):  # amp_fx's other helpers say which op they are
            return node.target._amp_fx_op, False
        if name == "autograd_function_apply":
            return _autograd_function_name(node), False
        return name, inplace or node.kwargs.get("inplace", False) is True
    if node.op == "call_method":
        name, inplace = _strip_inplace(str(node.target))
        return target_of(_PY_ALIASES.get(name, name)), inplace
    if node.op == "call_module" and root is not None:
        module = root.get_submodule(str(node.target))
        return module_op_name(module), bool(getattr(module, "inplace", False))
    return None, False


_APPLY_CALL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\.apply\(")


def _autograd_function_name(node: fx.Node) -> str:
    """The op name of Dynamo's ``autograd_function_apply`` node: its Function's class name, as the convert route names it.

    Dynamo keeps a custom ``autograd.Function`` as this higher-order op and
    records no class, only the call's source line (``Fn.apply(x, w)``): the
    name before ``.apply(`` there is the class, so ``policy={"op:Fn": ...}``
    decides it on the backend route as on convert.  A call spelt otherwise
    keeps the op's own name.
    """
    lines = [line for line in str(node.meta.get("stack_trace") or "").splitlines() if line.strip()]
    for line in reversed(lines):
        found = _APPLY_CALL.findall(line)
        if found:
            return found[-1]
    return "autograd_function_apply"


def canonical_op(node: fx.Node, root: Optional[nn.Module] = None) -> Optional[str]:
    """Return the canonical op name of ``node``, or None for placeholders, get_attr and output.

    ``root`` is the module that owns the graph; it is needed to resolve
    ``call_module`` nodes to their module type.
    """
    return _resolve(node, root)[0]


def is_inplace(node: fx.Node, root: Optional[nn.Module] = None) -> bool:
    """Return True when ``node`` writes into its first argument (``x.exp_()``, ``relu(inplace=True)``)."""
    return _resolve(node, root)[1]
