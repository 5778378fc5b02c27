"""Every table entry, called as a torch function, a Tensor method and an nn.Module, runs in the dtype its table promises at O1.

LOW -> the low dtype; FP32 -> float32; PROMOTE -> the widest input dtype;
FOLLOW -> its input's dtype; BANNED -> refused (fp32 with allow_banned=True).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_fx
from amp_fx.ir import tables

LOW = torch.bfloat16


class Call(nn.Module):
    """A module whose forward calls ``fn(self, *inputs)``; keyword tensors become parameters."""

    def __init__(self, fn, **params):
        super().__init__()
        self.fn = fn
        self.arity = 1
        for name, value in params.items():
            self.register_parameter(name, nn.Parameter(value))

    # Fixed parameters, not *inputs: fx cannot iterate a varargs proxy.
    def forward(self, a, b=None, c=None):
        return self.fn(self, *(a, b, c)[: self.arity])


class Wrap(nn.Module):
    """Run a submodule (so it is traced through or kept as a leaf as amp_fx decides)."""

    def __init__(self, module, pick=None):
        super().__init__()
        self.inner = module
        self.pick = pick
        self.arity = 1

    def forward(self, a, b=None, c=None):
        out = self.inner(*(a, b, c)[: self.arity])
        return out[0] if self.pick == 0 else out


def r(*shape):
    return torch.randn(*shape)


def pos(*shape):
    return torch.rand(*shape) + 0.5


def unit(*shape):
    return torch.rand(*shape) * 1.6 - 0.8


# op -> list of (label, module, inputs)
def low_cases():
    x, w = r(4, 8), r(8, 6)
    return {
        "matmul": [("torch", Call(lambda m, x: torch.matmul(x, m.w), w=w), (x,)),
                   ("method", Call(lambda m, x: x.matmul(m.w), w=w), (x,)),
                   ("operator", Call(lambda m, x: x @ m.w, w=w), (x,))],
        "mm": [("torch", Call(lambda m, x: torch.mm(x, m.w), w=w), (x,)), ("method", Call(lambda m, x: x.mm(m.w), w=w), (x,))],
        "bmm": [("torch", Call(lambda m, x: torch.bmm(x, m.w), w=r(2, 8, 3)), (r(2, 4, 8),)),
                ("method", Call(lambda m, x: x.bmm(m.w), w=r(2, 8, 3)), (r(2, 4, 8),))],
        "mv": [("torch", Call(lambda m, x: torch.mv(x, m.v), v=r(8)), (x,)), ("method", Call(lambda m, x: x.mv(m.v), v=r(8)), (x,))],
        "addmm": [("torch", Call(lambda m, x: torch.addmm(m.b, x, m.w), b=r(6), w=w), (x,)),
                  ("method", Call(lambda m, x: m.b.addmm(x, m.w), b=r(4, 6), w=w), (x,))],
        "addmv": [("torch", Call(lambda m, x: torch.addmv(m.b, x, m.v), b=r(4), v=r(8)), (x,))],
        "addr": [("torch", Call(lambda m, x: torch.addr(m.b, x, m.v), b=r(8, 5), v=r(5)), (r(8),))],
        "addbmm": [("torch", Call(lambda m, x: torch.addbmm(m.b, x, m.w), b=r(4, 3), w=r(2, 8, 3)), (r(2, 4, 8),))],
        "baddbmm": [("torch", Call(lambda m, x: torch.baddbmm(m.b, x, m.w), b=r(2, 4, 3), w=r(2, 8, 3)), (r(2, 4, 8),))],
        "linear": [("torch", Call(lambda m, x: F.linear(x, m.w), w=r(6, 8)), (x,)), ("module", Wrap(nn.Linear(8, 6)), (x,))],
        "chain_matmul": [("torch", Call(lambda m, x: torch.chain_matmul(x, m.w, m.v), w=w, v=r(6, 3)), (x,))],
        "linalg_multi_dot": [("torch", Call(lambda m, x: torch.linalg.multi_dot([x, m.w, m.v]), w=w, v=r(6, 3)), (x,))],
        "linalg_vecdot": [("torch", Call(lambda m, x: torch.linalg.vecdot(x, m.w), w=r(4, 8)), (x,))],
        "einsum": [("torch", Call(lambda m, x: torch.einsum("ij,jk->ik", x, m.w), w=w), (x,))],
        "conv1d": [("torch", Call(lambda m, x: F.conv1d(x, m.w), w=r(4, 3, 3)), (r(1, 3, 10),)), ("module", Wrap(nn.Conv1d(3, 4, 3)), (r(1, 3, 10),))],
        "conv2d": [("torch", Call(lambda m, x: F.conv2d(x, m.w), w=r(4, 3, 3, 3)), (r(1, 3, 8, 8),)), ("module", Wrap(nn.Conv2d(3, 4, 3)), (r(1, 3, 8, 8),))],
        "conv3d": [("torch", Call(lambda m, x: F.conv3d(x, m.w), w=r(2, 3, 2, 2, 2)), (r(1, 3, 4, 4, 4),)), ("module", Wrap(nn.Conv3d(3, 2, 2)), (r(1, 3, 4, 4, 4),))],
        "conv_transpose1d": [("torch", Call(lambda m, x: F.conv_transpose1d(x, m.w), w=r(3, 4, 3)), (r(1, 3, 10),)), ("module", Wrap(nn.ConvTranspose1d(3, 4, 3)), (r(1, 3, 10),))],
        "conv_transpose2d": [("torch", Call(lambda m, x: F.conv_transpose2d(x, m.w), w=r(3, 4, 3, 3)), (r(1, 3, 6, 6),)), ("module", Wrap(nn.ConvTranspose2d(3, 4, 3)), (r(1, 3, 6, 6),))],
        "conv_transpose3d": [("torch", Call(lambda m, x: F.conv_transpose3d(x, m.w), w=r(3, 2, 2, 2, 2)), (r(1, 3, 3, 3, 3),)), ("module", Wrap(nn.ConvTranspose3d(3, 2, 2)), (r(1, 3, 3, 3, 3),))],
        "convolution": [("torch", Call(lambda m, x: torch.convolution(x, m.w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1), w=r(4, 3, 3, 3)), (r(1, 3, 8, 8),))],
        "_convolution": [("torch", Call(lambda m, x: torch._convolution(x, m.w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, False, False, True, True), w=r(4, 3, 3, 3)), (r(1, 3, 8, 8),))],
        "conv_tbc": [("torch", Call(lambda m, x: torch.conv_tbc(x, m.w, m.b, 1), w=r(3, 4, 5), b=r(5)), (r(7, 2, 4),))],
        "prelu": [("torch", Call(lambda m, x: F.prelu(x, m.w), w=r(1)), (x,)), ("module", Wrap(nn.PReLU()), (x,))],
        "lstm_cell": [("module", Wrap(nn.LSTMCell(8, 5), pick=0), (x,))],
        "gru_cell": [("module", Wrap(nn.GRUCell(8, 5)), (x,))],
        "rnn_tanh_cell": [("module", Wrap(nn.RNNCell(8, 5)), (x,))],
        "rnn_relu_cell": [("module", Wrap(nn.RNNCell(8, 5, nonlinearity="relu")), (x,))],
        "lstm": [("module", Wrap(nn.LSTM(8, 5, batch_first=True), pick=0), (r(2, 3, 8),))],
        "gru": [("module", Wrap(nn.GRU(8, 5, batch_first=True), pick=0), (r(2, 3, 8),))],
        "rnn_tanh": [("module", Wrap(nn.RNN(8, 5, batch_first=True), pick=0), (r(2, 3, 8),))],
        "rnn_relu": [("module", Wrap(nn.RNN(8, 5, nonlinearity="relu", batch_first=True), pick=0), (r(2, 3, 8),))],
        "scaled_dot_product_attention": [("torch", Call(lambda m, q: F.scaled_dot_product_attention(q, q, q)), (r(1, 2, 4, 8),))],
        "multi_head_attention": [("module", Wrap(nn.MultiheadAttention(8, 2, batch_first=True), pick=0), (r(2, 3, 8),) * 3)],
        # TransformerEncoderLayer's inference fast path, called as the layer calls it (embed 8, 2 heads, ffn 16).
        "_transformer_encoder_layer_fwd": [("torch", Call(lambda m, x: torch._transformer_encoder_layer_fwd(
            x, 8, 2, m.qkv, m.qkv_b, m.proj, m.proj_b, False, False, 1e-5, m.n1, m.n1_b, m.n2, m.n2_b, m.ff1, m.ff1_b,
            m.ff2, m.ff2_b), qkv=r(24, 8), qkv_b=r(24), proj=r(8, 8), proj_b=r(8), n1=r(8), n1_b=r(8), n2=r(8),
            n2_b=r(8), ff1=r(16, 8), ff1_b=r(16), ff2=r(8, 16), ff2_b=r(8)), (r(2, 3, 8),))],
    }


def fp32_cases():
    x = r(4, 8)
    logits, labels = r(4, 5), torch.randint(0, 5, (4,))
    unary = {
        "acos": lambda t: t.clamp(-0.9, 0.9), "asin": lambda t: t.clamp(-0.9, 0.9), "cosh": None, "sinh": None, "tan": None,
        "erfinv": lambda t: t.clamp(-0.9, 0.9), "exp": None, "expm1": None, "log": lambda t: t.abs() + 1,
        "log10": lambda t: t.abs() + 1, "log2": lambda t: t.abs() + 1, "log1p": lambda t: t.abs(),
        "reciprocal": lambda t: t.abs() + 1, "rsqrt": lambda t: t.abs() + 1,
    }
    cases = {}
    for name, prep in unary.items():
        inp = (prep(x) if prep else x,)
        cases[name] = [("torch", Call(lambda m, t, n=name: getattr(torch, n)(t)), inp),
                       ("method", Call(lambda m, t, n=name: getattr(t, n)()), inp)]
    cases.update({
        "pow": [("torch", Call(lambda m, t: torch.pow(t, 2)), (x,)), ("method", Call(lambda m, t: t.pow(2)), (x,)),
                ("operator", Call(lambda m, t: t ** 2), (x,)), ("rpow", Call(lambda m, t: 2 ** t), (x,))],
        "rtruediv": [("operator", Call(lambda m, t: 1.0 / t), (pos(4, 8),))],
        "softplus": [("torch", Call(lambda m, t: F.softplus(t)), (x,)), ("module", Wrap(nn.Softplus()), (x,))],
        "sum": [("torch", Call(lambda m, t: torch.sum(t, -1)), (x,)), ("method", Call(lambda m, t: t.sum()), (x,))],
        "prod": [("torch", Call(lambda m, t: torch.prod(t, -1)), (x,)), ("method", Call(lambda m, t: t.prod()), (x,))],
        "cumsum": [("torch", Call(lambda m, t: torch.cumsum(t, 0)), (x,)), ("method", Call(lambda m, t: t.cumsum(0)), (x,))],
        "cumprod": [("torch", Call(lambda m, t: torch.cumprod(t, 0)), (x,)), ("method", Call(lambda m, t: t.cumprod(0)), (x,))],
        "logsumexp": [("torch", Call(lambda m, t: torch.logsumexp(t, -1)), (x,)), ("method", Call(lambda m, t: t.logsumexp(-1)), (x,))],
        "softmax": [("torch", Call(lambda m, t: torch.softmax(t, -1)), (x,)), ("functional", Call(lambda m, t: F.softmax(t, -1)), (x,)),
                    ("method", Call(lambda m, t: t.softmax(-1)), (x,)), ("module", Wrap(nn.Softmax(-1)), (x,))],
        "log_softmax": [("torch", Call(lambda m, t: torch.log_softmax(t, -1)), (x,)), ("method", Call(lambda m, t: t.log_softmax(-1)), (x,)),
                        ("module", Wrap(nn.LogSoftmax(-1)), (x,))],
        "softmin": [("functional", Call(lambda m, t: F.softmin(t, -1)), (x,)), ("module", Wrap(nn.Softmin(-1)), (x,))],
        "layer_norm": [("functional", Call(lambda m, t: F.layer_norm(t, (8,))), (x,)), ("module", Wrap(nn.LayerNorm(8)), (x,))],
        "group_norm": [("functional", Call(lambda m, t: F.group_norm(t, 2)), (r(2, 4, 3),)), ("module", Wrap(nn.GroupNorm(2, 4)), (r(2, 4, 3),))],
        "rms_norm": [("functional", Call(lambda m, t: F.rms_norm(t, (8,))), (x,)), ("module", Wrap(nn.RMSNorm(8)), (x,))],
        "norm": [("torch", Call(lambda m, t: torch.norm(t)), (x,)), ("method", Call(lambda m, t: t.norm()), (x,))],
        "normalize": [("functional", Call(lambda m, t: F.normalize(t)), (x,))],
        "renorm": [("torch", Call(lambda m, t: torch.renorm(t, 2, 0, 1.0)), (x,)), ("method", Call(lambda m, t: t.renorm(2, 0, 1.0)), (x,))],
        "linalg_vector_norm": [("torch", Call(lambda m, t: torch.linalg.vector_norm(t)), (x,))],
        "linalg_matrix_norm": [("torch", Call(lambda m, t: torch.linalg.matrix_norm(t)), (x,))],
        "frobenius_norm": [("torch", Call(lambda m, t: torch.frobenius_norm(t, (0, 1))), (x,))],
        "nuclear_norm": [("torch", Call(lambda m, t: torch.nuclear_norm(t)), (x,))],
        "cosine_similarity": [("torch", Call(lambda m, t: F.cosine_similarity(t, t + 1)), (x,)), ("module", Wrap(nn.CosineSimilarity()), (x, x + 1))],
        "dist": [("torch", Call(lambda m, t: torch.dist(t, t + 1)), (x,))],
        "pdist": [("torch", Call(lambda m, t: F.pdist(t)), (x,))],
        "cdist": [("torch", Call(lambda m, t: torch.cdist(t, t + 1)), (x,))],
        "cross_entropy": [("functional", Call(lambda m, t, y: F.cross_entropy(t, y)), (logits, labels)),
                          ("module", Wrap(nn.CrossEntropyLoss()), (logits, labels))],
        "nll_loss": [("functional", Call(lambda m, t, y: F.nll_loss(t, y)), (logits, labels)), ("module", Wrap(nn.NLLLoss()), (logits, labels))],
        "nll_loss2d": [("torch", Call(lambda m, t, y: torch._C._nn.nll_loss2d(t, y)), (r(2, 5, 3, 3), torch.randint(0, 5, (2, 3, 3))))],
        "mse_loss": [("functional", Call(lambda m, t: F.mse_loss(t, t * 2)), (x,)), ("module", Wrap(nn.MSELoss()), (x, x * 2))],
        "l1_loss": [("functional", Call(lambda m, t: F.l1_loss(t, t * 2)), (x,)), ("module", Wrap(nn.L1Loss()), (x, x * 2))],
        "smooth_l1_loss": [("functional", Call(lambda m, t: F.smooth_l1_loss(t, t * 2)), (x,)), ("module", Wrap(nn.SmoothL1Loss()), (x, x * 2))],
        "huber_loss": [("functional", Call(lambda m, t: F.huber_loss(t, t * 2)), (x,)), ("module", Wrap(nn.HuberLoss()), (x, x * 2))],
        "kl_div": [("functional", Call(lambda m, t: F.kl_div(t.log_softmax(-1), t.softmax(-1), reduction="batchmean")), (x,)),
                   ("module", Wrap(nn.KLDivLoss(reduction="batchmean")), (x.log_softmax(-1), x.softmax(-1)))],
        "poisson_nll_loss": [("functional", Call(lambda m, t: F.poisson_nll_loss(t, t.abs())), (x,)), ("module", Wrap(nn.PoissonNLLLoss()), (x, x.abs()))],
        "binary_cross_entropy_with_logits": [("functional", Call(lambda m, t: F.binary_cross_entropy_with_logits(t, t.sigmoid())), (x,)),
                                             ("module", Wrap(nn.BCEWithLogitsLoss()), (x, x.sigmoid()))],
        "cosine_embedding_loss": [("functional", Call(lambda m, t, y: F.cosine_embedding_loss(t, t + 1, y)), (x, torch.ones(4))),
                                  ("module", Wrap(nn.CosineEmbeddingLoss()), (x, x + 1, torch.ones(4)))],
        "hinge_embedding_loss": [("functional", Call(lambda m, t, y: F.hinge_embedding_loss(t, y)), (x, torch.ones(4, 8))),
                                 ("module", Wrap(nn.HingeEmbeddingLoss()), (x, torch.ones(4, 8)))],
        "margin_ranking_loss": [("functional", Call(lambda m, t, y: F.margin_ranking_loss(t, t + 1, y)), (x, torch.ones(4, 8))),
                                ("module", Wrap(nn.MarginRankingLoss()), (x, x + 1, torch.ones(4, 8)))],
        "multilabel_margin_loss": [("functional", Call(lambda m, t, y: F.multilabel_margin_loss(t, y)), (logits, torch.randint(0, 5, (4, 5)))),
                                   ("module", Wrap(nn.MultiLabelMarginLoss()), (logits, torch.randint(0, 5, (4, 5))))],
        "multi_margin_loss": [("functional", Call(lambda m, t, y: F.multi_margin_loss(t, y)), (logits, labels)),
                              ("module", Wrap(nn.MultiMarginLoss()), (logits, labels))],
        "soft_margin_loss": [("functional", Call(lambda m, t: F.soft_margin_loss(t, t.sign())), (x,)), ("module", Wrap(nn.SoftMarginLoss()), (x, x.sign()))],
        "triplet_margin_loss": [("functional", Call(lambda m, t: F.triplet_margin_loss(t, t + 1, t - 1)), (x,)),
                                ("module", Wrap(nn.TripletMarginLoss()), (x, x + 1, x - 1))],
        "upsample_nearest1d": [("torch", Call(lambda m, t: torch._C._nn.upsample_nearest1d(t, [6])), (r(1, 2, 3),))],
        "upsample_nearest2d": [("torch", Call(lambda m, t: torch._C._nn.upsample_nearest2d(t, [6, 6])), (r(1, 2, 3, 3),))],
        "upsample_nearest3d": [("torch", Call(lambda m, t: torch._C._nn.upsample_nearest3d(t, [4, 4, 4])), (r(1, 2, 2, 2, 2),))],
        "upsample_linear1d": [("torch", Call(lambda m, t: torch._C._nn.upsample_linear1d(t, [6], False)), (r(1, 2, 3),))],
        "upsample_bilinear2d": [("torch", Call(lambda m, t: torch._C._nn.upsample_bilinear2d(t, [6, 6], False)), (r(1, 2, 3, 3),))],
        "upsample_trilinear3d": [("torch", Call(lambda m, t: torch._C._nn.upsample_trilinear3d(t, [4, 4, 4], False)), (r(1, 2, 2, 2, 2),))],
        "upsample_bicubic2d": [("torch", Call(lambda m, t: torch._C._nn.upsample_bicubic2d(t, [6, 6], False)), (r(1, 2, 3, 3),))],
        "interpolate": [("functional", Call(lambda m, t: F.interpolate(t, scale_factor=2)), (r(1, 2, 3, 3),)),
                        ("module", Wrap(nn.Upsample(scale_factor=2)), (r(1, 2, 3, 3),))],
    })
    # Ops with no low-precision kernel: FFTs (complex results read through .abs()), linear algebra on an SPD matrix.
    ffts = {"fft_fft": torch.fft.fft, "fft_ifft": torch.fft.ifft, "fft_rfft": torch.fft.rfft, "fft_irfft": torch.fft.irfft,
            "fft_fft2": torch.fft.fft2, "fft_rfft2": torch.fft.rfft2, "fft_fftn": torch.fft.fftn, "fft_rfftn": torch.fft.rfftn,
            "fft_hfft": torch.fft.hfft}
    for name, fn in ffts.items():
        cases[name] = [("torch", Call(lambda m, t, fn=fn: fn(t).abs()), (x,))]

    def spd(t):
        return t @ t.transpose(-1, -2) + 4 * torch.eye(t.shape[-1])

    algebra = {
        "linalg_solve": lambda a: torch.linalg.solve(a, a), "linalg_inv": torch.linalg.inv,
        "linalg_eigh": lambda a: torch.linalg.eigh(a)[0], "linalg_eigvalsh": torch.linalg.eigvalsh,
        "linalg_eig": lambda a: torch.linalg.eig(a)[0].real, "linalg_svd": lambda a: torch.linalg.svd(a)[1],
        "linalg_svdvals": torch.linalg.svdvals, "linalg_det": torch.linalg.det,
        "linalg_slogdet": lambda a: torch.linalg.slogdet(a)[1], "linalg_cholesky": torch.linalg.cholesky,
        "linalg_qr": lambda a: torch.linalg.qr(a)[1], "linalg_pinv": torch.linalg.pinv,
        "linalg_lstsq": lambda a: torch.linalg.lstsq(a, a)[0],
    }
    for name, fn in algebra.items():
        cases[name] = [("torch", Call(lambda m, t, fn=fn: fn(spd(t))), (r(4, 4),))]
    cases["quantile"] = [("torch", Call(lambda m, t: torch.quantile(t, 0.5, dim=-1)), (x,))]
    cases["nanquantile"] = [("torch", Call(lambda m, t: torch.nanquantile(t, 0.5, dim=-1)), (x,))]
    cases["polar"] = [("torch", Call(lambda m, t: torch.view_as_real(torch.polar(t.abs(), t))), (x,))]
    return cases


def promote_cases():
    """Each case takes (fp32 tensor, low tensor) and mixes them."""
    idx = torch.tensor([0, 2])
    return {
        "addcdiv": [("torch", lambda a, b: torch.addcdiv(a, b, b.abs() + 1)), ("method", lambda a, b: a.addcdiv(b, b.abs() + 1))],
        "addcmul": [("torch", lambda a, b: torch.addcmul(a, b, b)), ("method", lambda a, b: a.addcmul(b, b))],
        "atan2": [("torch", lambda a, b: torch.atan2(a, b)), ("method", lambda a, b: a.atan2(b))],
        "bilinear": [("torch", lambda a, b: F.bilinear(a, b, b.new_ones(2, 8, 8)))],
        "cross": [("torch", lambda a, b: torch.cross(a[:, :3], b[:, :3], dim=1)), ("method", lambda a, b: a[:, :3].cross(b[:, :3], dim=1))],
        "dot": [("torch", lambda a, b: torch.dot(a[0], b[0])), ("method", lambda a, b: a[0].dot(b[0]))],
        "vdot": [("torch", lambda a, b: torch.vdot(a[0], b[0]))],
        "grid_sampler": [("torch", lambda a, b: F.grid_sample(a.reshape(1, 1, 4, 8), b.reshape(1, 2, 8, 2).tanh(), align_corners=False))],
        "index_put": [("method", lambda a, b: a.index_put((idx,), b[:2]))],
        "scatter_add": [("torch", lambda a, b: torch.scatter_add(a, 0, torch.zeros(4, 8, dtype=torch.long), b)),
                        ("method", lambda a, b: a.scatter_add(0, torch.zeros(4, 8, dtype=torch.long), b))],
        "tensordot": [("torch", lambda a, b: torch.tensordot(a, b.t(), dims=1))],
        "index_copy": [("torch", lambda a, b: torch.index_copy(a, 0, idx, b[:2])), ("method", lambda a, b: a.index_copy(0, idx, b[:2]))],
        "cat": [("torch", lambda a, b: torch.cat([a, b]))],
        "stack": [("torch", lambda a, b: torch.stack([a, b]))],
    }


def follow_cases():
    x = r(4, 8)
    return {
        "relu": [("torch", Call(lambda m, t: torch.relu(t)), (x,)), ("module", Wrap(nn.ReLU()), (x,))],
        "gelu": [("functional", Call(lambda m, t: F.gelu(t)), (x,)), ("module", Wrap(nn.GELU()), (x,))],
        "add": [("operator", Call(lambda m, t: t + t), (x,)), ("torch", Call(lambda m, t: torch.add(t, 1.0)), (x,))],
        "mul": [("operator", Call(lambda m, t: t * 3), (x,))],
        "view": [("method", Call(lambda m, t: t.view(-1)), (x,))],
        "transpose": [("method", Call(lambda m, t: t.transpose(0, 1)), (x,))],
        "dropout": [("module", Wrap(nn.Dropout(0.0)), (x,))],
        "batch_norm": [("module", Wrap(nn.BatchNorm1d(8)), (x,))],
        "max_pool2d": [("functional", Call(lambda m, t: F.max_pool2d(t, 2)), (r(1, 2, 4, 4),))],
        "mean": [("method", Call(lambda m, t: t.mean(-1)), (x,))],
        "tanh": [("torch", Call(lambda m, t: torch.tanh(t)), (x,)), ("module", Wrap(nn.Tanh()), (x,))],
    }


class LowInput(nn.Module):
    """Cast the input low first (as a model that already computes in low precision would)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

        self.arity = getattr(inner, "arity", 1)

    def forward(self, a, b=None, c=None):
        return self.inner(a.to(LOW), *(b, c)[: self.arity - 1])


