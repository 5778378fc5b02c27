"""Every warning amp_fx emits derives from amp_fx.AmpWarning: one filter raises or silences them all (issue 36)."""

from __future__ import annotations

import ast
import importlib
import os
import warnings

import pytest
import torch
import torch.nn as nn

import amp_fx
import amp_fx.passes


def _source_files():
    """(module name, path) of every module of the package: amp_fx/ and passes/ (installed as amp_fx.passes)."""
    roots = {os.path.dirname(amp_fx.__file__): "amp_fx", os.path.dirname(amp_fx.passes.__file__): "amp_fx.passes"}
    seen = set()
    for root, package in roots.items():
        for folder, _, files in os.walk(root):  # os.walk does not follow the amp_fx/passes link: passes/ is its own root
            for name in sorted(files):
                path = os.path.realpath(os.path.join(folder, name))
                if not name.endswith(".py") or path in seen:
                    continue
                seen.add(path)
                parts = os.path.relpath(os.path.join(folder, name), root)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                yield ".".join([package, *parts]), path


def _warn_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr in ("warn", "warn_explicit")
                and isinstance(func.value, ast.Name) and func.value.id == "warnings") or (
                isinstance(func, ast.Name) and func.id == "warn"):
            yield node


def _category(call: ast.Call):
    for keyword in call.keywords:
        if keyword.arg == "category":
            return keyword.value
    return call.args[1] if len(call.args) > 1 else None


def _resolve(module, expr: ast.AST):
    """The class a category expression names in ``module`` (a Name or a dotted attribute), or None."""
    if isinstance(expr, ast.Name):
        return getattr(module, expr.id, None)
    if isinstance(expr, ast.Attribute):
        owner = _resolve(module, expr.value)
        return getattr(owner, expr.attr, None) if owner is not None else None
    return None


def test_every_warnings_warn_in_the_package_names_an_AmpWarning_category():
    """A scan of the source: each warnings.warn call passes a category that is an AmpWarning subclass.

    A new bare ``warnings.warn(message)`` (a plain UserWarning) fails here.
    """
    bad, checked = [], 0
    for name, path in _source_files():
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), path)
        calls = list(_warn_calls(tree))
        if not calls:
            continue
        module = importlib.import_module(name)
        for call in calls:
            checked += 1
            expr = _category(call)
            category = _resolve(module, expr) if expr is not None else None
            if not (isinstance(category, type) and issubclass(category, amp_fx.AmpWarning)):
                shown = ast.unparse(expr) if expr is not None else "no category (UserWarning)"
                bad.append(f"{path}:{call.lineno}: {shown}")
    assert checked >= 8, checked  # the scan found the package's warnings (it would pass vacuously otherwise)
    assert not bad, "warnings.warn without an AmpWarning category:\n" + "\n".join(bad)


def test_the_scan_catches_a_bare_warning():
    """The checker itself: a bare call and a UserWarning call are reported, an AmpWarning subclass is not."""
    source = ("import warnings\nfrom amp_fx.errors import AmpWarning\n"
              "warnings.warn('a')\nwarnings.warn('b', UserWarning)\nwarnings.warn('c', category=AmpWarning)\n")
    module = type(warnings)("probe")
    module.AmpWarning, module.UserWarning = amp_fx.AmpWarning, UserWarning
    verdicts = []
    for call in _warn_calls(ast.parse(source)):
        expr = _category(call)
        category = _resolve(module, expr) if expr is not None else None
        verdicts.append(isinstance(category, type) and issubclass(category, amp_fx.AmpWarning))
    assert verdicts == [False, False, True]


class _Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * 2 if self.training else self.fc(x)


