"""A graph built for another key, made to run on the converted module's own state.

:mod:`amp_fx.converter.specialisations` builds a converted module's other
graphs (another train/eval mode, other keyword inputs) by converting the model
again; this module holds what makes such a graph one of the module's own: it
reads the module's parameters, buffers and modules (one set of weights for all
graphs), its constants move over under names of their own, the flag-only copy
of the model it is traced from, the call's inputs as example inputs, and the
stand-in modules torch.export leaves out.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from amp_fx.errors import AmpRuntimeError
from amp_fx.converter.live_hooks import lookup_target, own_attribute
from amp_fx.graph_ops.fp8_ops import Fp8GemmState

__all__ = ["adopt_graph", "add_stand_ins", "example_copies", "flag_copy", "module_at", "persistent_buffers"]


def adopt_graph(gm: fx.GraphModule, new: fx.GraphModule, own: frozenset, modules: frozenset, renamed: int) -> int:
    """Point ``new``'s graph at ``gm``'s own parameters, buffers and modules; move its constants over.

    ``own`` names the state every graph shares (the model's parameters and buffers, persistent
    buffers), ``modules`` the model's module paths; a constant of ``new`` whose name another graph
    already uses gets a name of its own, counted on from ``renamed``.  Returns the new count.
    """
    for node in list(new.graph.nodes):
        if node.op not in ("get_attr", "call_module"):
            continue
        target = str(node.target)
        mine, theirs = lookup_target(gm, target), lookup_target(new, target)
        if target in own or (node.op == "call_module" and target in modules):
            if mine is None:
                _assign(gm, target, theirs)
            elif isinstance(theirs, torch.Tensor) and (not isinstance(mine, torch.Tensor) or mine.shape != theirs.shape
                                                       or mine.dtype != theirs.dtype):
                raise AmpRuntimeError(
                    f"amp_fx: the graph built for another mode reads {target!r} as {tuple(theirs.shape)} "
                    f"{theirs.dtype}, but this module holds {getattr(mine, 'shape', None)} "
                    f"{getattr(mine, 'dtype', type(mine).__name__)} there: the model changed since conversion. "
                    "Convert the model again.")
            continue
        if isinstance(mine, Fp8GemmState) and isinstance(theirs, Fp8GemmState):
            continue  # an fp8 GEMM's scales and amax history are the conversion's: one per GEMM, every graph's
        if mine is theirs or (mine is not None and not isinstance(mine, (torch.Tensor, nn.Module))):
            continue  # the same object, or a plain attribute (a flag)
        if mine is not None:  # a constant of the same name in another graph: this one gets its own name
            renamed += 1
            target = f"_amp_fx_mode{renamed}_{target.replace('.', '_')}"
            node.target = target
        _assign(gm, target, theirs)
    return renamed


def persistent_buffers(module: nn.Module) -> frozenset:
    """Names of ``module``'s persistent buffers (state a pass added, such as fp8 scales, is shared by every graph)."""
    return frozenset(f"{path}.{name}" if path else name for path, m in module.named_modules()
                     for name in m._buffers if name not in m._non_persistent_buffers_set)


def module_at(gm: nn.Module, path: str) -> Optional[nn.Module]:
    """``gm``'s module at ``path``, or None where it has none (torch.export keeps only modules holding state)."""
    module: Optional[nn.Module] = gm
    for atom in path.split(".") if path else ():
        module = module._modules.get(atom) if module is not None else None
    return module


def flag_copy(module: nn.Module, memo: dict[int, nn.Module]) -> nn.Module:
    """A copy of ``module``'s tree with its own flags and containers, the same parameter and buffer tensors."""
    if id(module) in memo:
        return memo[id(module)]
    clone = copy.copy(module)
    memo[id(module)] = clone
    for key, value in module.__dict__.items():
        if isinstance(value, (dict, list, set)):  # _parameters, _buffers, hook dicts: new containers, same tensors
            clone.__dict__[key] = copy.copy(value)
    clone.__dict__["_modules"] = type(module._modules)(
        (name, None if child is None else flag_copy(child, memo)) for name, child in module._modules.items())
    return clone


def example_copies(values: Any) -> Any:
    """A call's inputs as example inputs for a build: detached; inference tensors cloned (fake tensors refuse them)."""
    def detach(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone() if t.is_inference() else t.detach()

    return pytree.tree_map_only(torch.Tensor, detach, values)


def _assign(owner: nn.Module, target: str, value: Any) -> None:
    *prefix, leaf = target.split(".")
    for atom in prefix:
        child = own_attribute(owner, atom)
        if child is None:
            child = nn.Module()
            owner.add_module(atom, child)
        owner = child
    if isinstance(value, nn.Module):
        owner._modules[leaf] = value
    elif isinstance(value, nn.Parameter):
        owner.register_parameter(leaf, value)
    elif isinstance(value, torch.Tensor):
        owner.register_buffer(leaf, value, persistent=False)  # a constant of one graph: not the model's state
    else:
        setattr(owner, leaf, value)


def add_stand_ins(gm: nn.Module, model: nn.Module) -> None:
    """Give ``gm`` a module at every path of ``model`` that torch.export left out (those holding no state).

    torch.export keeps only the modules that hold parameters or buffers, so
    ``gm.apply(lambda m: m.eval() if isinstance(m, nn.Dropout) else None)``
    would find no Dropout and change nothing, silently.  Each stand-in is a
    copy of the model's module (its type, attributes and flag) with empty
    containers: it holds no state and no hooks of the model's, and the
    graph never calls it; its flag is part of the key.
    """
    for path, module in model.named_modules():
        if not path or module_at(gm, path) is not None:
            continue
        parent_path, _, name = path.rpartition(".")
        parent = module_at(gm, parent_path)
        if parent is None:
            continue
        stand_in = copy.copy(module)
        for key, value in module.__dict__.items():
            if isinstance(value, (dict, set)):  # parameters, buffers, submodules, hook dicts: its own, empty
                stand_in.__dict__[key] = type(value)()
        parent._modules[name] = stand_in
        order = list(model.get_submodule(parent_path)._modules) if parent_path else list(model._modules)
        children = parent._modules  # the model's order, then whatever else the trace added (its guards)
        ordered = sorted(children.items(), key=lambda item: order.index(item[0]) if item[0] in order else len(order))
        children.clear()
        children.update(ordered)