def _first_tensor(out):
    return out if isinstance(out, torch.Tensor) else out[0]


def _with_arity(module, inputs):
    module.arity = len(inputs)
    return module


def _flat(cases):
    return [pytest.param(op, _with_arity(module, inputs), inputs, id=f"{op}-{label}")
            for op, entries in cases.items() for label, module, inputs in entries]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# Table entries with no CPU kernel: they cannot run here, so test_tables_and_keys.py checks their
# decision (and that they really have no CPU kernel) without running them.
NO_CPU_KERNEL = {"cudnn_convolution", "cudnn_convolution_transpose"}


# Custom ops ("ns::name") run in tests/ir/test_custom_ops.py (they need the library that registers them): each with
# the table its case checks, so a custom op with no case, or put in another table than its case runs, fails here.
CUSTOM_OP_CASES = {
    "transformers::grouped_mm_fallback": "low",  # test_transformers_grouped_mm_runs_low_with_its_gradient
    "transformers::grouped_mm_fallback_backward": "low",  # its backward: its decision (test_transformers_ops_are_registered_...)
    "transformers_msa::sparse_atten": "low",  # a CUDA kernel: its decision only (test_transformers_ops_are_registered_...)
}


def test_every_table_entry_has_a_case():
    assert {op: tables.table_of(op) for op in tables.CUSTOM_OPS} == CUSTOM_OP_CASES
    covered = set(low_cases()) | set(fp32_cases()) | set(promote_cases()) | NO_CPU_KERNEL | set(CUSTOM_OP_CASES)
    missing = (set(tables.LOW) | set(tables.FP32) | set(tables.PROMOTE)) - covered
    assert not missing, f"table entries without a dtype test: {sorted(missing)}"


