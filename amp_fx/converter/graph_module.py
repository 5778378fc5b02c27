"""AmpGraphModule: the GraphModule that ``convert()`` returns.

It is an ordinary ``torch.fx.GraphModule`` with three additions:

- It runs with autocast disabled when an outer ``torch.autocast`` region is
  active, so ops are never cast twice (the graph already holds its casts).
- At O2/O3, ``state_dict()`` hands back the model's own dtypes (fp32), and
  ``load_state_dict()`` accepts them, so checkpoints move freely between the
  fp32 model and its converted forms.
- It keeps ``amp_report`` / ``amp_config`` (and ``amp_fx_masters`` at O2)
  across ``copy.deepcopy`` and pickling.
- Its modules are its own: a submodule it would share with the model it was
  built from (a leaf such as Dropout or BatchNorm) is replaced by a shallow
  copy holding the same parameter and buffer tensors, so ``.train()`` /
  ``.eval()`` on it never flip the original model's flags.  Each module keeps
  the flag the original had.
- On the torch.export route, whose graphs fix every module's train/eval
  flag and the keyword inputs given, each call runs the graph for the
  current flags and the keywords it gives, built at first use on this
  module's own parameters and buffers (:mod:`amp_fx.converter.specialisations`).
  Where a symbolic-route graph keeps a branch on ``self.training``,
  ``.train()`` / ``.eval()`` that change that mode warn once.
- A grad-mode region left open by an exception in ``forward`` does not leak
  into the caller: the grad mode is restored.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import inspect
import warnings
import weakref
from typing import Any, Iterator, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from amp_fx.converter.buffer_state import SOURCES_ATTR, load_buffer_sources, source_value
from amp_fx.converter.live_hooks import RECIPE_ATTR, STATE_ATTR, check_hooks
from amp_fx.converter.model_attributes import captured_routes, model_attribute
from amp_fx.graph_ops.master_sync import sync_masters, track_masters
from amp_fx.graph_ops.outer_autocast import call_without_outer_autocast
from amp_fx.graph_ops.hook_dispatch import COMPUTATION_HOOKS
from amp_fx.frontend.module_hooks import ORIGINALS_ATTR, bind_sites
from amp_fx.converter.step_guard import guard_low_parameters
from amp_fx.converter.functional_params import restore_swapped, swap_in_low_copies
from amp_fx.converter.specialisations import SPECS_ATTR, UntraceableCallError
from amp_fx.frontend.train_flags import FROZEN_ATTR
from amp_fx.graph_ops.mode_switch import amp_fx_is_switching, switching_modes
from amp_fx.errors import PACKAGE, AmpTypeError, AmpValueError, AmpWarning

__all__ = ["AmpGraphModule", "AMP_ATTRIBUTES", "FrozenTrainingWarning", "switching_modes"]

# Attributes that describe a conversion; carried through deepcopy and pickle.
ROUTE_ATTR = "amp_fx_route"  # how the model was traced: "symbolic_trace" or "torch.export"
AMP_ATTRIBUTES = ("amp_report", "amp_config", "amp_fx_masters", "amp_fx_source_dtypes", "amp_fx_input_dtypes", ROUTE_ATTR, FROZEN_ATTR,
                  SOURCES_ATTR, RECIPE_ATTR, SPECS_ATTR)


class FrozenTrainingWarning(AmpWarning):
    """.train()/.eval() changed a mode that the converted graph was specialised to."""


# A module's forward/backward hook dicts (amp_fx/frontend/module_hooks.py reads the original's live).
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")


def _clone_hooks(clone: nn.Module, module: nn.Module, original: Optional[nn.Module], inside_leaf: bool) -> None:
    """Give ``clone`` its hook dicts (see :func:`_own_modules`)."""
    if original is None:
        return  # not cloned from a traced model (an unpickled copy): its hooks are its own, copied
    if inside_leaf:
        # The leaf calls this submodule itself: sharing the original's dicts is how it sees them live.
        for key in _HOOK_DICTS:
            if key in original.__dict__:
                clone.__dict__[key] = original.__dict__[key]
        clone.__dict__["_is_full_backward_hook"] = True  # a full backward hook registered later must run
        return
    for key in _HOOK_DICTS:
        clone.__dict__[key] = collections.OrderedDict()
    clone.__dict__["_is_full_backward_hook"] = None
    for key, hook in module.__dict__.get("_forward_pre_hooks", {}).items():  # weight_norm & co. compute the weight: they stay
        if isinstance(hook, COMPUTATION_HOOKS):
            clone._forward_pre_hooks[key] = hook


def _shallow_clone(module: nn.Module, memo: dict[int, nn.Module], originals: Optional[dict] = None, path: str = "",
                   leaves: frozenset = frozenset(), inside_leaf: bool = False) -> nn.Module:
    """A new module object with the same parameter and buffer tensors, and its own flags, hooks and children.

    ``originals`` (path -> weak reference to the original model's module, from
    the tracer) says where the hooks live: the clone starts without them (the
    graph's hook boundaries read the original's live), except a submodule of a
    leaf in ``leaves``, which shares the original's hook dicts.
    """
    if id(module) in memo:
        return memo[id(module)]
    clone = type(module).__new__(type(module))  # copy.copy without __getstate__ (a parametrized module refuses it)
    clone.__dict__.update(module.__dict__)
    memo[id(module)] = clone
    for key, value in module.__dict__.items():
        # _parameters, _buffers, hook dicts, RNN's _flat_weights: new containers, same tensors
        if isinstance(value, (dict, list, set)):
            clone.__dict__[key] = copy.copy(value)
    if originals is not None:
        ref = originals.get(path)
        _clone_hooks(clone, module, ref() if ref is not None else None, inside_leaf)
    below = inside_leaf or path in leaves
    clone.__dict__["_modules"] = type(module._modules)(
        (name, None if child is None else _shallow_clone(child, memo, originals, f"{path}.{name}" if path else name, leaves, below))
        for name, child in module._modules.items())
    return clone


def _own_modules(gm: nn.Module, root: nn.Module) -> None:
    """Replace every submodule ``gm`` shares with ``root`` by a shallow clone; copy ``root``'s flags by path.

    The clones' hooks: see :func:`_shallow_clone`.  Then the graph's hook
    boundaries are bound to ``gm`` (amp_fx/frontend/module_hooks.py).
    """
    shared = {id(m) for m in root.modules()}
    originals = getattr(gm.graph, ORIGINALS_ATTR, None)
    leaves = frozenset(str(n.target) for n in gm.graph.nodes if n.op == "call_module")
    memo: dict[int, nn.Module] = {}

    def walk(parent: nn.Module, prefix: str) -> None:
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            path = f"{prefix}.{name}" if prefix else name
            if id(child) in shared:
                parent._modules[name] = _shallow_clone(child, memo, originals, path, leaves)
                continue
            source = sources.get(path)
            if originals is None and source is not None and type(child) is nn.Module:
                for key in (*_HOOK_DICTS, "_is_full_backward_hook"):  # fx's fresh container: keep an unpickled one's hooks
                    if key in source.__dict__:
                        child.__dict__[key] = copy.copy(source.__dict__[key])
            walk(child, path)

    sources = dict(root.named_modules())
    walk(gm, "")
    for path, module in gm.named_modules():
        source = sources.get(path)
        if source is not None and path and isinstance(source.training, bool):
            module.training = source.training
    bind_sites(gm)


MASTER_ATTR = "_amp_fx_master"  # on an O2 low parameter: the fp32 master it was cast from


def _aliases(module: nn.Module) -> dict[str, str]:
    """Every parameter name -> the one ``named_parameters()`` gives its tensor (a tied weight has two names)."""
    first: dict[int, str] = {}
    return {name: first.setdefault(id(p), name) for name, p in module.named_parameters(remove_duplicate=False)}


def attach_masters(module: nn.Module, originals: dict[str, torch.Tensor]) -> None:
    """Record O2's fp32 masters: the original model's parameters of the same names.

    On the module (``amp_fx_masters``, for ``MasterWeightOptimizer(opt, module)``)
    and on each low parameter, so that a tensor handed to ``add_param_group``
    alone still finds its master.  A tied weight has one master, keyed by the
    name ``module.named_parameters()`` gives it, found under any of its names
    in ``originals`` (pass ``named_parameters(remove_duplicate=False)``).
    """
    names: dict[str, list[str]] = {}
    for alias, name in _aliases(module).items():
        names.setdefault(name, []).append(alias)
    module.amp_fx_masters = {}
    for name, aliases in names.items():
        found = next((originals[a] for a in aliases if a in originals), None)
        if found is not None:
            module.amp_fx_masters[name] = found
    for name, param in module.named_parameters():
        if name in module.amp_fx_masters and param is not module.amp_fx_masters[name]:
            setattr(param, MASTER_ATTR, module.amp_fx_masters[name])
    guard_low_parameters(module)  # a plain optimizer's step over these low copies is refused (core/step_guard.py)
    track_masters(module)  # a master written in place is copied again before the next call (core/master_sync.py)


def _restore_source_dtypes(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """state_dict hook: report each low-precision tensor in the dtype the original model had.

    At O2 that is the fp32 master itself wherever the low copy is the master
    rounded (what ``MasterWeightOptimizer`` keeps true after every step), so a
    checkpoint keeps the masters' full precision, under every name of a tied
    weight.  A low copy trained some other way no longer matches its master
    and is saved widened.  A buffer's low copy gives the model's own tensor
    the same way (:func:`amp_fx.converter.buffer_state.source_value`).
    """
    sync_masters(module)  # a master written in place since: its low copy first (core/master_sync.py)
    masters = module.__dict__.get("amp_fx_masters") or {}
    aliases: Optional[dict[str, str]] = None
    for name, dtype in getattr(module, "amp_fx_source_dtypes", {}).items():
        key = prefix + name
        if key not in state_dict or state_dict[key].dtype == dtype:
            continue
        low, master = state_dict[key], masters.get(name)
        if master is None and name not in module.__dict__.get(SOURCES_ATTR, {}):
            aliases = _aliases(module) if aliases is None else aliases
            master = masters.get(aliases.get(name, name))  # the other name of a tied weight
        if master is None:
            exact = source_value(module, name, low, dtype)
            state_dict[key] = exact if exact is not None else low.to(dtype)
            continue
        in_sync = (type(master) in (torch.Tensor, nn.Parameter) and type(low) in (torch.Tensor, nn.Parameter)
                   and master.dtype == dtype and master.shape == low.shape and torch.equal(master.detach().to(low.dtype), low))
        state_dict[key] = master.detach() if in_sync else low.to(dtype)


def _rebuild(reduce_fn: Any, reduce_args: tuple, class_name: str) -> "AmpGraphModule":
    plain = reduce_fn(*reduce_args)
    rebuilt = AmpGraphModule(plain, plain.graph, class_name)
    for name in AMP_ATTRIBUTES:
        if name in reduce_args[0]:
            setattr(rebuilt, name, reduce_args[0][name])
    return rebuilt


def _check_input_dtypes(expected: dict, args: tuple, kwargs: dict) -> None:
    """Refuse a floating input of another dtype than the example inputs had: the graph's casts were placed for those."""
    for key, dtype in expected.items():
        value = args[key] if isinstance(key, int) and key < len(args) else kwargs.get(key) if isinstance(key, str) else None
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
            name = f"input {key}" if isinstance(key, int) else f"input {key!r}"
            raise AmpTypeError(
                f"amp_fx: this module was converted with example inputs whose {name} was {dtype}, and is called with "
                f"{value.dtype}. Its casts were placed for {dtype} (where a value is already in the right dtype no cast "
                f"is written), so other dtypes would run ops in the wrong precision. Convert with example inputs of the "
                f"dtypes you call it with, or without example_inputs (then any floating dtype works).")


