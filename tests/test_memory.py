"""Memory of one update, measured by following autograd's saved tensors through the whole update."""

import pytest
import torch

from gaccum_lib.memory import SavedTensorTracker, memory_demo_model, memory_table, peak_step_memory

SMALL = dict(width=64, depth=2, features=16)


def test_the_tracker_sees_saved_tensors_appear_and_go():
    weight = torch.randn(8, 8, requires_grad=True)
    with SavedTensorTracker(exclude=[weight]) as tracker:
        x = torch.randn(4, 8)
        hidden = torch.tanh(x @ weight)  # saves x (a new storage) and tanh's output
        assert tracker.live == 2 * 4 * 8 * 4  # two float32 4x8 tensors, the weight not counted
        hidden.sum().backward()
        assert tracker.live == 0  # the backward freed them
        kept = (x @ weight).sum()
        more = (x @ weight).sum()
        assert tracker.live == 4 * 8 * 4  # the same x saved twice is one storage
        (kept + more).backward()
    assert tracker.live == 0 and tracker.peak == 2 * 4 * 8 * 4


def test_accumulation_is_flat_the_big_batch_and_the_summed_loss_grow():
    table = memory_table(micro_batch_size=8, accumulation_steps=(1, 2, 4), summed=True, **SMALL)
    big, accumulated, summed = table["full_batch"], table["accumulation"], table["summed_loss"]
    assert [r.effective_batch for r in big] == [r.effective_batch for r in accumulated] == [8, 16, 32]
    one = accumulated[0].peak_activations
    assert one > 0
    assert [r.peak_activations for r in accumulated] == [one, one, one]
    assert [r.peak_activations for r in big] == [one, 2 * one, 4 * one]
    assert [r.peak_activations for r in summed] == [one, 2 * one, 4 * one]
    weights = sum(p.numel() * 4 for p in memory_demo_model(**SMALL).parameters())
    assert {r.parameters for r in big + accumulated + summed} == {weights}
    assert {r.gradients for r in big + accumulated + summed} == {weights}  # measured from .grad
    assert accumulated[2].peak == 2 * weights + one


def test_a_measurement_leaves_the_model_without_gradients():
    model = memory_demo_model(**SMALL)
    peak_step_memory(model, 4, 3, features=16)
    assert all(p.grad is None for p in model.parameters())


def test_memory_arguments_are_checked():
    model = memory_demo_model(**SMALL)
    with pytest.raises(ValueError, match="backward must be one of each, summed; got 'once'"):
        peak_step_memory(model, 4, 2, backward="once", features=16)
    with pytest.raises(ValueError, match=r"grad_accum_steps must be in \[1, 4096\], got 0"):
        peak_step_memory(model, 4, 0, features=16)
    with pytest.raises(ValueError, match=r"accumulation_steps\[1\] must be in \[1, 4096\], got 0"):
        memory_table(accumulation_steps=(1, 0), **SMALL)
    with pytest.raises(TypeError, match="accumulation_steps must be a sequence of ints, got int"):
        memory_table(accumulation_steps=4, **SMALL)
    with pytest.raises(ValueError, match="accumulation_steps must hold at least one GA"):
        memory_table(accumulation_steps=(), **SMALL)
    with pytest.raises(ValueError, match=r"micro_batch_size must be in \[1, 65536\], got 0"):
        memory_table(micro_batch_size=0, **SMALL)


def test_peak_step_memory_on_an_explicit_device_is_the_same_measurement():
    # scripts/gpu_check.sh passes device="cuda"; on the CPU the argument must change nothing
    model = memory_demo_model(width=32, depth=2, features=16)
    default = peak_step_memory(model, 4, 3, features=16)
    explicit = peak_step_memory(model, 4, 3, features=16, device="cpu")
    assert explicit == default and explicit.peak_activations > 0


def test_lesson_01_figures_of_the_demo_model():
    """What lesson 01 says of its measurement: 2.4 million weights, a fixed share, activations in proportion."""
    table = memory_table(micro_batch_size=32, accumulation_steps=(1, 2, 4, 8, 16), summed=True)
    big, accumulated, summed = table["full_batch"], table["accumulation"], table["summed_loss"]
    assert 2.3e6 < sum(p.numel() for p in memory_demo_model().parameters()) < 2.5e6  # "about 2.4 million"
    assert {round((r.parameters + r.gradients) / 2**20, 1) for r in big + accumulated + summed} == {18.0}
    assert len({r.peak for r in accumulated}) == 1  # flat
    assert big[-1].peak_activations == 16 * big[0].peak_activations  # 16x the batch, 16x the activations
    assert [r.peak for r in summed] == [r.peak for r in big]  # one backward of the summed loss: the big batch's
    assert round(big[0].peak_activations / 2**20, 2) == 0.78  # memory_demo_model's docstring
    assert big[-1].peak > 1.5 * accumulated[-1].peak