@pytest.mark.parametrize("op, module, inputs", _flat(low_cases()))
def test_low_ops_run_low(op, module, inputs):
    gm = amp_fx.convert(module, "O1", dtype=LOW, cast_model_outputs=False)
    assert op in {r.op for r in gm.amp_report.nodes if r.decision == "low"}
    assert _first_tensor(gm(*inputs)).dtype == LOW


@pytest.mark.parametrize("op, module, inputs", _flat(fp32_cases()))
def test_fp32_ops_run_fp32_even_on_low_input(op, module, inputs):
    gm = amp_fx.convert(LowInput(module), "O1", dtype=LOW, cast_model_outputs=False)
    assert op in {r.op for r in gm.amp_report.nodes if r.decision == "fp32"}
    assert _first_tensor(gm(*inputs)).dtype == torch.float32


@pytest.mark.parametrize("op, fn", [pytest.param(op, fn, id=f"{op}-{label}") for op, entries in promote_cases().items() for label, fn in entries])
def test_promote_ops_run_in_the_widest_input_dtype(op, fn):
    mixed = amp_fx.convert(Call(lambda m, a: fn(a, a.to(LOW))), "O1", dtype=LOW, cast_model_outputs=False)
    assert op in {r.op for r in mixed.amp_report.nodes if r.decision == "promote"}
    assert mixed(r(4, 8)).dtype == torch.float32
    both_low = amp_fx.convert(Call(lambda m, a: fn(a.to(LOW), a.to(LOW))), "O1", dtype=LOW, cast_model_outputs=False)
    assert both_low(r(4, 8)).dtype == LOW


