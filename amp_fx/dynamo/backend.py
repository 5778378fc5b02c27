"""``torch.compile(model, backend="amp_fx")``: the amp_fx rewrite as a Dynamo compiler backend.

Every graph Dynamo captures (one per piece of a graph-broken model, one per
recompile) goes through the same analyses and passes as ``convert()``
(:func:`amp_fx.converter.pipeline.rewrite_graph`), then to an inner backend:
``"inductor"`` (default), ``"aot_eager"``, ``"eager"``, any registered name,
or any callable backend.  Parameters reach a Dynamo graph as placeholders;
they are recognised as weights from Dynamo's sources
(:mod:`amp_fx.dynamo.graph`), so each is cast once per forward and the
report names them.  Module paths are those of ``model.named_modules()`` in
every graph, also in a submodule's frames that Dynamo compiles on their own
after a graph break (:mod:`amp_fx.dynamo.frames`); a module policy that would
decide the modules sharing such a frame differently keeps each graph to its
module, or is refused.  A graph that runs ``torch.func.grad``/``jvp`` inline
is refused (:mod:`amp_fx.dynamo.transforms`); ``torch.vmap`` is converted.

Settings: ``torch.compile(m, backend=amp_fx.backend(level="O1", dtype=torch.bfloat16, inner="aot_eager"))``
or ``torch.compile(m, backend="amp_fx", options={"level": "O1", "inner": "aot_eager"})``.

Reports: :func:`last_report` returns the :class:`~amp_fx.dynamo.report.CompiledReport`
of the model compiled (or recompiled) last, covering all its graphs; an
:class:`AmpBackend` object also keeps its own in ``.report``.  When Dynamo
skips a model's frames or breaks them before every GEMM, so that nothing is
converted, :mod:`amp_fx.dynamo.watch` warns (``NothingConvertedWarning``)
and the report says why.  What Dynamo runs eagerly between graphs gets the
same decisions (:mod:`amp_fx.dynamo.between_graphs`).

This module names and finds the backend objects (:func:`backend`, the
registered name, the model a compile is for); converting a graph is
:class:`~amp_fx.dynamo.compiler.AmpBackend`'s job.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
import torch.fx as fx

from amp_fx.dynamo import watch
from amp_fx.dynamo.compiler import AmpBackend
from amp_fx.dynamo.report import CompiledReport, last_published
from amp_fx.ir.policy import Policy
from amp_fx.errors import AmpValueError

__all__ = ["AmpBackend", "backend", "amp_fx_backend", "last_report", "CompiledReport"]


def backend(level: str = "O1", dtype: Union[None, str, torch.dtype] = None, policy: Union[None, Policy, Mapping] = None,
            pad_gemm: Union[None, str, bool] = None, inner: Union[str, Callable] = "inductor", **options: Any) -> AmpBackend:
    """Return a ``torch.compile`` backend that converts each captured graph, then compiles it with ``inner``.

    Args:
        level: ``"O1"`` (op tables; fp32 parameters cast once per forward in
            the graph) or ``"O0"`` (graph unchanged).  ``"O2"``/``"O3"`` need
            the model's parameters, which a backend never sees: they raise
            and point to ``torch.compile(amp_fx.convert(model, level="O2"))``.
        dtype: the low dtype; None picks float16 for CUDA graphs and bfloat16 otherwise.
        policy: overrides, as for :func:`amp_fx.convert`.
        pad_gemm: as for :func:`amp_fx.convert`.
        inner: ``"inductor"``, ``"aot_eager"``, ``"eager"``, another registered
            backend name, or a callable backend ``(gm, example_inputs) -> callable``.
        **options: the other :func:`amp_fx.convert` options
            (``keep_batchnorm_fp32``, ``cast_model_outputs``, ``on_unknown_op``,
            ``allow_banned``, ``minimize_casts``).

    The compiled graphs run with any outer ``torch.autocast`` disabled, since
    they already hold their casts.
    """
    return AmpBackend(level=level, dtype=dtype, policy=policy, pad_gemm=pad_gemm, inner=inner, **options)


# -- the registered name ----------------------------------------------------
# torch.compile(m, backend="amp_fx", options={...}) builds one
# torch._TorchCompileWrapper per call and invokes amp_fx_backend through it;
# keying on that wrapper gives each compiled model its own AmpBackend (and so
# its own report).  Without a wrapper, backends are shared per settings.
_BY_WRAPPER: list[tuple[weakref.ref, AmpBackend]] = []
_BY_SETTINGS: dict[str, AmpBackend] = {}


def _calling_wrapper() -> Any:
    """The ``torch._TorchCompileWrapper`` Dynamo is compiling with now, or None.

    Dynamo's translator for the frame being compiled holds the compiler it
    was given (``tx.output.compiler_fn``), wrapped for debugging; unwrapping
    that chain finds the wrapper ``torch.compile`` built for this model.
    """
    wrapper_type = getattr(torch, "_TorchCompileWrapper", None)
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        compiler = InstructionTranslator.current_tx().output.compiler_fn
    except (ImportError, AttributeError):  # not inside a Dynamo compile (called directly)
        return None
    for _ in range(8):
        if compiler is None or (wrapper_type is not None and isinstance(compiler, wrapper_type)):
            return compiler
        compiler = getattr(compiler, "_torchdynamo_orig_backend", None) or getattr(compiler, "compiler_fn", None)
    return None


def _backend_for(options: Mapping[str, Any], wrapper: Any = None) -> AmpBackend:
    wrapper = wrapper if wrapper is not None else _calling_wrapper()
    if wrapper is not None:
        _BY_WRAPPER[:] = [(ref, be) for ref, be in _BY_WRAPPER if ref() is not None]
        for ref, be in _BY_WRAPPER:
            if ref() is wrapper:
                return be
        created = backend(**options)
        _BY_WRAPPER.append((weakref.ref(wrapper), created))
        return created
    key = repr(sorted(options.items(), key=lambda item: item[0]))
    if key not in _BY_SETTINGS:
        _BY_SETTINGS[key] = backend(**options)
    return _BY_SETTINGS[key]


def _amp_fx_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], *, options: Optional[Mapping[str, Any]] = None,
                    mode: Optional[str] = None) -> Callable:
    """The backend registered as ``"amp_fx"``; ``torch.compile(..., options={...})`` passes :func:`backend`'s keywords."""
    if mode not in (None, "default"):
        raise AmpValueError(
            f"mode={mode!r} tunes inductor; amp_fx has no modes. Pass a configured inner backend instead, "
            "e.g. options={'inner': my_inductor_backend}."
        )
    return _backend_for(dict(options or {}))(gm, example_inputs)


