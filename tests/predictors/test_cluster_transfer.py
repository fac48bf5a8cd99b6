"""Transferring a sampled profile to described hardware: identity, direction, collectives."""
import numpy as np
import pytest

from neox_perf.prediction import opspec
from neox_perf.predictors import load_profile
from neox_perf.predictors import transfer
from neox_perf.predictors.transfer import _hops

# Descriptions that restate the bundled sampled profiles' own hardware.
IDENTICAL = {
    "perlmutter-a100-80gb": """\
name: same-as-perlmutter
base: perlmutter-a100-80gb
gpu: A100-SXM4-80GB
gpus_per_node: 4
intra_node_GBps: 300
intra_node_topology: pointtopoint
inter_node_Gbps: 200
nics_per_node: 4
""",
    "vista-gh200": """\
name: same-as-vista
base: vista-gh200
gpu: GH200-96GB
gpus_per_node: 1
inter_node_Gbps: 400
nics_per_node: 1
""",
}


def _desc(tmp_path, text, name="c.yml"):
    path = tmp_path / name
    path.write_text(text)
    return load_profile(str(path))


def _mid(entry):
    return {n: float(np.sqrt(lo * hi)) if lo > 0 else lo for n, (lo, hi) in entry["ranges"].items()}


@pytest.mark.parametrize("base_name", sorted(IDENTICAL))
def test_a_description_equal_to_its_base_predicts_what_the_base_predicts(tmp_path, base_name):
    base = load_profile(base_name)
    same = _desc(tmp_path, IDENTICAL[base_name])
    checked = 0
    for op, phases in base.manifest.to_dict()["operators"].items():
        for phase, entry in phases.items():
            feats = _mid(entry) if "ranges" in entry else _mid(phases["fwd"])
            assert same.predict(op, phase, feats) == base.predict(op, phase, feats)
            many_b = base.predict_many(op, phase, feats)
            np.testing.assert_array_equal(same.predict_many(op, phase, feats).seconds, many_b.seconds)
            checked += 1
    assert checked >= 30
    gpn = base.facts.gpus_per_node
    for kind in opspec.COLLECTIVES:
        for nodes in (1, 2, 3, 8, 64):
            for g in sorted({1, 2, gpn} - {0}):
                if g > gpn or nodes * g == 1:
                    continue
                for elements in (3e6, 5e7, 9e8):
                    a = same.predict_collective(kind, elements, nodes, g)
                    b = base.predict_collective(kind, elements, nodes, g)
                    assert a.seconds == pytest.approx(b.seconds, rel=1e-12), (kind, nodes, g, elements)
                    assert a.extrapolated == b.extrapolated


def test_an_identical_description_gives_the_same_iteration(tmp_path):
    from neox_perf.config import WorldRequest, build, load_files
    from neox_perf.derive import derive
    from neox_perf.prediction.predict import predict
    cfg_path = tmp_path / "m.yml"
    cfg_path.write_text("num_layers: 4\nhidden_size: 2048\nnum_attention_heads: 16\nseq_length: 2048\n"
                        "max_position_embeddings: 2048\ntrain_micro_batch_size_per_gpu: 4\n"
                        "model_parallel_size: 2\npipe_parallel_size: 2\ngradient_accumulation_steps: 4\n"
                        "fp16: {enabled: true}\n")
    cfg, _, _ = build(load_files([str(cfg_path)]), WorldRequest(gpus=16), cluster_gpus_per_node=4)
    derived = derive(cfg, 50257)
    base = predict(cfg, derived, load_profile("perlmutter-a100-80gb")).iteration_seconds
    same = predict(cfg, derived, _desc(tmp_path, IDENTICAL["perlmutter-a100-80gb"])).iteration_seconds
    assert same == pytest.approx(base, rel=1e-12)


LN = ("layernorm", "fwd", {"tokens": 16384, "d": 4096})
GEMM = ("linear3", "fwd", {"m": 16384, "k": 6144, "n": 24576})


def test_less_bandwidth_slows_memory_bound_operators_only():
    base, p40 = load_profile("perlmutter-a100-80gb"), load_profile("perlmutter-a100")
    ln = p40.predict(*LN).seconds / base.predict(*LN).seconds
    gemm = p40.predict(*GEMM).seconds / base.predict(*GEMM).seconds
    assert ln == pytest.approx(2039 / 1555, rel=0.02)  # layernorm moves bytes, almost no FLOPs
    assert 1.0 <= gemm < 1.03  # a large GEMM hardly notices the HBM


