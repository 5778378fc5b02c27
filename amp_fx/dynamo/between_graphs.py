"""Decide the precision of the ops Dynamo runs eagerly between a compiled model's graphs.

A graph break leaves code that Dynamo runs eagerly: the call that broke (an
``nn.TransformerEncoder`` whose mask check calls ``.item()`` runs whole,
every layer of it, since torch's own frames are never compiled on their
own), a frame Dynamo skipped, an ``nn.LSTM`` without ``allow_rnn``.  The
backend never sees those ops; without this module they run fp32.

:class:`EagerDecisions` is a ``TorchFunctionMode``: it sits above autograd
(the casts it makes are recorded and differentiated) and sees each torch
call the eager code makes.  Each call gets the decision it would get inside
a graph:

- an op amp_fx's tables decide (``linear``, ``lstm``, ``softmax``, ``cat``
  ...) runs as the table says, its floating-point tensor inputs cast as the
  graph pass would cast them (low: fp32 inputs to the low dtype; fp32: low
  inputs to fp32; promote: to the widest); a policy ``"op:..."`` rule takes
  precedence;
- a Python composite the tables name as one op (``F.multi_head_attention_forward``)
  and any call no table names (``torch._transformer_encoder_layer_fwd``)
  run under ``torch.autocast`` with the backend's dtype: the mode does not
  see the torch calls inside them, autocast decides those, and its lists
  match amp_fx's for GEMMs;
- in-place calls, calls writing into ``out=``, calls inside the user's own
  ``torch.autocast`` region (``enabled=False`` and other dtypes included: the
  region keeps autocast's meaning) and Python code run by autograd's
  backward are left alone; a
  policy's ``"fp8"`` runs the low dtype (fp8 needs a graph's scaled GEMM);
- module and type rules of a policy apply too: the module calls on the
  Python stack name the op's modules, as ``model.named_modules()`` does;
  a GEMM outside any module of the compiled model (a compiled function's
  own code) cannot be reached by them, and :class:`BetweenGraphsWarning`
  says so once.

The mode must be on the mode stack for the whole call of the compiled
model, and already when Dynamo compiles its first frame: Dynamo guards on
the mode stack, so a mode pushed later would make it compile every frame
again.  :func:`attach` runs in Dynamo's compile-start callback (before
Dynamo saves the stack for tracing) on the first compile of a model: it
pushes the mode for the call in progress, and adds a hook to the compiled
callable's Dynamo context that pushes it on every later call.  While
tracing, the mode passes every call through untouched (Dynamo inlines it,
so no graph records it), and while a compiled graph runs the backend
suspends it (:func:`suspended`): graphs hold their own casts.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import warnings
from typing import Any, Callable, Iterator, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode

from amp_fx.dynamo import frames
from amp_fx.errors import AmpWarning
from amp_fx.ir import tables
from amp_fx.ir.op_keys import callable_op_name

__all__ = ["BetweenGraphsWarning", "EagerDecisions", "attach", "suspended"]


class BetweenGraphsWarning(AmpWarning):
    """Ops a compiled model runs eagerly between its graphs could not all get amp_fx's decisions."""


_STATE = threading.local()
# Calls the mode never decides: attribute access, explicit casts, and autograd's entry points
# (a backward under autocast would cast the gradient GEMMs a second time).
_NEVER = frozenset({"__get__", "__set__", "__delete__", "to", "type", "float", "double", "half", "bfloat16",
                    "backward", "grad", "size", "dim", "numel", "data_ptr", "__setitem__", "__torch_function__"})


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Let every call through undecided for the duration of the block (a compiled graph runs: it holds its casts)."""
    depth = getattr(_STATE, "suspended", 0)
    _STATE.suspended = depth + 1
    try:
        yield
    finally:
        _STATE.suspended = depth


def run_suspended(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` inside :func:`suspended` (the hot path: no context manager object)."""
    depth = getattr(_STATE, "suspended", 0)
    _STATE.suspended = depth + 1
    try:
        return fn(*args)
    finally:
        _STATE.suspended = depth


@functools.lru_cache(maxsize=4096)
def _classify(func: Any) -> tuple[Optional[str], str, bool]:
    """(canonical op, table category, writes its first argument) of a torch callable."""
    raw = getattr(func, "__name__", "") or ""
    if raw in _NEVER or isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        # ATen overloads are what compiled graphs (and their backward) call: never the user's eager code.
        return None, "never", False
    inplace = (raw.endswith("_") and not raw.endswith("__")) or (raw.startswith("__i") and raw.endswith("__"))
    try:
        op = callable_op_name(func)
    except Exception:  # a callable op_keys cannot name: autocast decides it
        return None, "unknown", inplace
    if op.startswith("__i") and op.endswith("__"):
        op = op[3:-2]
    return op, tables.table_of(op), inplace


