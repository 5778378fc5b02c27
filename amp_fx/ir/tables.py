"""The op tables as data: which ops run low, which stay fp32, which promote.

Names are canonical op names (see :mod:`amp_fx.ir.op_keys`): the ATen names that
PyTorch's CUDA autocast op reference uses, so graphs traced at the torch level
(``symbolic_trace``, Dynamo) and at the ATen level (``torch.export``) share one
table.  Every op not listed here FOLLOWS: it runs in whatever dtype arrives.

Each table maps a name to the one-line reason shown in the conversion report.
Custom ops (``torch.library``) that well-known libraries register are keyed by
their qualified name, ``"ns::name"``, as every route names them; any other
library adds its ops' rows with :func:`amp_fx.register_op`, which writes here.
The groups mirror the CUDA autocast reference; where CPU autocast disagrees
the comment says so (the CUDA reference is what Apex and users expect).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

__all__ = [
    "LOW",
    "FP32",
    "PROMOTE",
    "FOLLOW",
    "BANNED",
    "NORM_OPS",
    "NORMS",
    "FACTORIES",
    "DATA_MOVEMENT",
    "LOSSES",
    "EXPORT_CHECKS",
    "CUSTOM_OPS",
    "LOW_PRECISION_DTYPES",
    "table_of",
    "all_tables",
]


def _group(reason: str, *names: str) -> dict[str, str]:
    return {name: reason for name in names}


# --------------------------------------------------------------------------
# LOW (allow list): run in the low dtype.
# --------------------------------------------------------------------------
_LOW_ROWS: dict[str, str] = {
    # GEMMs: tensor cores need fp16/bf16 inputs; accumulation is fp32 inside.
    **_group(
        "GEMM: tensor cores run it low with fp32 accumulation",
        "matmul", "mm", "bmm", "mv", "addmm", "addmv", "addr", "addbmm",
        "baddbmm", "linear", "chain_matmul", "linalg_multi_dot",
        "linalg_vecdot", "einsum",
    ),
    # Convolutions are GEMMs in disguise (implicit GEMM on tensor cores). The
    # cudnn_* entry points are on CUDA autocast's lower_precision_fp list too;
    # they have no CPU kernel, so only a CUDA graph ever runs them.
    **_group(
        "convolution: implicit GEMM on tensor cores",
        "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d", "convolution", "_convolution", "conv_tbc",
        "cudnn_convolution", "cudnn_convolution_transpose",
    ),
    # prelu is on the CUDA list: it is bandwidth bound and safe in low precision.
    **_group("prelu: on autocast's lower-precision list", "prelu"),
    # RNN cells and whole RNNs are GEMM chains (cuDNN RNN runs low under autocast).
    **_group(
        "recurrent GEMMs: cuDNN/oneDNN RNN kernels run low",
        "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
        "lstm", "gru", "rnn_tanh", "rnn_relu",
    ),
    # Attention kernels (flash/memory-efficient) exist only for low dtypes.
    **_group(
        "attention: fused kernels need low-precision inputs",
        "scaled_dot_product_attention", "multi_head_attention",
    ),
    # nn.TransformerEncoderLayer's inference fast path (eval, no grad): one fused op of two GEMM blocks.
    # CPU autocast runs it with its inner GEMMs low; it needs input and weights in one dtype.
    **_group(
        "fused encoder layer (TransformerEncoderLayer's fast path): its GEMMs run low under autocast",
        "_transformer_encoder_layer_fwd",
    ),
    # -- custom ops that libraries register (keyed "ns::name") --------------------------------
    # transformers' MoE experts (integrations/moe.py): a loop of torch.mm over each expert's rows,
    # wrapped as one op so torch.compile does not look inside.  It is a GEMM like mm: autocast
    # would run each mm low, and it needs input and weight in one dtype (it crashes on mixed ones).
    # Its backward op is the same mm loop (grad_input and grad_weight), called from the op's
    # autograd formula; it is decided too, for graphs that record it.
    **_group(
        "GEMM: transformers' grouped expert GEMM (MoE), a loop of mm: runs low like mm",
        "transformers::grouped_mm_fallback", "transformers::grouped_mm_fallback_backward",
    ),
    # transformers' MSA block-sparse attention (integrations/msa_attention.py): a CuTe-DSL
    # flash-style CUDA kernel, which takes fp16/bf16 only, as scaled_dot_product_attention's do.
    **_group(
        "attention: transformers' MSA block-sparse kernel (CUDA) takes fp16/bf16 inputs",
        "transformers_msa::sparse_atten",
    ),
}
LOW: Mapping[str, str] = MappingProxyType(_LOW_ROWS)

# --------------------------------------------------------------------------
# FP32 (deny list): inputs are cast to fp32 and the op runs in fp32.
# --------------------------------------------------------------------------
_FP32_ROWS: dict[str, str] = {
    # Pointwise functions whose output range or slope overflows fp16.
    **_group(
        "pointwise: range or precision exceeds fp16",
        "acos", "asin", "cosh", "sinh", "tan", "erfinv", "exp", "expm1",
        "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "pow",
        "rtruediv", "softplus",
    ),
    # Reductions accumulate many terms: fp16 sums lose precision or overflow.
    **_group(
        "reduction: accumulates many terms",
        "sum", "prod", "cumsum", "cumprod", "logsumexp",
    ),
    # Softmax-family exponentiates then normalises.
    **_group(
        "softmax family: exp then normalise",
        "softmax", "log_softmax", "softmin",
    ),
    # Norms compute statistics (mean/variance) over many elements.
    **_group(
        "normalisation statistics need fp32",
        "layer_norm", "group_norm", "norm", "normalize", "renorm",
        "linalg_vector_norm", "linalg_matrix_norm", "frobenius_norm",
        "nuclear_norm", "rms_norm", "cosine_similarity",
    ),
    # Distances square and sum differences.
    **_group("distance: sums of squares", "dist", "pdist", "cdist"),
    # Losses reduce over the batch and feed the loss scaler.
    **_group(
        "loss: reduces over the batch and feeds loss scaling",
        "cross_entropy", "nll_loss", "nll_loss2d", "mse_loss", "l1_loss",
        "smooth_l1_loss", "huber_loss", "kl_div", "poisson_nll_loss",
        "binary_cross_entropy_with_logits", "cosine_embedding_loss",
        "hinge_embedding_loss", "margin_ranking_loss",
        "multilabel_margin_loss", "multi_margin_loss", "soft_margin_loss",
        "triplet_margin_loss",
    ),
    # Upsampling interpolates with fp32 weights in autocast's reference.
    **_group(
        "upsampling: on autocast's float32 list",
        "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
        "upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d",
        "upsample_bicubic2d", "interpolate",
    ),
    # No low-precision kernel at all (CPU autocast runs them in fp32): FFTs,
    # dense linear algebra, quantiles.  Left to follow a low input, they fail.
    **_group(
        "no fp16/bf16 kernel: FFT, linear algebra and quantiles run in fp32 (autocast's CPU float32 list)",
        "fft_fft", "fft_ifft", "fft_rfft", "fft_irfft", "fft_fft2", "fft_rfft2", "fft_fftn", "fft_rfftn",
        "fft_hfft", "linalg_solve", "linalg_inv", "linalg_eigh", "linalg_eigvalsh", "linalg_eig", "linalg_svd",
        "linalg_svdvals", "linalg_det", "linalg_slogdet", "linalg_cholesky", "linalg_qr", "linalg_pinv",
        "linalg_lstsq", "quantile", "nanquantile", "polar",
    ),
}
FP32: Mapping[str, str] = MappingProxyType(_FP32_ROWS)

# --------------------------------------------------------------------------
# PROMOTE: inputs are cast to the widest floating dtype among them.
# --------------------------------------------------------------------------
_PROMOTE_ROWS: dict[str, str] = {
    # Multi-input ops whose kernels require one dtype across inputs.
    **_group(
        "multi-input op: runs in the widest input dtype",
        "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot",
        "grid_sampler", "index_put", "scatter_add", "tensordot",
        "index_copy",
    ),
    # Sequence ops: cat/stack over mixed inputs promote to the widest.
    **_group("sequence op: runs in the widest input dtype", "cat", "stack"),
}
PROMOTE: Mapping[str, str] = MappingProxyType(_PROMOTE_ROWS)

# Ops that only move data (views, layout, indexing, embedding lookups): they
# follow their input at every level, and casts can be hoisted through them.
DATA_MOVEMENT: frozenset[str] = frozenset({
        "getitem", "setitem", "view", "reshape", "flatten", "unflatten",
        "permute", "transpose", "t", "contiguous", "expand", "expand_as",
        "repeat", "squeeze", "unsqueeze", "split", "chunk", "unbind",
        "narrow", "select", "slice", "index_select", "gather", "scatter",
        "masked_select", "roll", "flip", "clone", "detach", "identity",
        "view_as", "split_with_sizes", "pad", "constant_pad_nd",
        "embedding", "embedding_bag", "one_hot", "tril", "triu",
        "zeros_like", "ones_like", "empty_like", "full_like", "new_zeros",
        "new_ones", "new_empty", "new_full", "size", "dim", "numel",
        # Shape queries as torch.export records them: read sizes, decide no precision.
        "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
        "getattr", "alias", "lift_fresh_copy", "unsafe_view", "_unsafe_view",
        # Views that select or reorder elements: a write through one must reach its input, so
        # they follow it at every level (O2 never casts a buffer before a write through its diagonal).
        "diagonal", "as_strided", "unfold", "movedim", "moveaxis", "swapaxes", "swapdims", "adjoint",
        "tensor_split", "hsplit", "vsplit", "dsplit",
})

# Losses (and the log_softmax a cross-entropy decomposes into): O2 keeps them fp32, as it keeps norms
# (keep_losses_fp32); a loss over a vocabulary-sized softmax is where low precision costs most.
LOSSES: frozenset[str] = frozenset(op for op, reason in FP32.items() if reason.startswith("loss:")) | {"log_softmax"}

# Checks that torch.export records in a graph (no result, no arithmetic).
EXPORT_CHECKS: frozenset[str] = frozenset({"_assert_tensor_metadata", "_assert_scalar", "_guards_fn",
                                           "sym_constrain_range_for_size"})

# Ops that make a new tensor (from sizes, values, or another tensor's shape): they make the dtype they are asked for.
_FACTORY_NAMES = ("arange", "zeros", "ones", "full", "empty", "randn", "rand", "randint", "randn_like", "rand_like",
                  "linspace", "scalar_tensor", "tensor")
FACTORIES: frozenset[str] = frozenset(_FACTORY_NAMES)

# --------------------------------------------------------------------------
# FOLLOW: known to be safe in whatever dtype arrives.  Ops in no table follow
# too, but are counted as unknown in the report (on_unknown_op= changes that).
# --------------------------------------------------------------------------
_FOLLOW_ROWS: dict[str, str] = {
    # Elementwise arithmetic and activations: exact or bandwidth bound.
    **_group(
        "elementwise: same precision in and out",
        "add", "sub", "mul", "div", "neg", "abs", "relu", "relu6", "gelu",
        "silu", "sigmoid", "tanh", "leaky_relu", "elu", "selu", "celu",
        "hardswish", "hardsigmoid", "hardtanh", "mish", "clamp", "clamp_min",
        "clamp_max", "where", "maximum", "minimum", "sqrt", "square", "sin",
        "cos", "floor_divide", "remainder", "sign", "masked_fill", "lerp",
        "rsub", "threshold", "erf", "round", "floor", "ceil", "trunc",
        "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not",
        "logical_and", "logical_or", "logical_not", "eq", "ne", "lt", "le",
        "gt", "ge", "isfinite", "isnan", "isinf",
    ),
    **_group("data movement: no arithmetic", *DATA_MOVEMENT),
    # Pooling keeps or averages a window: fine in low precision.
    **_group(
        "pooling: window max/mean",
        "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d",
        "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
        "adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d",
        "max_pool2d_with_indices",
    ),
    # Factories make what their dtype= (or the default dtype) says.
    **_group("factory: makes the dtype it is asked for", *_FACTORY_NAMES),
    # Checks torch.export records: they compute nothing; insert_casts keeps them true to the rewrite.
    **_group("torch.export check: computes nothing, kept true to the rewritten dtypes", *sorted(EXPORT_CHECKS)),
    # Regularisers and small reductions that autocast leaves alone.
    **_group(
        "left alone by autocast",
        "dropout", "native_dropout", "mean", "max", "min", "amax", "amin",
        "argmax", "argmin", "topk", "sort", "argsort", "var", "std",
        "var_mean", "any", "all",
    ),
    # batch_norm follows its input: cuDNN/oneDNN take low input, fp32 stats.
    **_group(
        "batch norm follows its input (fp32 statistics, low input)",
        "batch_norm", "instance_norm",
    ),
}
FOLLOW: Mapping[str, str] = MappingProxyType(_FOLLOW_ROWS)

# --------------------------------------------------------------------------
# BANNED: unsafe in low precision; refused unless allow_banned=True (then fp32).
# --------------------------------------------------------------------------
_BANNED_ROWS: dict[str, str] = {
    "binary_cross_entropy": (
        "binary_cross_entropy is unsafe in low precision (its log saturates "
        "and gradients overflow). Use torch.nn.functional."
        "binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss on "
        "the logits instead, or pass allow_banned=True to run it in fp32."
    ),
}
BANNED: Mapping[str, str] = MappingProxyType(_BANNED_ROWS)

# The custom ops the tables ship with (their keys are "ns::name"; tests/ir/test_custom_ops.py covers them).
# Ops a library adds with amp_fx.register_op are not among them.
CUSTOM_OPS: frozenset[str] = frozenset(
    op for table in (LOW, FP32, PROMOTE, FOLLOW, BANNED) for op in table if "::" in op)

# Normalisation ops: their parameters (and running statistics) stay fp32 under keep_batchnorm_fp32.  By
# what they take at O2/O3: "statistics" ops compute mean and variance from their input, so they run fp32
# under keep_batchnorm_fp32 (and are in FP32 at O1); "input_dtype" ops follow their input (in FOLLOW at
# O1): cuDNN and oneDNN take low-precision input with fp32 statistics, as Apex relied on.
# amp_fx.register_op(..., norm=) adds a library's norm here.
_NORM_ROWS: dict[str, str] = {
    **dict.fromkeys(("layer_norm", "group_norm", "rms_norm"), "statistics"),
    **dict.fromkeys(("batch_norm", "instance_norm"), "input_dtype"),
}
NORMS: Mapping[str, str] = MappingProxyType(_NORM_ROWS)
NORM_OPS = NORMS.keys()  # a live view: a registered norm is in it

LOW_PRECISION_DTYPES = ("float16", "bfloat16")


def _rows() -> dict[str, dict[str, str]]:
    """The tables' own dicts, by category: only :func:`amp_fx.ir.op_properties.register_op` writes into them."""
    return {"low": _LOW_ROWS, "fp32": _FP32_ROWS, "promote": _PROMOTE_ROWS, "banned": _BANNED_ROWS, "follow": _FOLLOW_ROWS}


def _norm_rows() -> dict[str, str]:
    """The norms' own dict (op -> "statistics" | "input_dtype"): only ``register_op`` writes into it."""
    return _NORM_ROWS


def all_tables() -> dict[str, Mapping[str, str]]:
    """Return the tables by category name, in report order."""
    return {"low": LOW, "fp32": FP32, "promote": PROMOTE, "banned": BANNED, "follow": FOLLOW}


def table_of(op: str) -> str:
    """Return the category of a canonical op name: low, fp32, promote, banned, follow or unknown."""
    for category, table in all_tables().items():
        if op in table:
            return category
    return "unknown"
