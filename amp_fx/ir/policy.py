"""User overrides of the op tables: by module name, module type, or op.

Precedence, highest first (resolved once per node by :meth:`Policy.decide`),
as ``QConfigMapping`` resolves it:

1. module name: the most specific name wins.  The enclosing modules are tried
   innermost first; for each, an exact name rule, then the glob / regex rules
   that match it.  So ``{"module:dec": "low", "module:dec.head": "fp32"}``
   runs ``dec.head`` in fp32 and the rest of ``dec`` low.  A name rule covers
   every op inside its module.
2. module type (``nn.LayerNorm``), innermost enclosing module first.
3. op: a canonical name (``"softmax"``), any spelling ``python -m amp_fx tables --op`` resolves
   (``"torch.softmax"``, ``"F.softmax"``, ``"x.softmax_"``, ``"aten.softmax.int"``, a module type
   such as ``"nn.LayerNorm"`` for the op it runs), or the callable itself (``torch.softmax``).
   A ``torch.library`` custom op is ``"ns::name"`` (``"op:transformers::grouped_mm_fallback"``;
   ``"torch.ops.ns.name"`` and the op object work too).  Its name is checked against the ops torch
   has registered: a misspelling is an error with close matches.
4. the level's tables (not handled here).

Setting a key again overrides its decision (the later call wins); among
patterns that match the same module, the one set last wins.

Build one with the methods, or from a dict::

    Policy().set_module_name("decoder.head", "fp32").set_op("softmax", "low")
    Policy.from_dict({"module:decoder.head": "fp32", "op:softmax": "low",
                      "module:blocks.*.attn": "fp32", "module_re:blocks\\.[0-3]\\.": "fp32",
                      nn.LayerNorm: "low", torch.exp: "follow"})
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
import torch.nn as nn

from amp_fx.errors import AmpTypeError, AmpValueError
from amp_fx.ir import op_properties, tables
from amp_fx.ir.op_keys import TORCH_NAMESPACES, callable_op_name, is_custom_op, op_name_of

__all__ = ["Policy", "DECISIONS", "PolicyRule"]

# What a rule can say about a node.  "fp8": low precision, with the GEMMs inside run in fp8 (passes/fp8_gemms.py).
DECISIONS = ("low", "fp32", "follow", "promote", "fp8")


@dataclass(frozen=True)
class PolicyRule:
    """One override: what it matches, the decision, and how the report names it."""

    kind: str  # "module", "module_glob", "module_re", "type", "op"
    key: Any
    decision: str

    def describe(self) -> str:
        """Human-readable form for the report, e.g. ``policy module 'decoder.head' -> fp32``."""
        key = self.key
        if isinstance(key, type) or callable(key):  # an op object (torch.library's CustomOpDef) has no __name__
            key = getattr(key, "__name__", None) or callable_op_name(key)
        if isinstance(key, re.Pattern):
            key = key.pattern
        return f"policy {self.kind} {key!r} -> {self.decision}"


def _enclosing_names(stack: list[tuple[str, Any]]) -> list[str]:
    """Names of the modules around a node, most specific first.

    The stack holds the modules that were *called*; a container that is only
    indexed (``self.blocks[0]``, ``self.heads["a"]``) encloses them too, so
    every dotted prefix of a name counts, longest first.
    """
    names: dict[str, None] = {}
    for name, _ in stack:
        atoms = name.split(".") if name else []
        for end in range(len(atoms), 0, -1):
            names.setdefault(".".join(atoms[:end]), None)
    return list(names)


def _same_key(a: Any, b: Any) -> bool:
    if isinstance(a, re.Pattern) and isinstance(b, re.Pattern):
        return a.pattern == b.pattern
    return a is b if callable(a) and not isinstance(a, str) else a == b


def _op_key(spelling: str) -> str:
    """The canonical op name a policy's ``op:`` spelling means, as the CLI resolves it (``"nn.LayerNorm"`` -> ``"layer_norm"``).

    A spelling that resolves to no op amp_fx knows is kept as written: it may be
    a user module's or custom Function's own name (``"pkg.blocks.Attention"``).
    """
    resolved = op_name_of(spelling)
    if is_custom_op(resolved):
        _check_custom_op(resolved, when_loaded=True)
        return resolved
    last = getattr(nn, spelling.strip().split(".")[-1], None)
    names_module_type = isinstance(last, type) and issubclass(last, nn.Module)
    if resolved != spelling and (names_module_type or resolved in op_properties.known_ops()):
        return resolved
    return spelling


def _custom_ops_registered() -> set:
    """``"ns::name"`` of every custom (non-PyTorch) op the dispatcher knows now."""
    names = {n.split(".")[0] for n in torch._C._dispatch_get_all_op_names()}
    return {n for n in names if n.split("::")[0] not in TORCH_NAMESPACES}


def _check_custom_op(op: str, *, when_loaded: bool = False) -> None:
    """Raise for a custom op name that no table decides and torch has not registered, with close matches.

    ``when_loaded``: check only if the op's namespace has registered some op already (a policy may be
    built before the library that registers its ops is imported; ``convert()`` checks again).
    """
    registered = _custom_ops_registered()
    if op in registered or tables.table_of(op) != "unknown":  # torch knows it, or a table (shipped or register_op's)
        return
    namespace = op.split("::")[0]
    if when_loaded and not any(name.startswith(namespace + "::") for name in registered):
        return
    close = difflib.get_close_matches(op, sorted(registered | tables.CUSTOM_OPS), n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise AmpValueError(
        f"policy names custom op {op!r}, which torch has not registered and no amp_fx table decides.{hint} "
        "A custom op is named 'namespace::name', as torch.library.custom_op defines it; import the module "
        "that registers it before converting."
    )


def _check_decision(decision: str) -> str:
    if decision not in DECISIONS:
        raise AmpValueError(f"unknown policy decision {decision!r}; use one of {DECISIONS}")
    return decision


@dataclass
class Policy:
    """An ordered set of precision overrides (see module docstring for precedence)."""

    rules: list[PolicyRule] = field(default_factory=list)

    # -- building ---------------------------------------------------------
    def _set(self, rule: PolicyRule) -> "Policy":
        """Add ``rule``; a rule for the same key is replaced (setting a key again overrides it)."""
        same = lambda other: other.kind == rule.kind and _same_key(other.key, rule.key)  # noqa: E731
        self.rules = [other for other in self.rules if not same(other)] + [rule]
        return self

    def set_module_name(self, name: str, decision: str) -> "Policy":
        """Pin every op inside the module ``name``; ``*``/``?``/``[`` make it a glob."""
        kind = "module_glob" if any(ch in name for ch in "*?[") else "module"
        return self._set(PolicyRule(kind, name, _check_decision(decision)))

    def set_module_name_regex(self, pattern: str, decision: str) -> "Policy":
        """Pin every op inside modules whose full name matches the regex ``pattern``."""
        try:
            compiled = re.compile(pattern)
        except re.error as error:
            raise AmpValueError(f"policy key 'module_re:{pattern}' is not a valid regular expression ({error}); "
                             "escape dots as \\. and check the brackets") from error
        return self._set(PolicyRule("module_re", compiled, _check_decision(decision)))

    def set_module_type(self, module_type: type, decision: str) -> "Policy":
        """Pin every op inside modules of ``module_type`` (subclasses included)."""
        if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
            raise AmpTypeError(f"set_module_type expects an nn.Module subclass, got {module_type!r}")
        return self._set(PolicyRule("type", module_type, _check_decision(decision)))

    def set_op(self, op: Union[str, Callable], decision: str) -> "Policy":
        """Decide an op by name (any spelling the CLI resolves, see the module docstring) or by the callable itself."""
        if not (isinstance(op, str) or callable(op)):
            raise AmpTypeError(f"set_op expects a canonical op name or a callable, got {op!r}")
        return self._set(PolicyRule("op", _op_key(op) if isinstance(op, str) else op, _check_decision(decision)))

    @classmethod
    def from_dict(cls, mapping: Mapping[Any, str]) -> "Policy":
        """Build from ``{"module:NAME" | "module_re:REGEX" | "op:NAME" | Module type | callable: decision}``."""
        policy = cls()
        for key, decision in mapping.items():
            if isinstance(key, type) and issubclass(key, nn.Module):
                policy.set_module_type(key, decision)
            elif callable(key) and not isinstance(key, str):
                policy.set_op(key, decision)
            elif isinstance(key, str) and ":" in key:
                prefix, _, rest = key.partition(":")
                if prefix == "module":
                    policy.set_module_name(rest, decision)
                elif prefix == "module_re":
                    policy.set_module_name_regex(rest, decision)
                elif prefix == "op":
                    policy.set_op(rest, decision)
                else:
                    raise AmpValueError(
                        f"unknown policy key {key!r}: prefix {prefix!r} is not one of "
                        "'module:', 'module_re:', 'op:' (or pass an nn.Module type or a callable as the key)"
                    )
            else:
                raise AmpValueError(
                    f"unknown policy key {key!r}: write 'module:NAME', 'module_re:REGEX' or 'op:NAME', "
                    "or pass an nn.Module type or a callable as the key"
                )
        return policy

    @classmethod
    def coerce(cls, policy: Union[None, "Policy", Mapping]) -> "Policy":
        """Accept None, a Policy, or a dict for it."""
        if policy is None:
            return cls()
        if isinstance(policy, Policy):
            return policy
        if isinstance(policy, Mapping):
            return cls.from_dict(policy)
        raise AmpTypeError(f"policy must be an amp_fx.Policy or a dict, got {type(policy).__name__}")

    # -- checking ---------------------------------------------------------
    def check_level(self, level: str) -> None:
        """Raise if a rule asks for low precision at a level that decides nothing (O0 leaves every op fp32).

        A ``"fp32"``, ``"follow"`` or ``"promote"`` rule already holds at O0; a ``"low"`` or ``"fp8"`` one would be
        silently ignored there.
        """
        if level != "O0":
            return
        lowering = [rule.describe() for rule in self.rules if rule.decision in ("low", "fp8")]
        if lowering:
            raise AmpValueError(f"level O0 leaves the model fp32 and unchanged, so these policy rules would do nothing: "
                                f"{'; '.join(lowering)}. Use level 'O1' (or 'O2' / 'O3') with the policy, or drop them")

    def validate_against(self, module_names: Sequence[str]) -> None:
        """Raise if an exact or glob module rule names no module of the model (with close matches)."""
        names = [n for n in module_names if n]
        for rule in self.rules:
            if rule.kind == "module" and rule.key not in names:
                close = difflib.get_close_matches(rule.key, names, n=3, cutoff=0.5)
                hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
                raise AmpValueError(
                    f"policy names module {rule.key!r}, which the model does not have.{hint} "
                    "Module names are those of model.named_modules()."
                )
            if rule.kind == "module_glob" and not any(fnmatch.fnmatchcase(n, rule.key) for n in names):
                raise AmpValueError(f"policy pattern {rule.key!r} matches no module of the model")
            if rule.kind == "module_re" and not any(rule.key.search(n) for n in names):
                raise AmpValueError(f"policy regex {rule.key.pattern!r} matches no module of the model "
                                 f"(module names are those of model.named_modules(), e.g. {names[:3]})")

    # -- deciding ---------------------------------------------------------
    def decide(self, op: Optional[str], target: Any, module_stack: Iterable[tuple[str, type]]) -> Optional[PolicyRule]:
        """Return the rule that decides a node, or None when the tables decide.

        ``module_stack`` lists (qualified name, type) of the enclosing modules,
        innermost first.
        """
        if not self.rules:
            return None
        stack = list(module_stack)
        latest_first = self.rules[::-1]
        for name in _enclosing_names(stack):  # the most specific name first
            for rule in latest_first:
                if rule.kind == "module" and rule.key == name:
                    return rule
            for rule in latest_first:
                if (rule.kind == "module_glob" and fnmatch.fnmatchcase(name, rule.key)) or \
                        (rule.kind == "module_re" and rule.key.search(name)):
                    return rule
        for _, module_type in stack:
            for rule in latest_first:
                if rule.kind == "type" and isinstance(module_type, type) and issubclass(module_type, rule.key):
                    return rule
        for rule in latest_first:
            if rule.kind == "op" and (rule.key == op if isinstance(rule.key, str) else
                                      rule.key is target or (op is not None and callable_op_name(rule.key) == op)):
                return rule
        return None

    def check_op_names(self, graph_ops: Iterable[str], known: Iterable[str]) -> None:
        """Raise for an ``op:`` name that is neither in this graph nor a known op (a misspelling), with close matches."""
        present = {op for op in graph_ops if op}
        candidates = sorted(present | set(known))
        for rule in self.rules:
            if rule.kind != "op" or not isinstance(rule.key, str) or rule.key in present or rule.key in candidates:
                continue
            if is_custom_op(rule.key):
                _check_custom_op(rule.key)
                continue
            close = difflib.get_close_matches(rule.key, candidates, n=3, cutoff=0.6)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise AmpValueError(
                f"policy names op {rule.key!r}, which is in no amp_fx table and not in this model's graph.{hint} "
                "Op names are canonical ATen names (see `python -m amp_fx tables`), or a custom "
                "autograd Function's class name."
            )
