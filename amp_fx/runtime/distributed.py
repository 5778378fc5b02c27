"""Sharded training (FSDP2): convert a model block by block so that ``fully_shard`` can shard it.

``torch.distributed.fsdp.fully_shard(block)`` gathers a block's parameters in
a hook on ``block.forward``. :func:`amp_fx.convert` inlines every submodule's
ops into one graph, so no block's ``forward`` would ever run there and FSDP2
could not gather its parameters. :func:`convert_for_sharding` converts each
block on its own and the rest of the model around them, so that the converted
model calls each converted block as a module; ``fully_shard`` then works on
those blocks as on the original ones, and each block casts its (gathered,
unsharded) weights once per forward.

What the training step does with the shards (this rank's shard, DTensor
masters, inf/NaN verdicts summed over the ranks) is :mod:`amp_fx.runtime.dtensors`.
"""

from __future__ import annotations

from typing import Any, Sequence, Union

import torch
from torch import fx, nn

from amp_fx.converter.graph_module import attach_masters
from amp_fx.errors import AmpRuntimeError, AmpTypeError, AmpValueError

from . import process_group_release  # noqa: F401  (before any init_process_group: see that module)
# The step's DTensor helpers, importable from here as before (tests/distributed/fsdp_worker.py).
from .dtensors import is_dtensor, local_tensor, reduce_found_inf, reduce_over_ranks, refuse_replaced_params, shard_like

__all__ = [
    "convert_for_sharding", "init_optimizer_state", "is_dtensor", "local_tensor", "reduce_found_inf",
    "reduce_over_ranks", "refuse_replaced_params", "shard_like",
]


# ------------------------------------------------------------- conversion
def _block_names(model: nn.Module, blocks: Union[type, Sequence[Union[type, str]]]) -> list[str]:
    specs = list(blocks) if isinstance(blocks, (list, tuple)) else [blocks]
    names = [n for n, _ in model.named_modules()]
    for spec in specs:
        if isinstance(spec, str) and spec not in names:
            raise AmpValueError(f"convert_for_sharding: blocks names {spec!r}, which the model does not have")
    chosen: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(c + ".") for c in chosen):
            continue  # the root is not a block; blocks inside blocks are part of their outer block
        if any(spec == name if isinstance(spec, str) else isinstance(module, spec) for spec in specs):
            chosen.append(name)
    if not chosen:
        raise AmpValueError(
            f"convert_for_sharding: no submodule matches blocks={blocks!r}; pass the block class "
            "(e.g. GPT2Block) or the blocks' names (e.g. ['layers.0', 'layers.1'])"
        )
    return chosen