@pytest.mark.parametrize("op, module, inputs", _flat(follow_cases()))
def test_follow_ops_keep_their_input_dtype(op, module, inputs):
    fp32 = amp_fx.convert(module, "O1", dtype=LOW, cast_model_outputs=False)
    # decided by its FOLLOW row (rule "table"), not as an unknown op, which follows too but is counted unknown
    assert op in {r.op for r in fp32.amp_report.nodes if r.decision == "follow" and r.rule == "table"}
    assert _first_tensor(fp32(*inputs)).dtype == torch.float32
    low = amp_fx.convert(LowInput(module), "O1", dtype=LOW, cast_model_outputs=False)
    assert _first_tensor(low(*inputs)).dtype == LOW


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("as_module", [False, True])
def test_binary_cross_entropy_is_banned_in_both_low_dtypes(dtype, as_module):
    model = Wrap(nn.BCELoss()) if as_module else Call(lambda m, p, y: F.binary_cross_entropy(p, y))
    model.arity = 2
    with pytest.raises(amp_fx.BannedOpError, match="binary_cross_entropy_with_logits"):
        amp_fx.convert(model, "O1", dtype=dtype, cast_model_outputs=False)


def test_allow_banned_runs_binary_cross_entropy_in_fp32():
    model = LowInput(_with_arity(Call(lambda m, p, y: F.binary_cross_entropy(p, y)), (0, 0)))
    gm = amp_fx.convert(model, "O1", allow_banned=True)
    p, y = torch.rand(4), torch.rand(4)
    out = gm(p, y)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.binary_cross_entropy(p.to(LOW).float(), y))