def _reset_registered() -> None:
    for _, be in _BY_WRAPPER:
        be.reset()
    for be in _BY_SETTINGS.values():
        be.reset()


_amp_fx_backend.reset = _reset_registered  # type: ignore[attr-defined]


def _watched_backend(compiler_fn: Any) -> Optional[tuple[Any, AmpBackend]]:
    """The compiled model and the AmpBackend a Dynamo compile's ``compiler_fn`` stands for; None if not amp_fx.

    Dynamo wraps the backend for debugging (``_torchdynamo_orig_backend``) and
    ``torch.compile`` in one ``_TorchCompileWrapper`` per call: that wrapper
    is the compiled model.  Level O0 converts nothing by design: not watched.
    """
    wrapper_type = getattr(torch, "_TorchCompileWrapper", None)
    wrapper = None
    for _ in range(8):
        if isinstance(compiler_fn, AmpBackend):
            found = compiler_fn
        elif wrapper_type is not None and isinstance(compiler_fn, wrapper_type):
            wrapper, compiler_fn = compiler_fn, compiler_fn.compiler_fn
            continue
        elif compiler_fn is _amp_fx_backend and wrapper is not None:
            found = _backend_for(dict(wrapper.kwargs.get("options") or {}), wrapper)
        else:
            compiler_fn = getattr(compiler_fn, "_torchdynamo_orig_backend", None)
            if compiler_fn is None:
                return None
            continue
        return None if found.config.level == "O0" else (wrapper if wrapper is not None else found, found)
    return None


watch.set_resolver(_watched_backend)
watch.ensure_watching()  # when torch._dynamo was imported first (or Dynamo's entry point imports this module)


def __getattr__(name: str) -> Any:
    # "amp_fx" is an entry point: the first torch.compile(..., backend="amp_fx") of a process reads this name,
    # after importing torch._dynamo, so a model whose every frame Dynamo skips is watched even when `import amp_fx`
    # came first (when the callbacks could not be registered without importing Dynamo).
    if name == "amp_fx_backend":
        watch.ensure_watching()
        return _amp_fx_backend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "amp_fx_backend"})


def last_report() -> Optional[CompiledReport]:
    """The report of the model compiled (or recompiled) last with the amp_fx backend: all its graphs.

    When Dynamo skipped that model's frames or broke them before every GEMM,
    so that nothing was converted, the report says so first
    (``report.nothing_converted`` is True, ``report.breaks`` holds Dynamo's
    reasons, and ``print(report)`` begins ``nothing converted: Dynamo skipped
    forward (model.py:12) because: ...``).  None while no model compiled with
    an amp_fx backend has run since the process started.  For a particular
    model, keep the backend object: ``be = amp_fx.backend(...);
    torch.compile(m, backend=be); ...; be.report``.
    """
    watch.ensure_watching()
    return last_published()