def _block_examples(model: nn.Module, names: list[str], args: Any, kwargs: Any) -> dict[str, tuple]:
    """Run ``model`` once (fp32, no grad) and record the (args, kwargs) each block was called with."""
    seen: dict[str, tuple] = {}
    handles = []
    for name in names:
        def hook(module: nn.Module, a: tuple, k: dict, name: str = name) -> None:
            seen.setdefault(name, (a, k))
        handles.append(model.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(*(args or ()), **(kwargs or {}))
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _drop_specialised_kwargs(block: nn.Module, recorded: dict) -> None:
    """Let the model call an exported block with the keyword arguments it was recorded with.

    torch.export leaves out of the graph's signature the arguments that were
    None or Python constants when recorded (the graph is specialised on them);
    the model still passes them. Such an argument is dropped only when it has
    its recorded value; any other value is refused.
    """
    import functools
    import inspect

    forward = block.forward
    accepted = set(inspect.signature(forward).parameters)

    def same(key: str, value: Any) -> bool:
        if key not in recorded or isinstance(value, torch.Tensor):
            return False
        try:
            return value is recorded[key] or bool(value == recorded[key])
        except Exception:  # noqa: BLE001 - an incomparable value is not the recorded one
            return False

    @functools.wraps(forward)
    def call(*args: Any, **kwargs: Any) -> Any:
        changed = [k for k in kwargs if k not in accepted and not same(k, kwargs[k])]
        if changed:
            raise AmpTypeError(
                f"{type(block).__name__} was converted (torch.export) with {changed} at other values "
                "and specialised on them; convert again with example inputs like these"
            )
        return forward(*args, **{k: v for k, v in kwargs.items() if k in accepted})

    block.forward = call


def _shell(model: nn.Module, names: list[str]) -> nn.Module:
    """A copy of ``model`` sharing every submodule except those on the paths down to the blocks."""
    import copy

    def fresh(module: nn.Module) -> nn.Module:
        new = copy.copy(module)
        new._modules = dict(module._modules)
        new._parameters = dict(module._parameters)
        new._buffers = dict(module._buffers)
        return new

    root = fresh(model)
    for name in names:
        owner = root
        for part in name.split(".")[:-1]:
            child = fresh(owner._modules[part])
            owner._modules[part] = child
            owner = child
    return root


def _calls_blocks(root: nn.Module, names: list[str]) -> bool:
    """Whether the root's graph calls every block (as a module, or through call_with_params at O2/O3)."""
    from amp_fx.graph_ops.casts import call_with_params

    if not isinstance(root, fx.GraphModule):
        return False
    called = set()
    for node in root.graph.nodes:
        if node.op == "call_module":
            called.add(node.target)
        elif node.op == "call_function" and node.target is call_with_params and node.args:
            called.add(getattr(node.args[0], "target", None))
    return set(names) <= called


def _call_blocks_as_modules(gm: fx.GraphModule, names: list[str]) -> None:
    """Make ``gm`` call each block as a module, passing no parameters in from outside.

    At O2/O3 the root casts the parameters of a leaf it keeps in fp32 and runs it
    through ``call_with_params``; the converted block that replaces it owns its
    parameters, and FSDP2 must see a plain ``block(...)`` call.
    """
    from amp_fx.graph_ops.casts import call_with_params

    holders = {n for n in gm.graph.nodes if n.op == "get_attr" and n.target in names}
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is call_with_params and node.args[0] in holders:
            with gm.graph.inserting_before(node):
                call = gm.graph.call_module(node.args[0].target, tuple(node.args[2:]), dict(node.kwargs))
            call.meta.update(node.meta)
            node.replace_all_uses_with(call)
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    for node in gm.graph.nodes:
        owner = node.target.rpartition(".")[0] if node.op == "get_attr" else None
        if owner is not None and any(owner == b or owner.startswith(b + ".") for b in names):
            raise AmpRuntimeError(
                f"convert_for_sharding: the converted model still reads {node.target!r} outside its "
                "block's forward, so FSDP2 would see it sharded; pass the enclosing module as the block"
            )


def _refuse_fsdp_param_dtype(module: nn.Module, args: Any) -> None:
    """Forward pre-hook: refuse FSDP2's ``param_dtype`` where it would change what amp_fx's graph gets.

    ``MixedPrecisionPolicy(param_dtype=bf16)`` casts every parameter of the
    sharded module at all-gather (norm weights included) and every floating
    input, before the converted graph runs: the ops amp_fx keeps in fp32 would
    get bf16 weights and inputs (values cast twice, the second time to no avail).
    """
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return
    wanted = module._get_fsdp_state()._mp_policy.param_dtype
    if wanted is None:
        return
    held = {dtype for dtype in getattr(module, "_amp_fx_param_dtypes", ())}
    if held and held != {wanted}:
        raise AmpValueError(
            f"fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype={wanted})) on a module "
            f"amp_fx converted (its parameters are {sorted(map(str, held))}): FSDP2 would cast every "
            "parameter and input to that dtype before amp_fx's graph runs, so the ops amp_fx keeps in "
            "fp32 (norms, softmax, losses) would get rounded weights and inputs. Leave param_dtype "
            "unset (amp_fx casts each weight once, per op) and set only reduce_dtype: "
            "MixedPrecisionPolicy(reduce_dtype=torch.float32)."
        )


def _check_uniform_dtypes(root: nn.Module, names: list[str]) -> None:
    """FSDP2 gathers one parameter group in one dtype: refuse a block (or the rest) holding two."""
    groups = {name: root.get_submodule(name) for name in names}
    in_blocks = {id(p) for block in groups.values() for p in block.parameters()}
    groups["the model outside the blocks"] = [p for p in root.parameters() if id(p) not in in_blocks]
    root._amp_fx_param_dtypes = {p.dtype for p in groups["the model outside the blocks"] if p.requires_grad}
    for name, group in groups.items():
        params = group.parameters() if isinstance(group, nn.Module) else group
        dtypes = {p.dtype for p in params if p.requires_grad}
        if isinstance(group, nn.Module):
            group._amp_fx_param_dtypes = dtypes  # read by _refuse_fsdp_param_dtype
        if len(dtypes) > 1:
            raise AmpValueError(
                f"convert_for_sharding: {name} holds parameters of dtypes {sorted(map(str, dtypes))}, and "
                "fully_shard needs one dtype per sharded module. At O2 the norms keep fp32 parameters; "
                "pass keep_batchnorm_fp32=False (their fp32 masters still take the updates), or shard "
                "a coarser module"
            )


def convert_for_sharding(
    model: nn.Module,
    level: str = "O1",
    *,
    blocks: Union[type, str, Sequence[Union[type, str]]],
    example_inputs: Any = None,
    example_kwarg_inputs: Any = None,
    convert_root: bool = True,
    **convert_kwargs: Any,
) -> nn.Module:
    """Convert ``model`` so that each block stays a module FSDP2 can shard: ``fully_shard`` it after this.

    Each block (a submodule of a type in ``blocks``, or named in it) is converted
    on its own with :func:`amp_fx.convert`; the rest of the model is converted
    around them with the blocks kept as fp32 leaves, which the converted blocks
    then replace. Blocks take and return fp32 floating tensors (as every
    converted module), so the boundary between them costs one cast each way.

    ``example_inputs`` / ``example_kwarg_inputs`` are for the whole model: they
    are run once in fp32 to record each block's own inputs, which its
    conversion then gets. The other keywords go to every :func:`amp_fx.convert`.
    ``convert_root=False`` converts only the blocks and returns a copy of
    ``model`` holding them (the rest runs as written, fp32, sharing the
    model's parameters); needed when the model is traced by torch.export
    (Hugging Face models), which would inline the blocks.
    Returns the converted model; at O2 its ``amp_fx_masters`` are the original
    model's fp32 parameters, as :func:`amp_fx.convert` sets them. FSDP2 gathers
    each sharded module's parameters in one dtype, so at O2/O3 a block with
    fp32 norm parameters beside bf16 ones is refused: pass
    ``keep_batchnorm_fp32=False`` (the norms' fp32 masters still take the updates).
    """
    from amp_fx.converter.api import convert

    names = _block_names(model, blocks)
    examples = {}
    if example_inputs is not None or example_kwarg_inputs is not None:
        examples = _block_examples(model, names, example_inputs, example_kwarg_inputs)
    fp32_blocks = {f"module:{name}": "fp32" for name in names}
    policy = convert_kwargs.pop("policy", None)
    if policy is not None:
        raise AmpValueError(
            "convert_for_sharding does not take policy= yet: the blocks' own fp32 policy entries "
            "would have to be merged with yours; convert the blocks yourself with amp_fx.convert"
        )
    if convert_root:
        root = convert(model, level, example_inputs=example_inputs, example_kwarg_inputs=example_kwarg_inputs,
                       leaf_modules=names, policy=fp32_blocks, **convert_kwargs)
        if not _calls_blocks(root, names):
            raise AmpValueError(
                "convert_for_sharding: the model was traced by torch.export, which inlines the blocks "
                "instead of calling them, so FSDP2 could not gather their parameters. Pass "
                "convert_root=False: the blocks are converted and the rest of the model runs as written "
                "(fp32)."
            )
    else:
        root = _shell(model, names)
    for name in names:
        args, kwargs = examples.get(name, (None, None))
        # A block's recorded inputs are of one shape; the root's dynamic_shapes do not name its arguments.
        block_kwargs = dict(convert_kwargs, dynamic_shapes=False) if kwargs else convert_kwargs
        block = convert(model.get_submodule(name), level, example_inputs=args,
                        example_kwarg_inputs=kwargs or None, **block_kwargs)
        if kwargs:
            _drop_specialised_kwargs(block, kwargs)
        parent, _, leaf = name.rpartition(".")
        root.get_submodule(parent)._modules[leaf] = block
    if convert_root:
        _call_blocks_as_modules(root, names)
    _check_uniform_dtypes(root, names)
    for module in [root, *(root.get_submodule(n) for n in names)]:
        module.register_forward_pre_hook(_refuse_fsdp_param_dtype)
    if getattr(root, "amp_fx_masters", None) is not None or (not convert_root and level == "O2"):
        attach_masters(root, dict(model.named_parameters()))
    return root


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create an optimizer's state tensors (momentum, ...) without changing any parameter.

    ``torch.distributed.checkpoint.load`` loads in place into the tensors of the
    state dict it is given, and a fresh optimizer has none yet. This steps it
    once with zero gradients and a learning rate of 0, then clears the gradients;
    the loaded state then overwrites every value, the step count included.
    """
    inner = getattr(optimizer, "optimizer", optimizer)  # MasterWeightOptimizer: its masters' optimizer
    params = [p for group in inner.param_groups for p in group["params"]]
    if all(p in inner.state for p in params):
        return
    lrs = [group["lr"] for group in inner.param_groups]
    with torch.no_grad():
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in inner.param_groups:
            group["lr"] = 0.0 if not isinstance(group["lr"], torch.Tensor) else torch.zeros_like(group["lr"])
        try:
            inner.step()
        finally:
            for group, lr in zip(inner.param_groups, lrs):
                group["lr"] = lr
            for p in params:
                p.grad = None
