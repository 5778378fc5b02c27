"""torch.utils.checkpoint regions stay checkpointed through convert(), with their casts inside.

The rules under test: the converted module calls torch.utils.checkpoint on
each region the model checkpointed; the region holds the casts only it reads;
recomputation is bitwise the first forward (outputs and gradients equal those
of the same conversion without checkpointing, dropout included); and the
activations saved for backward shrink as they do in eager.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint
from torch.utils.checkpoint import checkpoint

import amp_fx
from routes import RoundST
from amp_fx.frontend.checkpoint_regions import CheckpointedRegion


class Block(nn.Module):
    def __init__(self, width=64, p=0.0):
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.drop = nn.Dropout(p)
        self.down = nn.Linear(4 * width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(x + self.down(self.drop(torch.nn.functional.gelu(self.up(x)))))


class Net(nn.Module):
    """Two blocks; ``style`` says how (and whether) they are checkpointed."""

    def __init__(self, style="imported", p=0.0):
        super().__init__()
        self.style = style
        self.inp = nn.Linear(32, 64)
        self.blocks = nn.ModuleList([Block(p=p), Block(p=p)])
        self.out = nn.Linear(64, 8)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            if self.style == "imported":
                h = checkpoint(block, h, use_reentrant=False)
            elif self.style == "attribute":
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
            elif self.style == "closure":
                h = checkpoint(lambda t, b=block: b(t) * 0.5, h, use_reentrant=False)
            else:
                h = block(h)
        return self.out(h)


def _pair(style, level="O1", p=0.0):
    """The same weights converted with and without checkpointing."""
    checkpointed = Net(style, p=p)
    plain = copy.deepcopy(checkpointed)
    plain.style = "none"
    return (amp_fx.convert(checkpointed, level, dtype=torch.bfloat16),
            amp_fx.convert(plain, level, dtype=torch.bfloat16))


def _run(gm, x, seed=0):
    gm.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = gm(x)
    out.float().square().sum().backward()
    return out.detach(), {n: p.grad for n, p in gm.named_parameters()}


def _saved_bytes(gm, x):
    """Bytes of activation memory autograd keeps for backward during one forward.

    Saved tensors are counted once per storage; parameters are not counted
    (saving one keeps no extra memory).  A checkpointed region saves only its inputs.
    """
    params = {p.untyped_storage().data_ptr() for p in gm.parameters()}
    storages = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gm(x)
    return sum(storages.values())


@pytest.mark.parametrize("style", ["imported", "attribute", "closure"])
def test_regions_stay_checkpointed(style):
    checkpointed, _ = _pair(style)
    regions = [m for m in checkpointed.modules() if isinstance(m, CheckpointedRegion)]
    assert len(regions) == 2
    assert all(r.options == {"use_reentrant": False} for r in regions)
    # each region holds its GEMMs and the casts of its weights
    body = regions[0].body
    targets = [str(n.target) for n in body.graph.nodes]
    assert "up" in "".join(targets) or any("linear" in t for t in targets)
    assert any(n.op == "call_method" and n.target == "to" for n in body.graph.nodes)
    assert any("checkpointed region kept" in note for note in checkpointed.amp_report.notes)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_recomputation_is_bitwise_the_first_forward(level):
    """Dropout inside the region: the recomputed mask, casts and values must equal the first forward's."""
    checkpointed, plain = _pair("imported", level, p=0.3)
    checkpointed.train(), plain.train()
    x = torch.randn(16, 32)
    out_c, grads_c = _run(checkpointed, x)
    out_p, grads_p = _run(plain, x)
    assert torch.equal(out_c, out_p)
    assert grads_c.keys() == grads_p.keys()
    for name in grads_p:
        assert torch.equal(grads_c[name], grads_p[name]), name


def test_gradients_agree_with_eager_checkpoint_under_autocast():
    model = Net("imported")
    x = torch.randn(16, 32)
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    _, got = _run(gm, x)
    got = {n: g.clone() for n, g in got.items()}
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    out.float().square().sum().backward()
    for name, param in model.named_parameters():
        scale = param.grad.abs().max().item()
        torch.testing.assert_close(got[name], param.grad, rtol=5e-2, atol=5e-2 * scale, msg=name)


def test_checkpointing_still_saves_activation_memory():
    checkpointed, plain = _pair("imported")
    x = torch.randn(64, 32)
    saved_c, saved_p = _saved_bytes(checkpointed, x), _saved_bytes(plain, x)
    # measured: 37888 against 325632 bytes (eager: 57344 against 353280)
    assert saved_c < 0.25 * saved_p, (saved_c, saved_p)


def test_state_dict_keys_and_copies_are_unchanged():
    model = Net("imported")
    gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    assert list(gm.state_dict().keys()) == list(model.state_dict().keys())
    x = torch.randn(4, 32)
    expected = gm(x)
    torch.testing.assert_close(copy.deepcopy(gm)(x), expected)


def test_train_and_eval_reach_modules_inside_a_region():
    checkpointed, _ = _pair("imported", p=0.5)
    x = torch.randn(8, 32)
    checkpointed.eval()
    assert torch.equal(checkpointed(x), checkpointed(x))
    checkpointed.train()
    assert not torch.equal(checkpointed(x), checkpointed(x))


def test_backend_route_runs_the_checkpointed_model():
    model, x = Net("imported"), torch.randn(8, 32)
    compiled = torch.compile(model, backend=amp_fx.backend(inner="aot_eager"))
    out = compiled(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    torch.testing.assert_close(out.float(), expected.float(), rtol=5e-2, atol=5e-2)
    out.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


class Quantizing(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.3)
        self.b = nn.Linear(16, 16)

    def forward(self, x, scale=1.0):
        return self.b(RoundST.apply(self.drop(self.a(x)) * 4.0) * scale)


class Variants(nn.Module):
    """Nested regions, a reentrant region, a keyword for the checkpointed function; ``plain`` runs the same without."""

    def __init__(self, style):
        super().__init__()
        self.style = style
        self.blk = Quantizing()
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        if self.style == "nested":
            h = checkpoint(lambda t: checkpoint(self.blk, t, use_reentrant=False) + 1, x, use_reentrant=False)
        elif self.style == "reentrant":
            h = checkpoint(self.blk, x, 0.5, use_reentrant=True) + 1
        elif self.style == "keyword":
            h = checkpoint(self.blk, x, scale=0.5, use_reentrant=False) + 1
        else:
            h = self.blk(x, scale=1.0 if self.style == "plain_nested" else 0.5) + 1
        return self.head(h)


@pytest.mark.parametrize("style, plain", [("nested", "plain_nested"), ("reentrant", "plain"), ("keyword", "plain")])
def test_region_variants_and_a_custom_function_inside(style, plain):
    """Nested regions merge into the outermost; the Function inside keeps its backward; recompute is bitwise."""
    model = Variants(style)
    reference = copy.deepcopy(model)
    reference.style = plain
    x = torch.randn(8, 16)
    checkpointed = amp_fx.convert(model, "O1", dtype=torch.bfloat16)
    converted = amp_fx.convert(reference, "O1", dtype=torch.bfloat16)
    assert sum(isinstance(m, CheckpointedRegion) for m in checkpointed.modules()) == 1
    out_c, grads_c = _run(checkpointed, x, seed=3)
    out_p, grads_p = _run(converted, x, seed=3)
    assert torch.equal(out_c, out_p)
    assert all(torch.equal(grads_c[n], grads_p[n]) for n in grads_p)
    assert grads_c["blk.a.weight"].abs().sum() > 1.0  # round's own derivative would give 0
