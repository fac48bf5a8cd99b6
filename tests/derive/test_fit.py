"""The one memory verdict (derive/fit.py) and the device terms it judges (device_memory.py):
the band's edges, "headroom" in bytes, the communicators NeoX and DeepSpeed create, the fitted
terms' bounds, and the 39B layout the last release refused (tp 8, dp 4, pp 16, micro-batch 24,
512 A100-80GB: it ran)."""
from dataclasses import replace

import pytest

from neox_perf.derive import derive
from neox_perf.derive import device_memory as dm
from neox_perf.derive.fit import OVER_FRACTION, UNDER_FRACTION, band, fail_above, memory_fit

from derive_specs import make_config

GIB = 2 ** 30
A100_80 = 80 * GIB


def _stages(totals):
    base = derive(make_config(num_layers=4, hidden_size=128, num_attention_heads=4,
                              seq_length=128, max_position_embeddings=128), 1000, A100_80)
    m = base.stages[0].memory
    return [replace(m, stage=i, device_total=int(t)) for i, t in enumerate(totals)]


def test_the_band_decides_and_headroom_is_bytes():
    cap = dm.usable(A100_80)
    low, high = band(cap)
    assert low == int(cap * (1 - UNDER_FRACTION)) < cap < high == int(cap * (1 + OVER_FRACTION))
    for total, level in ((low - 1, "ok"), (low + 1, "warning"), (cap + 1, "warning"),
                         (high, "warning"), (high + 1, "fail")):
        fit = memory_fit(_stages([GIB, total, 2 * GIB]), A100_80)
        assert (fit.level, fit.stage, fit.device_total) == (level, 1, total)
        assert fit.headroom == cap - total  # bytes, negative above the usable capacity
        assert fit.fits == (level != "fail") and fit.over == ((1,) if level == "fail" else ())


def test_a_limit_lowers_the_fail_edge_only_where_it_is_lower():
    cap = dm.usable(A100_80)
    assert fail_above(A100_80, 0.9) == int(0.9 * cap)
    assert fail_above(A100_80, 1.0) == int(cap) < fail_above(A100_80)
    fit = memory_fit(_stages([0.95 * cap]), A100_80, limit=0.9)
    assert fit.level == "fail" and fit.band[0] <= fit.band[1] == int(0.9 * cap)


def test_communicators_are_the_groups_neox_and_deepspeed_create():
    cfg = make_config(world_size=512, pipe_parallel_size=16, model_parallel_size=8,
                      no_weight_tying=False)
    p = cfg.parallel
    first = dm.communicators(p, 0, 16, tied=True)
    middle = dm.communicators(p, 5, 16, tied=True)
    assert first == {"world": 1, "data": 1, "model": 1, "slice": 1, "pipe": 1, "tied": 1, "p2p": 1}
    assert middle == {**first, "tied": 0, "p2p": 2}
    alone = dm.communicators(make_config(world_size=1).parallel, 0, 1, tied=True)
    assert sum(alone.values()) == 0


def test_fitted_terms_are_positive_and_bounded_by_the_facts():
    lo, hi = dm.NCCL_BOUNDS
    assert lo <= dm.FITTED.nccl_per_communicator <= hi and 0 < dm.FITTED.reserve_fraction <= 1
    wild = dm.DeviceFit(nccl_per_communicator=100 * GIB, reserve_fraction=-3).bounded()
    assert (wild.nccl_per_communicator, wild.reserve_fraction) == (hi, 0.0)
    assert set(dm.SOURCES) == set(dm.TERMS)


# A GPT-NeoX-style 39.1B: Megatron-LM's (Narayanan et al., SC21, Table 1: 48 layers, hidden 8192,
# 64 heads), sequence 2048, checkpointed, flash attention, fp16 ZeRO-1
B39 = dict(num_layers=48, hidden_size=8192, num_attention_heads=64, seq_length=2048,
           max_position_embeddings=2048, world_size=512, pipe_parallel_size=16,
           model_parallel_size=8, micro_batch_size=24, gradient_accumulation_steps=16,
           checkpoint_activations=True, checkpoint_num_layers=1, precision="fp16", zero_stage=1,
           no_weight_tying=True)


def test_the_39b_layout_that_ran_is_not_refused():
    d = derive(make_config(**B39), 50257, A100_80)
    fit = memory_fit([s.memory for s in d.stages], A100_80)
    assert fit.level != "fail", fit
    h = 24 * 2048 * 8192 * 2  # one micro-batch's [b, s, h] fp16 activation
    for s in d.stages[1:-1]:
        m = s.memory
        blocks = s.transformer_layers
        # per micro-batch in flight: the received input (one copy: DeepSpeed rebuilds the
        # partitioned activation into the slot and runs on it), each later block's
        # checkpointed input, and the output's tp partition
        per_mb = h + 2048 ** 2 + (blocks - 1) * h + h / 8
        assert m.peak["activations"] == pytest.approx(m.micro_batches_in_flight * per_mb, rel=0.01)
