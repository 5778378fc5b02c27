"""Read what a Dynamo graph says about itself: which placeholders are weights, and which modules they belong to.

With ``inline_inbuilt_nn_modules`` (always on in recent torch) Dynamo lifts
every parameter and buffer a graph reads to a placeholder.  Its
``node.meta["grapharg"]`` holds the real tensor and the Dynamo *source* the
value was read from, e.g. ``L['self']._modules['fc1']._parameters['weight']``;
from that source this module derives the readable FQN ``fc1.weight`` that the
report, weight-cast dedup and module policies use.

Module paths come the same way for every calling style.  Dynamo names a
module by the expression it was read from: ``L['self'].head`` when
``forward(self, x)`` is compiled, ``L['m'].head`` for ``def step(m, x)``,
``G['model'].head`` for a global, ``L['s'].head`` for ``forward(s, x)``,
``L['self'].model.head`` for a trainer object holding the model.
:func:`relative_module_stacks` rewrites each node's ``nn_module_stack`` to
paths relative to the root *module* (``head``), the names
``model.named_modules()`` gives and policies use.

After a graph break inside a submodule, Dynamo compiles that submodule's
frames on their own, and their roots are the submodule (``L['self']`` is
``encoder.layers.0``).  :mod:`amp_fx.dynamo.frames` finds each root's path
in the compiled model; passed as ``prefixes``, both functions here write
full paths and weight names (``encoder.layers.0.fc1.weight``).
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional, Sequence

import torch.fx as fx
import torch.nn as nn

__all__ = ["placeholder_params", "source_fqn", "target_fqn", "module_roots", "module_expressions",
           "relative_module_stacks", "STEP", "ROOT_VARIABLE"]

# One step of a Dynamo source name: .attr, ['key'] or [index].
_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[\s*'([^']*)'\s*\]|\[\s*\"([^\"]*)\"\s*\]|\[\s*(-?\d+)\s*\]")
# Containers that nn.Module uses internally; they are not part of the FQN.
_CONTAINERS = frozenset({"_modules", "_parameters", "_buffers"})
_WEIGHT_CONTAINERS = ("_parameters", "_buffers")
# The bare variable a Dynamo source starts from: L['m'], G['model'], or a name.
_ROOT_VARIABLE = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*\[\s*'[^']*'\s*\]|[A-Za-z_][A-Za-z0-9_]*)")
# Where a source steps into an nn.Module's own containers: what comes before is a module.
_INTO_MODULE = re.compile(r"\._(?:modules|parameters|buffers)\[")
STEP, ROOT_VARIABLE = _STEP, _ROOT_VARIABLE  # for amp_fx.dynamo.frames, which reads the same sources


def _source_name(source: Any) -> Optional[str]:
    name = getattr(source, "name", None)
    if callable(name):
        name = name()
    return name if isinstance(name, str) else None


def source_fqn(name: str) -> Optional[str]:
    """``L['self']._modules['fc1']._parameters['weight']`` -> ``fc1.weight``; None when no weight is named.

    The root module (``L['self']``, ``G['model']``, ``L['self'].model`` of a
    trainer object) is dropped; so are the module's internal containers
    (``_modules``, ``_parameters``, ``_buffers``).
    """
    if not any(f"{c}[" in name or f".{c}." in name for c in _WEIGHT_CONTAINERS) and not name.endswith((".weight", ".bias")):
        return None
    # The root is the module the source steps into first (L['self'], L['m'], L['self'].model).
    into = _INTO_MODULE.search(name)
    root = _ROOT_VARIABLE.match(name)
    rest = name[into.start():] if into else (name[root.end():] if root else name)
    atoms = []
    for match in _STEP.finditer(rest):
        atom = next(group for group in match.groups() if group is not None)
        if atom not in _CONTAINERS:
            atoms.append(atom)
    return ".".join(atoms) or None


def target_fqn(target: str) -> Optional[str]:
    """Fallback from a placeholder name: ``L_self_modules_fc1_parameters_weight_`` -> ``fc1.weight``."""
    text = target.strip("_")
    for prefix in ("L_self_", "L_", "G_"):
        if text.startswith(prefix):
            text = text[len(prefix):]
            break
    marker = re.search(r"(?:^|_)(parameters|buffers)_", text)
    if marker is None:
        return None
    parts = re.split(r"(?:^|_)(?:modules|parameters|buffers)_", text)
    return ".".join(part for part in parts if part) or None


def _join(prefix: str, path: str) -> str:
    if not prefix:
        return path
    return prefix + path if path.startswith("[") else f"{prefix}.{path}" if path else prefix


def _source_root(name: str) -> Optional[str]:
    """The module expression a weight's source starts from (``L['self'].model`` of ``L['self'].model._modules[...]``)."""
    into = _INTO_MODULE.search(name)
    if into is not None:
        return name[:into.start()]
    root = _ROOT_VARIABLE.match(name)
    return root.group(0) if root else None


