"""The pass contract and the small runner that applies a pipeline of passes.

Every pass is ``fn(gm, ctx) -> PassResult``.  Analyses only write
``node.meta["amp_fx.<key>"]`` and return ``modified=False``; rewrites edit
the ``gm`` they are given.  The runner lints after each pass (and recompiles once at the end),
logs ``after <pass>`` at DEBUG on ``amp_fx.passes.<pass>``, optionally dumps
the code before/after each pass to ``$AMP_FX_DEBUG_DIR``, and names the
failing pass in any error.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from amp_fx.ir.config import AmpConfig
from amp_fx.ir.devices import device_type_of
from amp_fx.errors import AmpError
from amp_fx.ir.policy import Policy

__all__ = ["PassContext", "PassResult", "PassError", "run_passes", "AmpPass"]

logger = logging.getLogger("amp_fx")


@dataclass
class PassContext:
    """What every pass may read: the config, the policy, example inputs, the device, and per-pass stats."""

    config: AmpConfig
    policy: Policy = field(default_factory=Policy)
    example_inputs: Optional[tuple] = None
    example_kwarg_inputs: Optional[dict] = None
    route: str = "symbolic_trace"
    # The device type of the graph's floating tensors ("cpu", "cuda", ...), decided once by
    # amp_fx.ir.devices.device_type_of: convert() and the backend fill it; passes read it through device_for().
    device_type: Optional[str] = None
    # The module parameters of a Dynamo graph arrive as placeholders; the
    # backend fills this with placeholder name -> parameter FQN (the weight's name in reports).
    placeholder_params: dict[str, str] = field(default_factory=dict)
    # State-dict key -> dtype before cast_params lowered it; convert() hands it to the module's state_dict hook.
    source_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Fake-kernel results of the dtype analysis, keyed by node and input dtypes:
    # analysing another paint re-runs only the nodes whose inputs changed.
    analysis_cache: dict = field(default_factory=dict)
    # The one FakeTensorMode of this conversion's analyses (cached fake values must not mix modes).
    fake_mode: Any = None
    # The dtype analysis stored on the nodes last (amp_fx.ir.analysis.Analysis).
    analysis: Any = None

    def device_for(self, gm: Optional[fx.GraphModule]) -> str:
        """``device_type``; when no caller decided it (a pass run on its own), decided now from ``gm``, once."""
        if self.device_type is None:
            examples = list(self.example_inputs or ()) + list((self.example_kwarg_inputs or {}).values())
            self.device_type = device_type_of(gm, examples)
        return self.device_type

    @property
    def low(self) -> torch.dtype:
        """The low-precision dtype of this conversion."""
        return self.config.low_dtype


@dataclass
class PassResult:
    """What a pass returns: the (possibly same) module, whether it changed, and its stats."""

    graph_module: fx.GraphModule
    modified: bool
    stats: dict[str, Any] = field(default_factory=dict)


AmpPass = Callable[[fx.GraphModule, PassContext], PassResult]


class PassError(AmpError, RuntimeError):
    """A pass failed; the message names the pass."""


def _dump(gm: fx.GraphModule, pass_name: str, stage: str, index: int) -> None:
    directory = os.environ.get("AMP_FX_DEBUG_DIR")
    if not directory:
        return
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{index:02d}_{pass_name}_{stage}.py")
    with open(path, "w") as handle:
        handle.write(gm.code)


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes: Sequence[AmpPass]) -> fx.GraphModule:
    """Apply ``passes`` in order, linting and recompiling after each; return the final module."""
    ctx.device_for(gm)  # decided before the first pass rewrites the graph it is read from
    for index, pass_fn in enumerate(passes):
        name = getattr(pass_fn, "__name__", repr(pass_fn))
        _dump(gm, name, "before", index)
        start = time.perf_counter()
        try:
            result = pass_fn(gm, ctx)
            gm = result.graph_module
            if result.modified:
                gm.graph.lint()
                # Regenerating Python code is the costly part of a pass on a
                # large graph: only when someone reads it before the end.
                if os.environ.get("AMP_FX_DEBUG_DIR"):
                    gm.recompile()
        except AmpError:  # PassError included: already names its pass
            raise
        except Exception as error:
            raise PassError(f"amp_fx pass {name!r} failed: {type(error).__name__}: {error}") from error
        stats = dict(result.stats, modified=result.modified, seconds=round(time.perf_counter() - start, 6))
        ctx.stats[name] = stats
        logging.getLogger(f"amp_fx.passes.{name}").debug("after %s: %s", name, stats)
        _dump(gm, name, "after", index)
    gm.recompile()
    return gm
