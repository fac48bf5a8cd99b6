import math

import numpy as np
import pytest

from neox_perf.prediction import opspec


def test_every_op_has_costs_for_its_phases():
    for name, spec in opspec.OPS.items():
        feats = {f: (0.0 if f == "causal" else 64.0) for f in spec.features}
        for phase in spec.phases:
            assert spec.flops(phase, feats) > 0, name
            assert spec.bytes_moved(phase, feats) > 0, name
        with pytest.raises(ValueError):
            spec.flops("nonsense", feats)


def test_canonical_vocabulary():
    assert set(opspec.OPERATORS) == {
        "embedding", "layernorm", "rmsnorm", "res_add", "linear1", "linear2", "linear3", "linear4",
        "linear_final", "rope", "qk", "fillmask", "softmax", "fused_softmax", "attn_dropout", "av",
        "flash_attention", "gelu", "cross_entropy", "optimizer"}
    assert opspec.COLLECTIVES == ("allreduce", "allgather", "p2p")


def test_gemm_costs_and_dtype_parameter():
    f = {"m": 1024, "k": 512, "n": 256}
    assert opspec.op_flops("linear1", "fwd", f) == 2 * 1024 * 512 * 256
    assert opspec.op_flops("linear1", "bwd", f) == 2 * opspec.op_flops("linear1", "fwd", f)
    io = 1024 * 512 + 512 * 256 + 1024 * 256
    assert opspec.op_bytes("linear1", "fwd", f) == 2 * io
    assert opspec.op_bytes("linear1", "fwd", f, dtype_bytes=4) == 4 * io


def test_causal_flash_attention_does_half_the_work():
    f = {"b": 2, "l": 4096, "heads": 16, "head_dim": 128, "causal": 0}
    full = opspec.op_flops("flash_attention", "fwd", f)
    half = opspec.op_flops("flash_attention", "fwd", dict(f, causal=1))
    assert half == pytest.approx((33 / 64) * full)  # 32 tiles of 128: 528 of 1024 run
    assert opspec.op_flops("flash_attention", "bwd", f) == pytest.approx(opspec.FLASH_BWD_FLOP_RATIO * full)


@pytest.mark.parametrize("l, fraction", [(64, 1.0), (128, 1.0), (256, 0.75), (384, 4 / 6),
                                         (2048, 17 / 32), (1 << 20, 0.5)])
def test_causal_work_counts_the_diagonal_tiles(l, fraction):
    # a diagonal tile runs whole: at one tile causal saves nothing, at long l half the work
    assert opspec.causal_work_fraction(l) == pytest.approx(fraction, rel=1e-3)
    f = {"b": 1, "l": l, "heads": 2, "head_dim": 64}
    ratio = (opspec.op_flops("flash_attention", "fwd", dict(f, causal=1))
             / opspec.op_flops("flash_attention", "fwd", dict(f, causal=0)))
    assert ratio == pytest.approx(fraction, rel=1e-3)


def _torch_cpu_mask_fraction(l):
    """The work PyTorch's CPU kernel does, counted cell by cell: a query block [m, m + q) scores
    every key of each 512-key block that starts below m + q (FlashAttentionKernel.cpp)."""
    q = 256 if l >= 768 else 64 if l >= 192 else 32
    starts = np.arange(0, l, min(512, l))
    cells = 0
    for m in range(0, l, q):
        rows = min(q, l - m)
        entered = starts[starts < m + rows]
        cells += rows * sum(min(512, l - n) for n in entered)
    return cells / (l * l)


@pytest.mark.parametrize("l, fraction", [(64, 1.0), (191, 1.0), (384, 1.0), (512, 1.0), (768, 7 / 9),
                                         (1024, 0.75), (1536, 2 / 3), (2048, 0.625), (4096, 0.5625)])
def test_torch_cpu_causal_work_follows_its_blocks(l, fraction):
    # PyTorch's CPU kernel skips only whole 512-key blocks: nothing up to one block, where
    # FlashAttention-2's 128-row tiles already save a quarter at l 256
    assert opspec.causal_work_fraction(l, opspec.TORCH_CPU) == pytest.approx(fraction, rel=1e-9)
    assert opspec.causal_work_fraction(l, opspec.TORCH_CPU) == pytest.approx(_torch_cpu_mask_fraction(l))
    f = {"b": 2, "l": l, "heads": 4, "head_dim": 64}
    for phase in ("fwd", "bwd"):
        full = opspec.op_flops("flash_attention", phase, dict(f, causal=0), causal_kernel=opspec.TORCH_CPU)
        assert full == opspec.op_flops("flash_attention", phase, dict(f, causal=0))  # non-causal: no blocks skipped
        causal = opspec.op_flops("flash_attention", phase, dict(f, causal=1), causal_kernel=opspec.TORCH_CPU)
        assert causal / full == pytest.approx(fraction, rel=1e-9)


def test_causal_kernel_reaches_only_causal_operators():
    f = {"b": np.array([1.0, 1.0, 2.0]), "l": np.array([1024.0, 2048.0, 2048.0]), "heads": 4.0,
         "head_dim": 64.0, "causal": np.array([1.0, 1.0, 0.0])}
    cpu = opspec.op_flops("flash_attention", "fwd", f, causal_kernel=opspec.TORCH_CPU)
    gpu = opspec.op_flops("flash_attention", "fwd", f)
    np.testing.assert_allclose(cpu / gpu, [0.75 / (9 / 16), 0.625 / (17 / 32), 1.0])
    g = {"m": 1024, "k": 512, "n": 256}
    assert opspec.op_flops("linear1", "fwd", g, causal_kernel=opspec.TORCH_CPU) == opspec.op_flops("linear1", "fwd", g)
    with pytest.raises(ValueError, match="unknown causal kernel"):
        opspec.causal_work_fraction(1024, "tpu")


def test_vectorised_features():
    f = {"m": np.array([1.0, 2.0]), "k": 3.0, "n": 4.0}
    np.testing.assert_allclose(opspec.op_flops("linear3", "fwd", f), [24.0, 48.0])


def test_vocab_padding_matches_the_data_readme():
    assert opspec.vocab_per_rank(50257, 1) == 50304
    assert opspec.vocab_per_rank(50257, 16) == math.ceil(50257 / 2048) * 128 == 3200
    assert opspec.padded_vocab(50257, 16) == 3200 * 16


def test_neox_parameter_counts():
    d = 4096
    assert opspec.neox_layer_params(d, 1) == 12 * d * d + 13 * d
    # norms and RowParallel biases (6d) replicated, the rest split
    assert opspec.neox_layer_params(d, 4) == (12 * d * d + 7 * d) / 4 + 6 * d
    v = opspec.vocab_per_rank(50257, 2)
    middle = opspec.neox_stage_params(d, 3, 2, "middle")
    assert opspec.neox_stage_params(d, 3, 2, "first") == middle + v * d
    assert opspec.neox_stage_params(d, 3, 2, "last") == middle + 2 * d + v * d
    with pytest.raises(ValueError):
        opspec.neox_stage_params(d, 3, 2, "sideways")


def test_ring_volumes():
    s = 1000
    assert opspec.collective_wire_bytes("allreduce", s, 4) == pytest.approx(2 * 3 / 4 * 2 * s)
    assert opspec.collective_wire_bytes("allgather", s, 4) == pytest.approx(3 * 2 * s)
    assert opspec.collective_wire_bytes("p2p", s, 2) == pytest.approx(2 * s)
    assert opspec.collective_wire_bytes("allreduce", s, 1) == 0
    with pytest.raises(ValueError):
        opspec.collective_wire_bytes("alltoall", s, 4)