def test_one_filter_raises_a_frozen_training_warning():
    gm = amp_fx.convert(_Branches(), "O1", dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", amp_fx.AmpWarning)
        with pytest.raises(amp_fx.AmpWarning, match="branches on self.training"):
            gm.eval()


def test_one_filter_raises_the_no_gradient_step_warning():
    """A bf16 LossScaler (no scaling) stepping an optimizer whose parameters got no gradient."""
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amp_fx.LossScaler(dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", amp_fx.AmpWarning)
        with pytest.raises(amp_fx.AmpWarning, match="none of the optimizer's parameters has a gradient"):
            scaler.step(optimizer)


def test_one_filter_raises_the_hook_warning_with_torchs_text():
    """An always_call forward hook that fails while the forward fails: torch's text, an AmpWarning's class."""
    class Fails(nn.Module):
        def forward(self, x):
            return torch.linalg.cholesky(x)  # -eye is not positive definite: raises at run time

    def hook(module, args, output):
        raise ValueError("hook failed")

    model = nn.Sequential(nn.Tanh(), Fails())
    model[1].register_forward_hook(hook, always_call=True)
    gm = amp_fx.convert(model, "O0")
    texts = []
    for fn in (model, gm):
        with warnings.catch_warnings(record=True) as caught, pytest.raises(RuntimeError, match="positive-definite"):
            warnings.simplefilter("always")
            fn(-torch.eye(4))
        texts.append([(w.category, str(w.message)) for w in caught if "always_call" in str(w.message)])
    (eager_category, eager_text), = texts[0]
    (category, text), = texts[1]
    assert text == eager_text and issubclass(category, amp_fx.AmpWarning) and not issubclass(eager_category, amp_fx.AmpWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error", amp_fx.AmpWarning)
        with pytest.raises(amp_fx.AmpWarning, match="always_call=True"):
            gm(-torch.eye(4))


class _Loop(nn.Module):
    """A Python loop over the length: symbolic tracing fails, torch.export takes it and fixes the length."""

    def __init__(self):
        super().__init__()
        self.embed, self.fc = nn.Embedding(16, 8), nn.Linear(8, 8)

    def forward(self, input_ids):
        h = self.fc(self.embed(input_ids))
        return sum(h[:, index] for index in range(h.shape[1]))


def test_one_filter_raises_the_static_shape_warning_and_ignore_silences_all():
    """The export route keeps the length static: an AmpWarning; "ignore" on the base silences it."""
    ids = torch.zeros(2, 3, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("error", amp_fx.AmpWarning)
        with pytest.raises(amp_fx.AmpWarning, match=r"torch.export kept input_ids.shape\[1\] == 3 static"):
            amp_fx.convert(_Loop(), "O1", dtype=torch.bfloat16, example_kwarg_inputs={"input_ids": ids})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", amp_fx.AmpWarning)
        gm = amp_fx.convert(_Loop(), "O1", dtype=torch.bfloat16, example_kwarg_inputs={"input_ids": ids})
    assert any("kept input_ids.shape[1] == 3 static" in note for note in gm.amp_report.notes)
    assert not [w for w in caught if "kept input_ids" in str(w.message)]


def test_every_warning_class_is_public_as_amp_fx_name():
    """Each category the package warns with is reachable as ``amp_fx.<ClassName>`` (docs/refusals.md lists them)."""
    missing = []
    for name, path in _source_files():
        with open(path, encoding="utf-8") as handle:
            calls = list(_warn_calls(ast.parse(handle.read(), path)))
        module = importlib.import_module(name) if calls else None
        for call in calls:
            category = _resolve(module, _category(call)) if _category(call) is not None else None
            if isinstance(category, type) and getattr(amp_fx, category.__name__, None) is not category:
                missing.append(f"{path}:{call.lineno}: {category.__name__} (add it to amp_fx/__init__.py's _LAZY)")
    assert not missing, "\n".join(missing)


def test_a_warning_made_an_error_inside_a_pass_reaches_the_user_as_that_warning():
    """A user's ``simplefilter("error", AmpWarning)`` turns a pass's warning into that warning raised, not a PassError
    (found by a README-only tester: fp8 requested on tiny GEMMs raised PassError, which ``except AmpWarning`` missed)."""
    import torch.nn as nn

    with warnings.catch_warnings():
        warnings.simplefilter("error", amp_fx.AmpWarning)
        with pytest.raises(amp_fx.Fp8NothingConvertedWarning):
            amp_fx.convert(nn.Sequential(nn.Linear(16, 32)), "O1", fp8=True)
