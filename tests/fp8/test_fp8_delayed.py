"""Delayed scaling (Transformer Engine's recipe): scales from an amax history kept in the module's buffers.

Rule under test: each tensor (input, weight, grad_output) is quantized with
``scale = fp8_max / amax / 2**margin``, ``amax`` the ``max`` (or ``most_recent``)
of the amaxes of the calls before it (newest first, ``history_len`` long; an amax
of 0 keeps the old scale, which starts at 1); history and scales are in
``state_dict`` and a resumed run is bit for bit the uninterrupted one.
"""

from __future__ import annotations

import copy

import pytest
import torch

import amp_fx

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _convert(model, **fp8):
    options = {"recipe": "delayed", "size_rule": "all", "history_len": 3, **fp8}
    return amp_fx.convert(model, "O1", example_inputs=(torch.randn(4, 32),), fp8=options)


def _reference_scales(amaxes, fp8_max, history_len, amax_compute, margin):
    """The scale after each step, by TE's formula, in plain Python floats (float32 at the end)."""
    history, scale, scales = [0.0] * history_len, 1.0, []
    for amax in amaxes:
        history = [amax] + history[:-1]
        chosen = max(history) if amax_compute == "max" else history[0]
        if chosen > 0:
            scale = fp8_max / chosen / 2.0 ** margin
        scales.append(scale)
    return scales


@pytest.mark.parametrize("amax_compute,margin", [("max", 0), ("most_recent", 1)])
def test_scales_after_five_steps_match_the_formula(amax_compute, margin):
    """Five steps of inputs of changing size: the input, weight and grad_output scales are TE's."""
    model = torch.nn.Linear(32, 16, bias=False)
    gm = _convert(model, amax_compute=amax_compute, margin=margin)
    (state,) = amp_fx.fp8_states(gm).values()
    x_amax, g_amax = [], []
    for step, size in enumerate([1.0, 8.0, 0.5, 0.25, 2.0]):
        x = torch.randn(4, 32) * size
        grad = torch.randn(4, 16) * (step + 1)
        (gm(x) * grad).sum().backward()
        x_amax.append(x.abs().max().item())
        # grad_output reaches the GEMM as bf16 (the output cast to fp32 is the graph's exit cast)
        g_amax.append(grad.bfloat16().abs().max().item())
    w_amax = [model.weight.abs().max().item()] * 5
    for role, (amaxes, fp8_max) in enumerate([(x_amax, E4M3_MAX), (w_amax, E4M3_MAX), (g_amax, E5M2_MAX)]):
        expected = _reference_scales(amaxes, fp8_max, 3, amax_compute, margin)[-1]
        assert state.scale[role].item() == pytest.approx(expected, rel=1e-6), role
    assert state.amax_history[0].tolist() == pytest.approx(list(reversed(x_amax))[:3])


