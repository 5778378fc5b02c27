"""Torch's alias ops and the op each one is: ``special_expm1`` is ``expm1``, ``arccos`` is ``acos``.

torch implements each of these as a single call of its target
(CompositeImplicitAutograd): under ``torch.autocast`` the alias itself has no
kernel, the call decomposes, and autocast decides the target.  So an alias
takes its target's canonical name in :mod:`amp_fx.ir.op_keys`, and with it the
target's table entry, properties and policy rules (``"op:expm1"`` decides
``torch.special.expm1`` too).

The list is torch's own alias information, read once by hand and kept
complete by a test: ``tests/ir/test_op_aliases.py`` finds every ATen op that
decomposes into one call of another op with the same arguments (torch's
dispatcher, not a list) and checks that each whose target is in a table is
here, and that amp_fx decides each alias as torch.autocast does.  Listed
are the aliases whose target is in a table; one whose target is in none
(``special_i0``) stays an unknown op under the name the user wrote, and one
that is itself a table key (``swapaxes``, a view) has its own entry.
"""

from __future__ import annotations

__all__ = ["ALIASES", "target_of"]

ALIASES: dict[str, str] = {
    # torch.special
    "special_expm1": "expm1", "special_log1p": "log1p", "special_erfinv": "erfinv", "special_erf": "erf",
    "special_expit": "sigmoid", "special_round": "round", "special_log_softmax": "log_softmax",
    "special_softmax": "softmax", "special_logsumexp": "logsumexp",
    # NumPy spellings
    "arccos": "acos", "arcsin": "asin", "arctan2": "atan2", "absolute": "abs", "divide": "div", "true_divide": "div",
    "multiply": "mul",
    "subtract": "sub", "negative": "neg", "fix": "trunc", "greater": "gt", "greater_equal": "ge", "less": "lt",
    "less_equal": "le", "not_equal": "ne", "clip": "clamp", "concat": "cat", "concatenate": "cat",
    # torch.linalg's and its older names
    "linalg_diagonal": "diagonal", "linalg_matmul": "matmul", "det": "linalg_det", "inverse": "linalg_inv",
    "slogdet": "linalg_slogdet", "pinverse": "linalg_pinv",
}


def target_of(name: str) -> str:
    """The op ``name`` is an alias of, or ``name`` itself."""
    return ALIASES.get(name, name)
