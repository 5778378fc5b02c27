"""Train/eval flags on the symbolic route: ``self.training`` is read at run time, never frozen silently.

fx runs ``forward`` once, so ``F.dropout(x, p, training=self.training)``
would keep the flag the model had when it was converted.  While AmpTracer
traces, every module it traces *through* has its ``training`` attribute
replaced by a proxy of ``get_attr "<path>.training"``: the graph reads the
converted module's own flag (``gm.<path>.training``), which ``gm.train()`` /
``gm.eval()`` set.  Leaf modules (Dropout, BatchNorm) are called as modules
and read their own flag already.

Python control flow on the flag (``if self.training:``,
``p if self.training else 0.0``) cannot be kept in one graph: the branch is
taken with the flag the model had, and the specialisation is recorded
(module, source line, value).  The report lists it and the converted
module warns once when ``.train()`` / ``.eval()`` changes that flag.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.fx as fx
import torch.nn as nn
from torch.fx.proxy import Proxy

from amp_fx.frontend.source_lines import innermost_user_frame
from amp_fx.ir import meta

__all__ = ["TrainingReads", "FROZEN_ATTR"]

# graph / module attribute: {module path: (flag it was specialised to, where)}
FROZEN_ATTR = "amp_fx_frozen_training"


def _user_line() -> Optional[str]:
    """``file:line`` of the innermost frame outside torch and amp_fx (where the flag was branched on)."""
    frame = innermost_user_frame(skip_stdlib=False)
    return None if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


class _TrainingProxy(Proxy):
    """A proxy of a module's ``training`` flag; branching on it specialises the graph and says so."""

    def __init__(self, node: fx.Node, tracer: Any, path: str, value: bool, frozen: dict):
        super().__init__(node, tracer)
        self._amp_fx_path, self._amp_fx_value, self._amp_fx_frozen = path, value, frozen

    def __bool__(self) -> bool:
        self._amp_fx_frozen.setdefault(self._amp_fx_path, (self._amp_fx_value, _user_line() or "unknown source line"))
        return self._amp_fx_value


class TrainingReads:
    """Install, for one trace, a runtime read of ``training`` on every module the tracer traces through."""

    def __init__(self) -> None:
        self.saved: list[tuple[nn.Module, bool]] = []
        self.nodes: list[fx.Node] = []
        self.frozen: dict[str, tuple[bool, str]] = {}

    def install(self, tracer: Any, root: nn.Module) -> None:
        """Replace ``training`` on each traced-through module of ``root`` by a proxy read (see module docstring)."""
        leaves: list[str] = []
        for path, module in root.named_modules():
            if any(path.startswith(leaf + ".") for leaf in leaves):
                continue
            if path and tracer.is_leaf_module(module, path):
                leaves.append(path)
                continue
            flag = module.__dict__.get("training")
            if not isinstance(flag, bool):
                continue
            node = tracer.create_node("get_attr", f"{path}.training" if path else "training", (), {})
            meta.TRAINING_FLAG.set(node, path)
            node.meta.pop("stack_trace", None)  # made before forward runs: no user line to point at
            self.nodes.append(node)
            self.saved.append((module, flag))
            module.__dict__["training"] = _TrainingProxy(node, tracer, path, flag, self.frozen)

    def restore(self, graph: Optional[fx.Graph]) -> None:
        """Put the flags back, drop the reads nobody used, and note specialisations on ``graph``."""
        for module, flag in self.saved:
            module.__dict__["training"] = flag
        self.saved.clear()
        if graph is None:
            return
        for node in self.nodes:
            if node.graph is graph and not node.users:
                graph.erase_node(node)
        self.nodes.clear()
        if self.frozen:
            setattr(graph, FROZEN_ATTR, dict(self.frozen))