def test_forward_uses_the_scale_of_the_steps_before():
    """The second forward quantizes its input with the scale the first one left, not its own amax."""
    model = torch.nn.Linear(32, 16, bias=False)
    gm = _convert(model, emulate=True)
    gm(torch.randn(4, 32))  # history: this amax
    (state,) = amp_fx.fp8_states(gm).values()
    scale_x, scale_w = state.scale[0].clone(), state.scale[1].clone()
    x = torch.randn(4, 32) * 100  # far larger: it saturates with the old scale
    q = lambda t, s: (t.float() * s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() / s  # noqa: E731
    expected = torch.mm(q(x, scale_x), q(model.weight.detach().t(), scale_w)).bfloat16().float()
    assert torch.equal(gm(x), expected)


def test_history_and_scales_round_trip_through_state_dict():
    """Train 3 steps, save, load into a fresh conversion, train 3 more: identical to 6 uninterrupted steps."""
    torch.manual_seed(0)
    batches = [(torch.randn(4, 32), torch.randn(4, 16)) for _ in range(6)]
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    resumed_model = copy.deepcopy(model)

    def steps(gm, opt, chunk):
        for x, y in chunk:
            opt.zero_grad()
            torch.nn.functional.mse_loss(gm(x), y).backward()
            opt.step()

    gm = _convert(model)
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    steps(gm, opt, batches)

    first = _convert(copy.deepcopy(resumed_model))
    first_opt = torch.optim.SGD(first.parameters(), lr=0.1)
    steps(first, first_opt, batches[:3])
    saved = copy.deepcopy(first.state_dict())
    assert any(k.endswith("amax_history") for k in saved) and any(k.endswith(".scale") for k in saved)
    second = _convert(resumed_model)
    second.load_state_dict(saved)
    second_opt = torch.optim.SGD(second.parameters(), lr=0.1)
    second_opt.load_state_dict(first_opt.state_dict())
    steps(second, second_opt, batches[3:])
    for (name, a), (_, b) in zip(gm.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name


def test_evaluation_under_no_grad_uses_the_trained_scales_and_changes_nothing():
    """Delayed scaling records amaxes in training forwards only: an evaluation under no_grad quantizes with the
    scales training left, so two evaluations are bit-identical and the next training step is the one an
    uninterrupted run takes (before, each evaluation pushed its amaxes into the history)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    twin = copy.deepcopy(model)
    batches = [(torch.randn(4, 32), torch.randn(4, 16)) for _ in range(3)]
    probe = torch.randn(4, 32) * 10  # larger than training's inputs: recorded, it would move the scales

    def train(gm, evaluate):
        opt = torch.optim.SGD(gm.parameters(), lr=0.1)
        outputs = []
        for x, y in batches:
            opt.zero_grad()
            torch.nn.functional.mse_loss(gm(x), y).backward()
            opt.step()
            if evaluate:
                with torch.no_grad():
                    outputs += [gm(probe), gm(probe)]
        return outputs

    evaluated, plain = _convert(model), _convert(twin)
    outputs = train(evaluated, evaluate=True)
    train(plain, evaluate=False)
    assert all(torch.equal(a, b) for a, b in zip(outputs[::2], outputs[1::2]))
    for (name, a), (_, b) in zip(evaluated.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b), name


def test_current_scaling_keeps_state_dict_keys():
    """Tensorwise and rowwise keep no state: the converted module's state_dict keys are the model's."""
    model = torch.nn.Linear(32, 16)
    for recipe in ("tensorwise", "rowwise"):
        gm = amp_fx.convert(model, "O1", example_inputs=(torch.randn(4, 32),), fp8={"recipe": recipe, "size_rule": "all"})
        assert list(gm.state_dict()) == list(model.state_dict())


def test_two_ranks_use_identical_scales(tmp_path):
    """2 gloo ranks, different data: the amaxes are reduced (max) across ranks, so both keep the same history and scales."""
    from fp8_ranks import launch

    first, second = launch(str(tmp_path))
    assert first.keys() == second.keys() and first
    for name in first:
        assert torch.equal(first[name][0], second[name][0]), name
        assert torch.equal(first[name][1], second[name][1]), name
    # rank 1's inputs were twice rank 0's: the shared input history is rank 1's amaxes, not rank 0's
    assert first["0"][1][0, 0] > 0


@pytest.mark.parametrize("ddp", [False, True])
def test_two_ranks_reduce_once_per_step(tmp_path, ddp):
    """One all_reduce per optimizer step (both GEMMs' pending amaxes, flattened), not one per tensor per call.

    Lazy sync: the first forward after a backward reduces the step before it (step 1 has nothing to reduce).
    With fp8_sync(gm, optimizer): one at each optimizer.step(), however many micro-batches it accumulated.
    Either way each step adds one history entry: the max over the ranks and the step's micro-batches.
    Under DDP too: its buffer broadcast (rank 0's buffers, every forward) cannot drop rank 1's larger amaxes,
    which wait outside the buffers until the sync.
    """
    from fp8_ranks import launch_counting

    first, second = launch_counting(str(tmp_path), ddp)
    assert first["per_step"] == second["per_step"] == [0, 1, 1, 1, 1, 1, 1]
    assert set(first["sizes"]) == {2 * 3}  # 2 GEMMs x 3 operands' pending amaxes, in one tensor
    assert torch.equal(first["history"], second["history"]) and torch.equal(first["scale"], second["scale"])
    # input history of GEMM 0, newest first: 4 steps of 1 micro-batch, 3 of 2, then one empty slot
    both = [max(a, b) for a, b in zip(first["local_amax"], second["local_amax"])]
    per_step = both[:4] + [max(both[i], both[i + 1]) for i in (4, 6, 8)]
    assert first["history"][0].tolist() == pytest.approx(per_step[::-1] + [0.0], rel=0, abs=0)
    assert first["scale"][0].item() == pytest.approx(E4M3_MAX / max(per_step), rel=1e-6)


@pytest.mark.parametrize("level,wrapper", [("O2", "MasterWeightOptimizer"), ("O3", "LowPrecisionOptimizer")])
def test_sync_on_step_through_amp_fx_optimizers(level, wrapper):
    """The step hook fires through amp_fx's optimizer wrappers: after each step the scales are the per-call run's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    batches = [torch.randn(4, 32) * (i + 1) for i in range(3)]
    runs = []
    for hook in (False, True):
        gm = amp_fx.convert(copy.deepcopy(model), level, example_inputs=(batches[0],),
                            fp8={"recipe": "delayed", "size_rule": "all", "history_len": 3})
        opt = getattr(amp_fx, wrapper)(torch.optim.SGD(gm.parameters(), lr=0.1), gm)
        if hook:
            amp_fx.fp8_sync(gm, opt)
        scales = []
        for x in batches:
            gm(x).sum().backward()
            opt.step()
            opt.zero_grad()
            scales.append(torch.stack([s.scale.clone() for s in amp_fx.fp8_states(gm).values()]))
        runs.append(scales)
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert not torch.equal(runs[1][0], torch.ones_like(runs[1][0]))  # the hook did update them