def placeholder_params(gm: fx.GraphModule, example_inputs: Sequence[Any] = (),
                       prefixes: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """Map each placeholder that holds a parameter or buffer to its FQN.

    A placeholder is a weight when its real value is an ``nn.Parameter`` or
    its Dynamo source reads a module's ``_parameters`` / ``_buffers``.
    ``prefixes`` (root expression -> module path, :mod:`amp_fx.dynamo.frames`)
    makes the names full ones in a frame compiled after a graph break.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out: dict[str, str] = {}
    for index, node in enumerate(placeholders):
        grapharg = node.meta.get("grapharg")
        example = getattr(grapharg, "example", None) if grapharg is not None else None
        if example is None and index < len(example_inputs):
            example = example_inputs[index]
        name = _source_name(getattr(grapharg, "source", None)) if grapharg is not None else None
        fqn = source_fqn(name) if name else None
        if fqn is None and (isinstance(example, nn.Parameter) or isinstance(node.meta.get("example_value"), nn.Parameter)):
            fqn = target_fqn(str(node.target)) or (name or str(node.target))
        if fqn is not None and name and prefixes:
            fqn = _join(prefixes.get(_source_root(name) or "", ""), fqn)
        if fqn is not None:
            out[node.name] = fqn
    return out


def module_roots(gm: fx.GraphModule) -> list[str]:
    """The expressions that name the root modules this graph reads weights from, longest first.

    ``L['self'].model._modules['head']._parameters['weight']`` names the
    root ``L['self'].model``: the object whose ``_modules`` Dynamo reads is
    an ``nn.Module``, the attribute path before it is how the compiled
    function reached that module.
    """
    roots = set()
    for node in gm.graph.nodes:
        if node.op != "placeholder" or node.meta.get("grapharg") is None:
            continue
        name = _source_name(getattr(node.meta["grapharg"], "source", None))
        step = _INTO_MODULE.search(name) if name else None
        if step is not None:
            roots.add(name[:step.start()])
    return sorted(roots, key=len, reverse=True)


def module_expressions(gm: fx.GraphModule) -> list[str]:
    """Every module expression the graph's paths start from: :func:`module_roots` and the bare root variables."""
    found = list(module_roots(gm))
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            for value in (node.meta.get("nn_module_stack") or {}).values():
                variable = _ROOT_VARIABLE.match(value[0]) if isinstance(value, tuple) and value and isinstance(value[0], str) else None
                if variable is not None and variable.group(0) not in found:
                    found.append(variable.group(0))
    return found


def _relative(path: str, roots: Sequence[str], prefixes: Mapping[str, str]) -> str:
    for root in roots:
        if path == root or path.startswith(root + ".") or path.startswith(root + "["):
            return _join(prefixes.get(root, ""), path[len(root):].lstrip("."))
    # A module that reads no weight of its own still hangs off a root variable.
    variable = _ROOT_VARIABLE.match(path)
    if variable is None:
        return path
    return _join(prefixes.get(variable.group(0), ""), path[variable.end():].lstrip("."))


def relative_module_stacks(gm: fx.GraphModule, roots: Optional[Sequence[str]] = None,
                           prefixes: Optional[Mapping[str, str]] = None,
                           frame_module: Optional[tuple[str, type]] = None) -> int:
    """Rewrite every node's ``nn_module_stack`` paths relative to its root module; return how many changed.

    Paths become ``"head"`` / ``"encoder.layers.0"`` (``""`` for the root
    itself), whatever the compiled function called its module argument.
    Bodies of higher-order ops (checkpointed regions) get the same roots.
    ``prefixes`` (root expression -> module path) and ``frame_module`` (the
    module whose forward a frame compiled after a graph break runs, which
    encloses every node of it) come from :mod:`amp_fx.dynamo.frames`.
    """
    roots = module_roots(gm) if roots is None else roots
    prefixes = prefixes or {}
    changed = 0
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            stack = node.meta.get("nn_module_stack")
            if not stack and frame_module is None:
                continue
            rewritten = {}
            if frame_module is not None and node.op not in ("placeholder", "output"):
                rewritten[frame_module[0]] = frame_module  # outermost first, as Dynamo orders the stack
                changed += 1
            for key, value in (stack or {}).items():
                if isinstance(value, tuple) and value and isinstance(value[0], str):
                    path = _relative(value[0], roots, prefixes)
                    changed += path != value[0]
                    value = (path,) + tuple(value[1:])
                if frame_module is not None and isinstance(value, tuple) and value[:1] == (frame_module[0],):
                    continue  # the frame's module itself, already first
                rewritten[key] = value
            if rewritten:
                node.meta["nn_module_stack"] = rewritten
    return changed
