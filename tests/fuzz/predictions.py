"""The one prediction checker: the dtype analysis told the truth, node by node, on the module that ran.

:class:`Recorder` runs a converted graph node by node and keeps what each
node read and produced; :func:`check_predictions` compares every dtype and
shape the analysis predicted with it.  The fuzz suite (``invariants.py``,
``test_fuzz_convert.py``) and the dtype analysis's own tests
(tests/passes/test_analyse_dtypes.py) call it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from amp_fx.graph_ops.casts import amp_cast
from amp_fx.ir import meta

__all__ = ["Recorder", "check_predictions"]


class Recorder(fx.Interpreter):
    """Runs a graph node by node, keeping each node's float input dtypes and result dtype."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.inputs: dict[str, list[torch.dtype]] = {}
        self.result: dict[str, Optional[torch.dtype]] = {}
        self.shapes: dict[str, tuple] = {}
        self.sources: dict[str, Optional[torch.dtype]] = {}

    def run_node(self, node: fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        self.inputs[node.name] = [t.dtype for t in tree_leaves((args, kwargs))
                                  if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() > 0]
        first = args[0] if args else None
        self.sources[node.name] = first.dtype if isinstance(first, torch.Tensor) else None
        result = super().run_node(node)
        self.result[node.name] = result.dtype if isinstance(result, torch.Tensor) else None
        if isinstance(result, torch.Tensor):
            self.shapes[node.name] = tuple(result.shape)
        return result


def check_predictions(gm: fx.GraphModule, recorder: Recorder, exact: bool) -> int:
    """The dtype analysis told the truth: each node's predicted dtype and shape are what the module produced.

    ``recorder`` has run ``gm``.  ``exact``: every floating value's dtype must
    be predicted (example inputs were given); otherwise the analysis may say
    "unknown", never something wrong -- with one documented assumption: a
    floating input of unknown dtype is taken not to be float64 (a guarded cast
    leaves float64 as it is, so a float64 value downstream of one runs
    correctly in float64, as under autocast); so a float64 value from a guarded
    cast, or downstream of one, may have been predicted otherwise.
    Returns how many values were checked.
    """
    guarded: set[fx.Node] = set()  # guarded casts (amp_cast) and every node downstream of one
    for node in gm.graph.nodes:
        if (node.op == "call_function" and node.target is amp_cast) or any(a in guarded for a in node.all_input_nodes):
            guarded.add(node)
    checked = 0
    for node in gm.graph.nodes:
        dtype = recorder.result.get(node.name)
        if dtype is None or node.op == "output":
            continue
        assert meta.is_tensor(node) is not False, f"{node.name} was predicted not to be a tensor"
        if dtype.is_floating_point:
            predicted = meta.float_dtype(node)
            assert meta.is_float(node) is not False, f"{node.name} was predicted not floating"
            guarded_float64 = not exact and dtype == torch.float64 and node in guarded
            assert predicted == dtype or (not exact and predicted is None) or guarded_float64, \
                f"{node.name}: predicted {predicted}, ran {dtype}"
        else:
            assert meta.is_float(node) is not True, f"{node.name} ({dtype}) was predicted floating"
        shape = meta.shape(node)
        assert shape is None or tuple(shape) == recorder.shapes[node.name], f"{node.name}: shape {shape}, ran {recorder.shapes[node.name]}"
        checked += 1
    return checked