def _load_masters(module: nn.Module, state_dict: Any) -> None:
    """Copy loaded values into the module's fp32 masters (O2), where both are plain tensors of the same shape.

    A tied weight's master takes the value under whichever of its names the
    state dict has; the model's buffers take theirs too (O2/O3).
    """
    masters = module.__dict__.get("amp_fx_masters") or {}
    names: dict[str, list[str]] = {}
    for alias, name in (_aliases(module).items() if masters else ()):
        names.setdefault(name, []).append(alias)
    with torch.no_grad():
        for name, master in masters.items():
            value = next((state_dict[a] for a in [name, *names.get(name, ())] if a in state_dict), None)
            plain = type(master) in (torch.Tensor, nn.Parameter) and type(value) in (torch.Tensor, nn.Parameter)
            if plain and value.shape == master.shape:  # (sharded masters load through torch.distributed.checkpoint)
                master.copy_(value)


def _load_sources(module: nn.Module, state_dict: Any, prefix: str, local_metadata: Any, *_: Any) -> None:
    """load_state_dict pre-hook: the fp32 masters (O2) and the model's buffers (O2/O3) take the loaded values.

    It runs for this module's own ``load_state_dict`` and for any parent's, with
    the keys under ``prefix``.  Without it the next ``MasterWeightOptimizer`` step
    would copy the old masters back over the weights just loaded, and the model
    would keep its old statistics.
    """
    if local_metadata.get("assign_to_params_buffers") and module.__dict__.get("amp_fx_source_dtypes"):
        raise AmpValueError(
            "load_state_dict(assign=True) would replace this module's low-precision copies (O2/O3) by the "
            "checkpoint's tensors, which are in the model's dtypes, so the graph would run on them unconverted. "
            "Load without assign=True: the values are copied into the low copies, the fp32 masters and the "
            "model's buffers.")
    own = {key[len(prefix):]: value for key, value in state_dict.items() if key.startswith(prefix)}
    _load_masters(module, own)
    load_buffer_sources(module, own)