def test_fewer_tflops_slow_compute_bound_operators(tmp_path):
    # achievable 499.5 vs 828.6 TFLOP/s (data sheets 756 vs 989: the transfer uses the former)
    text = IDENTICAL["vista-gh200"].replace("GH200-96GB", "H100-PCIe-80GB")
    base, slower = load_profile("vista-gh200"), _desc(tmp_path, text)
    gemm = slower.predict(*GEMM).seconds / base.predict(*GEMM).seconds
    ln = slower.predict(*LN).seconds / base.predict(*LN).seconds
    # mostly the tensor-core ratio, a little of the (halved) bandwidth for its operands
    assert 828.6 / 499.5 < gemm < 1.75
    assert ln == pytest.approx(4000 / 2000, rel=0.02)
    faster = _desc(tmp_path, IDENTICAL["vista-gh200"].replace("GH200-96GB", "B200"), "b200.yml")
    # achievable fp16 1627.6 vs 828.6 TFLOP/s (x1.96; the data sheets say x2.28)
    assert faster.predict(*GEMM).seconds < 0.53 * base.predict(*GEMM).seconds


def test_intensity_between_the_two_bounds_blends_them():
    ratio = transfer.operator_ratio("additive", [1e12, 1e12, 1e6], [1e6, 5e9, 1e12],
                                    load_profile("perlmutter-a100").base_gpu, transfer.gpus.gpu("GH200-96GB"))
    compute, mid, memory = ratio
    # achievable rates (271.2, 828.6), not the data sheets' 312 and 989
    assert compute == pytest.approx(271.2 / 828.6, rel=1e-3) and memory == pytest.approx(2039 / 4000, rel=1e-3)
    assert compute < mid < memory
    roof = transfer.operator_ratio("roofline", [1e12], [5e9], transfer.gpus.gpu("A100-SXM4-80GB"),
                                   transfer.gpus.gpu("GH200-96GB"))
    # compute-bound on the A100 (ridge 133 FLOP/B at 271.2), memory-bound on the GH200 (207)
    assert roof[0] == pytest.approx((5e9 / 4000e9) / (1e12 / 271.2e12))


def test_a_gpu_without_an_achievable_rate_transfers_by_both_data_sheets():
    """L40S has no measured GEMM rate: base and target are both taken at their data-sheet
    peaks (312 -> 362) rather than mixing a measured rate with a data sheet."""
    a100, l40s = transfer.gpus.gpu("A100-SXM4-80GB"), transfer.gpus.gpu("L40S")
    assert l40s.achievable("fp16") is None
    assert transfer.operator_ratio("additive", [1e15], [1.0], a100, l40s)[0] == pytest.approx(312 / 362, rel=1e-6)
    assert transfer.gpus.transfer_rates(a100, l40s)[2] == "data-sheet peak"


DGX = """\
name: eight
base: perlmutter-a100-80gb
gpu: A100-SXM4-80GB
gpus_per_node: 8
intra_node_GBps: 300
intra_node_topology: {topo}
inter_node_Gbps: 800
nics_per_node: {nics}
"""


def test_nvswitch_gives_a_small_group_the_full_per_gpu_bandwidth(tmp_path):
    switch = _desc(tmp_path, DGX.format(topo="nvswitch", nics=8), "s.yml")
    p2p = _desc(tmp_path, DGX.format(topo="pointtopoint", nics=8), "p.yml")
    two_s = switch.predict_collective("allreduce", 5e8, 1, 2).seconds
    two_p = p2p.predict_collective("allreduce", 5e8, 1, 2).seconds
    assert two_p > 4 * two_s  # one of seven peer links against the switch's full rate
    eight = (switch.predict_collective("allreduce", 5e8, 1, 8).seconds,
             p2p.predict_collective("allreduce", 5e8, 1, 8).seconds)
    assert eight[0] == pytest.approx(eight[1], rel=1e-9)  # all links busy either way
    r = switch.predict_collective("allreduce", 5e8, 1, 8)
    assert r.extrapolated and "8 GPUs/node never sampled" in r.reason