def test_fp16_low_ops_run_in_fp16_on_small_shapes():
    gm = amp_fx.convert(Wrap(nn.Linear(8, 4)), "O1", dtype=torch.float16, cast_model_outputs=False)
    assert gm(r(2, 8)).dtype == torch.float16
    gm = amp_fx.convert(Wrap(nn.Conv2d(3, 4, 3)), "O1", dtype=torch.float16, cast_model_outputs=False)
    assert gm(r(1, 3, 5, 5)).dtype == torch.float16


def _to_low(value, dtype):
    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


@pytest.mark.parametrize("input_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op, module, inputs", _flat(low_cases()))
def test_low_ops_take_low_inputs_beside_fp32_parameters(op, module, inputs, input_dtype):
    """Low inputs into a GEMM/conv whose parameters are fp32 convert with example inputs (the dtype analysis
    runs each op on the dtypes it will get) and run in the conversion's low dtype, as autocast would."""
    low_inputs = tuple(_to_low(value, input_dtype) for value in inputs)
    gm = amp_fx.convert(module, "O1", dtype=LOW, cast_model_outputs=False, example_inputs=low_inputs)
    assert op in {r.op for r in gm.amp_report.nodes if r.decision == "low"}
    assert _first_tensor(gm(*low_inputs)).dtype == LOW