_TENSOR_INPUTS: "weakref.WeakKeyDictionary[fx.Graph, frozenset]" = weakref.WeakKeyDictionary()


def _tensor_inputs(gm: fx.GraphModule) -> frozenset:
    """Names of the graph's inputs it uses as tensors: an example tensor traced them, or the graph calls their methods."""
    graph = gm.graph
    cached = _TENSOR_INPUTS.get(graph)
    if cached is not None:
        return cached
    names = set()
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("val", node.meta.get("example_value"))
        used_as_tensor = any(user.op == "call_method" and user.args and user.args[0] is node for user in node.users)
        if isinstance(value, torch.Tensor) or used_as_tensor:
            names.add(node.target)
    _TENSOR_INPUTS[graph] = frozenset(names)
    return _TENSOR_INPUTS[graph]


def _unserved_call(gm: fx.GraphModule, args: tuple, kwargs: dict) -> Optional[str]:
    """Why the graph cannot serve this call (its arguments do not bind, a number where it traced a tensor), or None.

    Only a module that knows its model (the recipe) can hand the call on; the others run the graph as before.
    """
    if getattr(gm.__dict__.get(RECIPE_ATTR), "model", None) is None:
        return None
    try:
        bound = inspect.signature(gm.forward).bind(*args, **kwargs)
    except TypeError as error:
        return f"the traced graph's inputs do not take this call ({error})"
    tensor_inputs = _tensor_inputs(gm)
    for name, value in bound.arguments.items():
        if type(value) in (int, float) and name in tensor_inputs:
            return f"the graph traced input {name!r} as a tensor and this call gives the Python {type(value).__name__} {value!r}"
    return None