def _in_user_autocast(device_type: str) -> bool:
    """Whether the call runs inside the user's own ``torch.autocast`` region: enabled, or ``enabled=False``.

    ``torch.is_autocast_enabled`` alone misses ``with torch.autocast(..., enabled=False)``,
    whose meaning is "fp32 here": that region must keep it, as autocast and a
    graph do.  Every ``torch.autocast`` block counts itself in autocast's
    thread-local nesting depth, enabled or not; torch offers no getter, so the
    depth is read by bumping it and putting it back.  (The mode's own autocast,
    for calls no table names, is entered with the mode off: it never counts here.)
    """
    if torch.is_autocast_enabled(device_type):
        return True
    depth = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return depth > 1


def _tensors(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """The tensor arguments of a torch call: top level, or in a list or tuple (a TensorList: cat's, lstm's weights)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (item for item in value if isinstance(item, torch.Tensor))


def _device_of(args: tuple, kwargs: dict) -> Optional[torch.device]:
    """The device of the first floating-point tensor argument; None when there is none or the call is a compiler's.

    Fake tensors mean a compiler is tracing (inductor compiling a backward
    graph lazily inside the call): its ops are not the model's.
    """
    device = None
    for value in _tensors(args, kwargs):
        if isinstance(value, FakeTensor):
            return None
        if device is None and value.is_floating_point():
            device = value.device
    return device


def _cast_inputs(args: tuple, kwargs: dict, cast: Callable[[torch.Tensor], torch.Tensor]) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with ``cast`` applied to each floating-point tensor (as :func:`_tensors` finds them)."""
    def one(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return cast(value) if value.is_floating_point() else value
        if isinstance(value, (list, tuple)) and any(isinstance(item, torch.Tensor) for item in value):
            return type(value)(one(item) if isinstance(item, torch.Tensor) else item for item in value)
        return value

    return tuple(one(value) for value in args), {key: one(value) for key, value in kwargs.items()}


def _as_dynamo_traces_it(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` while Dynamo traces, spelled so that it traces as it would without the mode.

    A ``Tensor`` method written in Python (``unflatten``, ``split``, ``__rsub__``
    ...) reaches a torch function mode as that Python function; called as a
    function, Dynamo inlines its body and breaks the graph on the
    ``super().unflatten(...)`` inside it.  Called as a method of the tensor (the
    mode is off the stack here), Dynamo records it as it does with no mode on
    the stack: the mode never costs the user's model a graph break.
    """
    name = getattr(func, "__name__", None)
    if args and isinstance(args[0], torch.Tensor) and name is not None and getattr(torch.Tensor, name, None) is func:
        return getattr(args[0], name)(*args[1:], **kwargs)
    return func(*args, **kwargs)


class EagerDecisions(TorchFunctionMode):
    """Give each eager torch call amp_fx's decision (see the module docstring); graphs run with it suspended."""

    def __init__(self, dtype: Optional[torch.dtype], policy: Any, owner: str) -> None:
        super().__init__()
        self.dtype = dtype  # None: fp16 on CUDA, bf16 elsewhere, as the backend picks per graph
        self.policy = policy
        self.owner = owner
        self.decided = 0  # calls decided since the mode was built (tests read it)
        self.warned = False  # BetweenGraphsWarning is given once per backend
        self.module_rules = [rule.describe() for rule in policy.rules if rule.kind != "op"]

    def low_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype is not None and self.dtype in (torch.float16, torch.bfloat16):
            return self.dtype
        return torch.float16 if device.type == "cuda" else torch.bfloat16

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # Dynamo traces through the mode: nothing of it enters a graph
            return _as_dynamo_traces_it(func, args, kwargs)
        if getattr(_STATE, "suspended", 0) or torch._C._current_graph_task_id() != -1:
            # A graph runs (it holds its casts), or autograd runs a backward (a custom Function's Python backward):
            # backward ops follow the dtypes the forward made, as under autocast.
            return func(*args, **kwargs)
        op, category, inplace = _classify(func)
        if category == "never" or inplace or kwargs.get("out") is not None:
            # An in-place op, or one writing into out=, keeps that tensor's dtype (a cast copy would take the write).
            return func(*args, **kwargs)
        device = _device_of(args, kwargs)
        if device is None or device.type not in ("cpu", "cuda") or _in_user_autocast(device.type):
            return func(*args, **kwargs)  # nothing floating, or the user's own autocast region decides
        low = self.low_dtype(device)
        rule = None
        if self.policy.rules:
            # Module and type rules need the op's modules: the module calls on the Python stack name them.
            stack = frames.enclosing_modules() if self.module_rules else ()
            rule = self.policy.decide(op, func, stack or ())
            if stack is None and category == "low" and rule is None and not self.warned:
                self._warn_module_rules(op)
        decision = rule.decision if rule is not None else category
        self.decided += 1
        if decision in ("low", "fp8") and rule is None and inspect.isfunction(func):
            # A Python composite the tables name as one op (F.multi_head_attention_forward): inside a graph it is a
            # leaf, here its body runs torch calls the mode no longer sees; autocast gives them the tables' decisions.
            decision = "unknown"
        if decision in ("low", "fp8"):  # fp8 needs a graph's scaled GEMM: eagerly, the low dtype
            args, kwargs = _cast_inputs(args, kwargs, lambda t: t.to(low) if t.dtype == torch.float32 else t)
        elif decision in ("fp32", "banned"):  # a banned op, refused in a graph, is safe in fp32
            args, kwargs = _cast_inputs(args, kwargs, lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t)
        elif decision == "promote":
            floats = [t.dtype for t in _tensors(args, kwargs) if t.is_floating_point()]
            widest = max(floats, key=lambda d: torch.finfo(d).bits)
            args, kwargs = _cast_inputs(args, kwargs, lambda t: t.to(widest) if t.dtype != widest else t)
        elif decision == "unknown":
            # A call no table names: autocast decides the ops inside it (a GEMM low, a softmax fp32).
            with torch.autocast(device.type, dtype=low):
                return func(*args, **kwargs)
        return func(*args, **kwargs)  # follow: whatever dtype arrives

    def _warn_module_rules(self, op: Optional[str]) -> None:
        """A GEMM runs eagerly where module rules may have meant it: say once that they cannot reach it."""
        self.warned = True
        warnings.warn(
            f"{op} at {_user_line()} ran eagerly between the graphs of a model compiled with the backend "
            f"{self.owner} (a graph break or a frame Dynamo skipped), outside any module of the compiled model: the "
            f"policy's module and type rules ({', '.join(self.module_rules)}) cannot apply to it, so the op tables (and op "
            "rules) decided it. Measure the share of GEMM FLOPs that ran in each dtype with amp_fx.coverage("
            "compiled_model, *inputs). Ways out: remove the graph break "
            "(torch._dynamo.explain(model)(*inputs) lists them), decide the op with an op rule "
            "(policy={'op:linear': 'fp32'}), or convert first: amp_fx.convert(model, policy=...).",
            BetweenGraphsWarning, stacklevel=3)


def _rnn_input_to_weight_dtype(module: torch.nn.RNNBase, args: tuple) -> Optional[tuple]:
    """Forward pre-hook of the compiled model's RNN modules: let a low-precision input through their dtype check.

    ``nn.RNNBase.check_input`` refuses an input whose dtype differs from the
    weights' unless autocast is on.  Between graphs the input is often bf16 (a
    Linear before the RNN ran low) while autocast is off, so the RNN would
    raise where autocast runs it.  The hook casts the input up to the weights'
    dtype (exact: bf16 and fp16 widen losslessly); the RNN op itself (``lstm``,
    ``gru``, ...) then gets the mode's decision and runs low, as autocast runs
    it.  It acts only while an :class:`EagerDecisions` mode is on the stack,
    outside the user's autocast, and never while Dynamo traces.
    """
    if torch.compiler.is_compiling() or not args or getattr(_STATE, "suspended", 0):
        return None
    if not any(isinstance(mode, EagerDecisions) for mode in torch.overrides._get_current_function_mode_stack()):
        return None
    first = args[0]
    data = first.data if isinstance(first, torch.nn.utils.rnn.PackedSequence) else first
    weight = module._flat_weights[0] if module._flat_weights else None
    if (not isinstance(data, torch.Tensor) or not isinstance(weight, torch.Tensor) or data.dtype == weight.dtype
            or data.dtype not in (torch.float16, torch.bfloat16) or _in_user_autocast(data.device.type)):
        return None
    widened = data.to(weight.dtype)
    first = first._replace(data=widened) if isinstance(first, torch.nn.utils.rnn.PackedSequence) else widened
    return (first, *args[1:])


def _hook_rnn_modules(compiled: Any) -> None:
    """Add :func:`_rnn_input_to_weight_dtype` (once) to each RNN module of the model ``compiled`` calls."""
    owner = getattr(compiled, "__self__", None)  # torch.compile(model): Dynamo's wrapper of model.__call__
    if owner is None:
        owner = getattr(compiled, "__wrapped__", None)
    if not isinstance(owner, torch.nn.Module):
        return  # a compiled function: RNN modules it calls keep torch's check (BetweenGraphsWarning-free: it raises)
    for module in owner.modules():
        if isinstance(module, torch.nn.RNNBase) and not any(
                hook is _rnn_input_to_weight_dtype for hook in module._forward_pre_hooks.values()):
            module.register_forward_pre_hook(_rnn_input_to_weight_dtype)


def _hook_for(backend: Any) -> Callable[[], Callable[[], None]]:
    """An ``enter_exit_hooks`` entry of a Dynamo context: push ``backend``'s mode, return the function that pops it."""

    def enter() -> Callable[[], None]:
        mode = backend.eager_decisions
        mode.__enter__()
        return functools.partial(mode.__exit__, None, None, None)

    enter.amp_fx_backend = backend  # type: ignore[attr-defined]
    return enter


def _entry_frame() -> Any:
    """The innermost ``compile_wrapper`` frame of torch.compile's context on the stack, or None."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "compile_wrapper" and code.co_filename.endswith(("_dynamo/eval_frame.py", "_dynamo\\eval_frame.py")):
            return frame
        frame = frame.f_back
    return None


def _codes(value: Any) -> Iterator[Any]:
    """The code objects of a function or class of this module, nested ones (lambdas) included."""
    value = getattr(value, "__wrapped__", value)  # lru_cache
    functions = vars(value).values() if isinstance(value, type) else [value]
    for function in functions:
        code = getattr(function, "__code__", None)
        stack = [code] if code is not None else []
        while stack:
            code = stack.pop()
            yield code
            stack.extend(const for const in code.co_consts if isinstance(const, type(code)))


@functools.lru_cache(maxsize=None)
def _run_eagerly_in_dynamo() -> None:
    """Keep Dynamo from compiling the mode's own frames when eager code calls it.

    Eager code between graphs runs with Dynamo's frame hook on, so a torch
    call there would make Dynamo compile ``__torch_function__`` as a frame of
    its own, specialised on the callable it was given, and reuse that code for
    a later callable at a recycled address (a property getter returning
    another property's value).  Skipping these code objects leaves them
    eager; Dynamo still inlines the mode while it traces a frame.
    """
    from torch._dynamo.eval_frame import skip_code

    for value in (EagerDecisions, _classify, _in_user_autocast, _tensors, _device_of, _cast_inputs, run_suspended,
                  _rnn_input_to_weight_dtype):
        for code in _codes(value):
            skip_code(code)
    # What the mode calls to classify an op (amp_fx.ir) is never the user's code: skipped as well.
    from amp_fx.ir import op_keys

    for value in vars(op_keys).values():
        if inspect.isfunction(value) and value.__module__ == op_keys.__name__:
            for code in _codes(value):
                skip_code(code)


def attach(backend: Any) -> None:
    """From Dynamo's compile-start callback: make ``backend``'s eager decisions cover the compiled model's calls.

    The first compile of a call adds a hook to the calling Dynamo context
    (``torch.compile``'s wrapper of the model), so every later call pushes
    the mode as it starts, and pushes it now for the call in progress.
    Warns once per backend where no such context is on the stack.
    """
    if backend.config.op_mode == "none":  # O0 decides nothing
        return
    _run_eagerly_in_dynamo()
    frame = _entry_frame()
    context = frame.f_locals.get("self") if frame is not None else None
    hooks = getattr(context, "enter_exit_hooks", None)
    cleanups = frame.f_locals.get("cleanups") if frame is not None else None
    if not isinstance(hooks, list) or not isinstance(cleanups, list):
        _warn_impossible(backend, "amp_fx found no torch.compile context on the stack to enter its eager mode from")
        return
    if any(getattr(hook, "amp_fx_backend", None) is not None for hook in hooks):
        return  # attached already (another amp_fx backend's mode, compiling this context's frames, decides alike)
    _hook_rnn_modules(frame.f_locals.get("fn"))
    hook = _hook_for(backend)
    hooks.append(hook)
    cleanups.append(hook())
    backend.report.eager_decided = True


def _warn_impossible(backend: Any, reason: str) -> None:
    """Warn once per backend that the ops Dynamo runs eagerly for it are not decided (they run fp32)."""
    mode = backend.eager_decisions
    if mode.warned:
        return
    mode.warned = True
    warnings.warn(
        f"{reason}, so the ops a model compiled with the backend {backend.__name__} runs eagerly between its graphs "
        "(graph breaks, frames Dynamo skipped) run in fp32. Measure the share of GEMM FLOPs that ran in each dtype "
        "with amp_fx.coverage(compiled_model, *inputs). Ways out: call the model compiled by torch.compile (or "
        "model.compile()), remove the graph breaks (torch._dynamo.explain(model)(*inputs) lists them), or convert "
        "first: amp_fx.convert(model, ...).", BetweenGraphsWarning, stacklevel=2)


def _user_line() -> str:
    """``file:line`` of the innermost frame on the stack that is neither torch's nor amp_fx's."""
    internal = (torch.__file__.rsplit("/", 1)[0] + "/", __file__.rsplit("/", 2)[0] + "/")
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(internal):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"