def _one_tensor_follow_calls():
    """(op, fn, arity) for each FOLLOW op torch spells as ``torch.op``, ``F.op`` or ``Tensor.op`` taking ``(x,) * arity``."""
    from amp_fx.ir.op_keys import op_name_of
    x, calls = r(4, 8), []
    for op in sorted(tables.FOLLOW):
        for owner, prefix in ((torch, "torch"), (F, "torch.nn.functional"), (torch.Tensor, "torch.Tensor")):
            fn = getattr(owner, op, None)
            if fn is None or op_name_of(f"{prefix}.{op}") != op:
                continue
            for arity in (1, 2, 3):
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        out = fn(*(x,) * arity)
                except Exception:
                    continue
                # a float result's dtype says the decision; a comparison's bool result is checked by its row only
                if isinstance(out, torch.Tensor) and out.dtype in (x.dtype, torch.bool):
                    calls.append((op, fn, arity))
                    break
            else:
                continue
            break
    return calls


class _EveryCall(nn.Module):
    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def forward(self, x):
        return tuple(fn(*(x,) * arity) for _, fn, arity in self.calls)


def test_follow_ops_without_a_case_are_decided_by_their_row():
    """FOLLOW ops with no case of their own, called in one model: each decided by its row, not as an unknown op.

    Mutation testing (tools/mutation/mutate_tables.py) deleted FOLLOW rows one at a time: an unknown op follows
    as well, so a deleted row changed no dtype any test read (it changes the report and on_unknown_op's say).
    """
    calls = _one_tensor_follow_calls()
    assert len({op for op, _, _ in calls}) >= 75, [op for op, _, _ in calls]
    check_follow_calls(calls)


def check_follow_calls(calls):
    """Each call's op decided follow by its row, at O1 with on_unknown_op="error", its low input kept low."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = amp_fx.convert(LowInput(_EveryCall(calls)), "O1", dtype=LOW, cast_model_outputs=False,
                            on_unknown_op="error")
        outs = gm(r(4, 8))
    rows = {r.op: (r.decision, r.rule) for r in gm.amp_report.nodes if r.op in {op for op, _, _ in calls}}
    assert rows == {op: ("follow", "table") for op, _, _ in calls}
    assert [out.dtype for out in outs if out.dtype != torch.bool] == [LOW] * sum(out.dtype != torch.bool for out in outs)