def test_groups_crossing_a_node_together_share_its_nics(tmp_path):
    eight_one_nic = _desc(tmp_path, DGX.format(topo="nvswitch", nics=1).replace("800", "200"), "a.yml")
    one_gpu_nodes = _desc(tmp_path, IDENTICAL["vista-gh200"].replace("vista-gh200", "perlmutter-a100-80gb")
                          .replace("GH200-96GB", "A100-SXM4-80GB").replace("400", "200"), "b.yml")
    # a data-parallel group of one rank per node: a node's 8 ranks run 8 such groups at once
    # through its one NIC; with one GPU per node the group has the NIC to itself
    shared = eight_one_nic.predict_collective("allreduce", 5e8, 4, 1).seconds
    alone = one_gpu_nodes.predict_collective("allreduce", 5e8, 4, 1).seconds
    assert shared > 6 * alone
    # eight NICs of the same rate: each group has one to itself again
    eight_nics = _desc(tmp_path, DGX.format(topo="nvswitch", nics=8).replace("800", "1600"), "c.yml")
    assert eight_nics.predict_collective("allreduce", 5e8, 4, 1).seconds == pytest.approx(alone, rel=1e-9)
    # a group holding all 8 ranks of each node drives every NIC, shared with nobody
    assert (eight_nics.predict_collective("allreduce", 5e8, 4, 8).seconds
            < eight_one_nic.predict_collective("allreduce", 5e8, 4, 8).seconds / 6)


def test_large_all_reduces_take_the_tree_and_rings_grow_with_ranks():
    ring = _hops("allreduce", 2, 8)
    assert ring == pytest.approx((2 * 15 * 7 / 16, 2 * 15 * 2 / 16))
    tree = _hops("allreduce", 64, 8)
    assert tree == (14.0, 12.0)  # 2 (gpn - 1) inside, 2 log2(64) across
    assert _hops("allgather", 64, 8)[1] > 60  # all-gather stays a ring
    assert _hops("p2p", 2, 1) == (0.0, 1.0)


def test_a_faster_network_than_the_base_is_faster(tmp_path):
    base = load_profile("perlmutter-a100-80gb")
    fast = _desc(tmp_path, IDENTICAL["perlmutter-a100-80gb"].replace("inter_node_Gbps: 200", "inter_node_Gbps: 800"))
    for kind, nodes, g in (("allreduce", 2, 4), ("allgather", 8, 1), ("p2p", 2, 1)):
        assert fast.predict_collective(kind, 2e8, nodes, g).seconds < base.predict_collective(kind, 2e8, nodes, g).seconds
    # inside a node nothing changed
    assert fast.predict_collective("allreduce", 2e8, 1, 4) == base.predict_collective("allreduce", 2e8, 1, 4)
    assert fast.manifest.transfer["collectives"]["efficiency_source"]["allreduce_inter"].startswith("reference")


def test_a_single_gpu_base_flags_intra_node_collectives(tmp_path):
    p = _desc(tmp_path, DGX.format(topo="nvswitch", nics=8).replace("perlmutter-a100-80gb", "vista-gh200")
              .replace("A100-SXM4-80GB", "GH200-96GB"))
    r = p.predict_collective("allreduce", 1e8, 1, 8)
    assert r.extrapolated and "no intra-node samples on vista-gh200" in r.reason and r.seconds > 0
    with pytest.raises(ValueError, match="8 GPUs per node"):
        p.predict_collective("allreduce", 1e8, 1, 9)
    assert p.predict_collective("allreduce", 1e8, 1, 1).seconds == 0.0


def test_links_scale_the_transfer_time_and_leave_nccl_latency_alone(tmp_path):
    fast = _desc(tmp_path, DGX.format(topo="nvswitch", nics=8), "f.yml")
    slow = _desc(tmp_path, DGX.format(topo="nvswitch", nics=8).replace("intra_node_GBps: 300",
                                                                        "intra_node_GBps: 150"), "s.yml")
    for gpn in (2, 4, 8):
        latency = transfer.link_latency("allreduce", 1, gpn)
        tiny = (fast.predict_collective("allreduce", 1.0, 1, gpn).seconds,
                slow.predict_collective("allreduce", 1.0, 1, gpn).seconds)
        assert tiny[0] == pytest.approx(latency, rel=1e-3) and tiny[1] == pytest.approx(latency, rel=1e-3)
        big = (fast.predict_collective("allreduce", 5e8, 1, gpn).seconds,
               slow.predict_collective("allreduce", 5e8, 1, gpn).seconds)
        assert big[1] / big[0] == pytest.approx(2.0, rel=0.01)
        # 1 MB: latency plus a transfer that halves its rate, so between 1x and 2x
        mb = [p.predict_collective("allreduce", 2 ** 19, 1, gpn).seconds for p in (fast, slow)]
        assert mb[1] - mb[0] == pytest.approx(mb[0] - latency, rel=1e-6)
    # the latency grows with the ring's steps, not with the base's fitted alpha
    base_alpha = transfer.base_links(load_profile("perlmutter-a100-80gb")).alpha_intra["allreduce"]
    assert transfer.link_latency("allreduce", 1, 8) < base_alpha
    assert transfer.link_latency("allreduce", 1, 2) < transfer.link_latency("allreduce", 1, 8)