class AmpGraphModule(fx.GraphModule):
    """A converted model: a GraphModule with explicit casts (see module docstring)."""

    def __init__(self, root: Any, graph: fx.Graph, class_name: str = "AmpGraphModule"):
        super().__init__(root, graph, class_name)
        self._register_state_dict_hook(_restore_source_dtypes)
        # A hook, not only the method below: a parent's load_state_dict (Lightning, Accelerate, a wrapper module)
        # reaches this module through the hook alone, and must load the masters and the model's buffers too.
        self._register_load_state_dict_pre_hook(_load_sources, with_module=True)
        if isinstance(root, nn.Module):
            _own_modules(self, root)
            self.training = root.training
        frozen = getattr(graph, FROZEN_ATTR, None)
        if frozen:
            setattr(self, FROZEN_ATTR, dict(frozen))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        given = args, kwargs
        expected = self.__dict__.get("amp_fx_input_dtypes")
        if expected:
            _check_input_dtypes(expected, args, kwargs)
        specs = self.__dict__.get(SPECS_ATTR)
        unserved = None
        if specs is not None:  # the graph for this mode and these optional inputs (converter/specialisations.py)
            try:
                args, kwargs = specs.select(self, args, kwargs)
            except UntraceableCallError as error:  # no graph for this call's inputs: it is captured from the call
                if getattr(self.__dict__.get(RECIPE_ATTR), "model", None) is None:
                    raise
                unserved = str(error)
        unserved = unserved or _unserved_call(self, args, kwargs)
        if unserved is not None:  # a call the graph cannot take runs captured from the call (converter/call_capture.py)
            return captured_routes["call_route"](self, unserved)(*given[0], **given[1])
        hooks = self.__dict__.get(STATE_ATTR)
        if hooks is None or hooks.stale(self):  # a hook registered somewhere since the last call (core/live_hooks.py)
            hooks = check_hooks(self)
            if specs is not None and specs.graph is not self.__dict__.get("_graph"):  # rebuilt for a hook: pick again
                args, kwargs = specs.select(self, args, kwargs)
        sync_masters(self)  # O2: masters written in place since the last call (core/master_sync.py)
        swapped = swap_in_low_copies(self)  # O2/O3 under functional_call with fp32 tensors (core/functional_params.py)
        grad = torch.is_grad_enabled()
        try:
            # The graph already casts explicitly: an outer autocast would cast again.
            if hooks.active:  # hook boundaries in the graph, or hooks on the model itself
                return hooks.run(functools.partial(call_without_outer_autocast, super().__call__), *args, **kwargs)
            return call_without_outer_autocast(super().__call__, *args, **kwargs)
        except BaseException:
            torch._C._set_grad_enabled(grad)  # a no_grad region the error left open must not leak
            raise
        finally:
            if swapped:
                restore_swapped(swapped)

    # A converted Sequential/ModuleList is one graph: indexing would hand out a layer that no longer runs as
    # itself (activations are inlined, no modules). Refuse it, naming the ways that work; and no iteration
    # through __getitem__ either (``__iter__ = None``: iter(gm) stays a plain TypeError, bool(gm) stays True).
    __iter__ = None

    def __getitem__(self, key: Any) -> Any:
        name = type(self).__name__
        raise AmpTypeError(
            f"{PACKAGE}: a converted {name} is one graph, not a container of layers: its layers run inlined in the "
            f"graph (activations and other parameterless layers are no module in it), so gm[{key!r}] has no layer "
            f"that runs converted. Index the original model instead (model[{key!r}]; at O0/O1 it holds the same "
            f"parameters as the converted module), convert that layer on its own ({PACKAGE}.convert(model[{key!r}], "
            f"level)), or reach the converted module's parameters by name (gm.named_parameters(), "
            f"gm.get_submodule({str(key)!r})).")

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass  # not bound: a raised error held in a frame would keep that frame's locals (a process group) alive
        return model_attribute(self, name)  # an attribute only the original model has (converter/model_attributes.py)

    def train(self, mode: bool = True) -> "AmpGraphModule":
        """Set train/eval mode on this module and its own submodules.

        On the torch.export route the next call runs the graph specialised
        to the new mode, built at its first use
        (:mod:`amp_fx.converter.specialisations`).  Where the graph keeps a
        symbolic-route branch on ``self.training``, warn once.
        """
        result = super().train(mode)
        frozen = self.__dict__.get(FROZEN_ATTR)
        recipe = self.__dict__.get(RECIPE_ATTR)
        specs = self.__dict__.get(SPECS_ATTR)  # torch.export route: the graph for the new mode is built, no warning
        switches = specs is not None and specs.exported and recipe is not None and recipe.model is not None
        if frozen and not switches and not self.__dict__.get("_amp_fx_warned_frozen") and not amp_fx_is_switching():
            changed = [(path, value, where) for path, (value, where) in frozen.items() if self._flag_at(path) != value]
            if changed:
                self._amp_fx_warned_frozen = True
                path, value, where = changed[0]
                name = f"{path}.training" if path else "training"
                if where == "traced with torch.export":
                    what = (f"amp_fx: this module was traced with torch.export at {name}={value}; the graph keeps that "
                            "mode (dropout, batch norm, every branch on self.training), so .train()/.eval() change "
                            "nothing it computes.")
                else:
                    what = (f"amp_fx: this module was converted at {name}={value}, and its forward branches on "
                            f"self.training ({where}): the graph keeps that branch. .train()/.eval() still switch "
                            "Dropout/BatchNorm and runtime reads of the flag.")
                warnings.warn(
                    f"{what} Convert the model again in the mode you need, or use torch.compile(model, backend='amp_fx').",
                    FrozenTrainingWarning, stacklevel=2)
        return result

    def _flag_at(self, path: str) -> Optional[bool]:
        try:
            return self.get_submodule(path).training if path else self.training
        except AttributeError:
            return self.training

    def __deepcopy__(self, memo: dict) -> "AmpGraphModule":
        sync_masters(self)  # O2: the copy starts from low copies equal to their masters
        result = super().__deepcopy__(memo)
        for name in AMP_ATTRIBUTES:
            if name in self.__dict__:
                setattr(result, name, copy.deepcopy(self.__dict__[name], memo))
        if result.__dict__.get("amp_fx_masters"):  # deepcopy drops tensor attributes: mark the copies' low params again
            attach_masters(result, dict(result.amp_fx_masters))
        return result

    def __reduce__(self) -> tuple:
        if self.__dict__.get(ROUTE_ATTR) == "torch.export":
            raise AmpTypeError(
                "a module converted on the torch.export route cannot be pickled: torch.export's graph holds "
                "local functions. Save gm.state_dict() (it loads into the original model, or into a new "
                f"{PACKAGE}.convert() of it), or gm.save_pretrained(path) for a Hugging Face model.")
        reduce_fn, reduce_args = super().__reduce__()
        return (_rebuild, (reduce_fn, reduce_args, type(self).__name__))

    def clear_cast_cache(self) -> None:
        """Drop the weight casts ``cache_casts=True`` kept for this module's parameters.

        Call it after writing a weight through ``p.data`` (``p.data.mul_(0.5)``):
        such a write bumps no version counter, so the cache would serve the old
        cast (:mod:`amp_fx.graph_ops.cast_cache`).
        """
        from amp_fx.graph_ops.cast_cache import clear_cast_cache

        clear_cast_cache(self)
