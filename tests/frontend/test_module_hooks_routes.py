"""Module hooks on the other routes: the compiler backend, a compiled converted module, and torch.export.

The rules under test: under ``torch.compile(model, backend=amp_fx.backend(...))``
and ``torch.compile(amp_fx.convert(model))`` every hook fires as often as in
eager and changes outputs and gradients as it does there; the torch.export
route, which would run hooks once while tracing and keep their effect, refuses
a hooked model (at conversion, and at the first call after a hook is
registered) naming the module and the routes that keep hooks.

Bounds as in test_module_hooks.py: both sides run every op in the same
dtype (layer_norm low on both, as CPU autocast runs it), so values agree
within a few bf16 roundings of O(1) terms: ``rtol=atol=2**-4``.
"""

import pytest
import torch
import torch.nn as nn

import amp_fx
from amp_fx.errors import AmpRuntimeError, UnsupportedConstructError
from test_module_hooks import AS_AUTOCAST, BOUND, KINDS, Net, _autocast, _run


def _double(module, args, output):
    """A picklable forward hook (a module-level function)."""
    return output * 2.0


def _all_hooks(model):
    log = []
    for register in KINDS.values():
        register(model, log)
    return log


def _counts(log):
    counts = {}
    for module, _ in log:
        counts[id(module)] = counts.get(id(module), 0) + 1
    return counts


def test_the_backend_keeps_every_hook_kind():
    model = Net()
    log = _all_hooks(model)
    x = torch.randn(4, 8)
    ref_out, ref_grad, ref_log = _run(_autocast(model), x, log)
    compiled = torch.compile(model, backend=amp_fx.backend(level="O1", inner="aot_eager", policy=AS_AUTOCAST))
    out, grad, seen = _run(compiled, x, log)
    assert _counts(seen) == _counts(ref_log) and len(seen) == len(KINDS)
    torch.testing.assert_close(out, ref_out, **BOUND)
    torch.testing.assert_close(grad, ref_grad, **BOUND)


def test_a_compiled_converted_module_keeps_its_hooks():
    model = Net()
    log = _all_hooks(model)
    x = torch.randn(4, 8)
    gm = amp_fx.convert(model, "O1")
    ref_out, ref_grad, ref_log = _run(gm, x, log)
    out, grad, seen = _run(torch.compile(gm, backend="aot_eager"), x, log)
    assert [(m, [s[0] for s in snaps if s]) for m, snaps in seen] == [(m, [s[0] for s in snaps if s]) for m, snaps in ref_log]
    torch.testing.assert_close(out, ref_out, **BOUND)
    torch.testing.assert_close(grad, ref_grad, **BOUND)


class Untraceable(nn.Module):
    """A branch on a traced size: fx cannot trace it, torch.export can."""

    def __init__(self):
        super().__init__()
        self.inner = Net()

    def forward(self, x):
        if x.shape[0] > 0:
            return self.inner(x)
        return self.inner(x + 1)


def test_a_hooked_model_the_export_route_would_refuse_takes_the_call_route():
    from probes import captured_because  # (here: a process unpickling this file's hooks lacks tests/ on its path)

    model = Untraceable()
    handle = model.inner.fc2.register_forward_hook(lambda mod, a, o: o + 1.0)
    x = torch.randn(4, 8)
    hooked, _ = captured_because(model, "'inner.fc2'", "torch.export", "backend='amp_fx'", example_inputs=(x,))
    hooked_out = hooked(x)
    handle.remove()
    gm = amp_fx.convert(model, "O1", example_inputs=(x,))
    assert gm.amp_report.route == "torch.export"
    out = gm(x)
    model.inner.fc2.register_forward_hook(lambda mod, a, o: o + 1.0)
    with pytest.raises(AmpRuntimeError, match=r"'inner\.fc2'.*torch\.export.*backend='amp_fx'.*cannot be a leaf"):
        gm(x)
    compiled = torch.compile(model, backend=amp_fx.backend(level="O1", inner="aot_eager"))
    torch.testing.assert_close(compiled(x), out + 1.0, **BOUND)  # the route the error names keeps the hook
    torch.testing.assert_close(hooked_out, out + 1.0, **BOUND)  # and so does the call route convert() took


def test_the_export_failure_advises_a_leaf_only_where_one_helps():
    """fx failing in the model's own forward (Untraceable, as HF models do): the backend only, no leaf advice (the
    tester's complaint). fx failing in a submodule: the leaf is named, and converting with it keeps the hook live."""
    from probes import captured_because  # (here: a process unpickling this file's hooks lacks tests/ on its path)

    model = Untraceable()
    model.inner.fc2.register_forward_hook(lambda mod, a, o: o + 1.0)
    x = torch.randn(4, 8)
    _, message = captured_because(model, "model's own forward, which cannot be a leaf", example_inputs=(x,))
    assert "leaf_modules=[" not in message

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = Untraceable()
            self.head = nn.Linear(4, 4)

        def forward(self, x):
            return self.head(self.body(x))

    model = Outer()
    model.head.register_forward_hook(lambda mod, a, o: o + 1.0)
    captured_because(model, "leaf_modules=['body']", example_inputs=(x,))
    gm = amp_fx.convert(model, "O1", leaf_modules=["body"])
    assert gm.amp_report.route == "symbolic_trace"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x).float()
    torch.testing.assert_close(gm(x), expected, **BOUND)  # the hook's +1.0 in both
    model.body.inner.fc1.register_forward_hook(lambda mod, a, o: o * 0.0)  # inside the leaf, after conversion
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x).float()
    torch.testing.assert_close(gm(x), expected, **BOUND)


def test_the_backend_keeps_global_module_hooks_that_convert_refuses():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, a, o: seen.append(type(mod).__name__))
    try:
        with pytest.raises(UnsupportedConstructError, match="register_module_forward_hook"):
            amp_fx.convert(model)
        compiled = torch.compile(model, backend=amp_fx.backend(level="O1", inner="aot_eager"))
        with pytest.warns(UserWarning, match="global hooks"):  # torch's note: its OptimizedModule fires them too
            compiled(torch.randn(4, 8))
    finally:
        handle.remove()
    assert seen[:4] == ["Linear", "ReLU", "Linear", "Sequential"]


def test_a_module_pickled_in_one_process_runs_its_boundaries_in_another():
    """The boundary targets are rebuilt from their import names; the hooks saved with the converted module fire."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    handle = model[0].register_forward_hook(_double)
    gm = amp_fx.convert(model, "O1")
    gm.get_submodule("2").register_forward_hook(_double)
    x = torch.randn(4, 8)
    gm(x)  # the call that rebuilds the graph with a boundary at "2"
    code = ("import pickle, sys, torch\n"
            "sys.path.insert(0, sys.argv[1])\n"
            "gm, x = pickle.loads(sys.stdin.buffer.read())\n"
            "sys.stdout.buffer.write(pickle.dumps(gm(x)))\n")
    import os
    import pickle
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__)], input=pickle.dumps((gm, x)),
                          capture_output=True, timeout=120, check=True)
    out = pickle.loads(done.stdout)
    # Only the converted module's own hook travels with it; the model's stays with the model (here: removed).
    handle.remove()
    expected = gm(x)
    assert torch.equal(out, expected) and torch.equal(out, amp_fx.convert(model, "O1")(x) * 2.0)
