"""Sample reading, validation and the handling of each known data defect (synthetic CSVs)."""
import numpy as np
import pytest

from neox_perf.predictors.fitting import cleaning
from neox_perf.predictors.errors import SampleFileError
from neox_perf.profile.facts import ClusterFacts, Link
from neox_perf.predictors.fitting.samples import load_cluster, read_csv

import predictors_synthetic as syn

FACTS = ClusterFacts(name="fake", gpu_name="Fake GPU", gpu_memory_bytes=80 << 30, gpus_per_node=4,
                     intra_node_link=Link("fake-link", 300.0, 12), inter_node_link=Link("fake-net", 25.0, 4),
                     peak_fp16_tflops=312.0, hbm_bandwidth_gbps=2000.0)


def _reasons(records, name, phase):
    rec = next(r for r in records if r.path.name == name)
    return rec, dict(rec.dropped.get(phase, {}))


@pytest.mark.parametrize("content, fragment", [
    ("", "empty file"),
    ("mp,b,l,dim,F_dur(us),B_dur(us)\n", "header only"),
    ("mp,b,seq,dim,F_dur(us),B_dur(us)\n1,2,1024,2048,10,20\n", "unexpected header"),
    ("mp,b,l,dim,F_dur(us),B_dur(us)\n1,2,1024,2048,fast,20\n", "'fast' is not a number"),
    ("mp,b,l,dim,F_dur(us),B_dur(us)\n1,2,1024,2048,10\n", "5 fields"),
])
def test_corrupt_file_raises_one_line_naming_the_file(tmp_path, content, fragment):
    path = tmp_path / "operator" / f"{syn.GPU}_linear1_fp16.csv"
    path.parent.mkdir()
    (tmp_path / "nccl").mkdir()
    path.write_text(content)
    with pytest.raises(SampleFileError) as info:
        load_cluster(tmp_path)
    message = str(info.value)
    assert "\n" not in message
    assert path.name in message and fragment in message


def test_binary_garbage_is_a_clear_error(tmp_path):
    path = tmp_path / "x.csv"
    path.write_bytes(b"\xff\xfe\x00garbage\x81")
    with pytest.raises(SampleFileError, match="x.csv"):
        read_csv(path, ("a",))


def test_not_a_samples_folder(tmp_path):
    with pytest.raises(SampleFileError, match="expected operator/ and nccl/"):
        load_cluster(tmp_path)


def test_nccl_rows_must_match_the_file_name(tmp_path):
    syn.write_nccl(tmp_path, "allreduce", "allreduce", 2, 1)
    path = tmp_path / "nccl" / f"{syn.GPU}_allreduce_fp16_2_1.csv"
    text = path.read_text().splitlines()
    text[3] = text[3].replace(",2,1,", ",4,1,")
    path.write_text("\n".join(text) + "\n")
    (tmp_path / "operator").mkdir()
    with pytest.raises(SampleFileError, match=r"_2_1.csv:4: .*file name says 2_1"):
        load_cluster(tmp_path)


def test_invalid_values_are_dropped_and_reported(tmp_path):
    def mutate(cols, times):
        times[0][0] = np.nan
        times[1][1] = -5.0
        cols["dim"][2] = 0.0

    syn.write_operator(tmp_path, "linear1", mutate=mutate)
    (tmp_path / "nccl").mkdir()
    sets, records = load_cluster(tmp_path)
    cleaning.clean(sets, records, FACTS)
    rec, fwd = _reasons(records, f"{syn.GPU}_linear1_fp16.csv", "fwd")
    _, bwd = _reasons(records, f"{syn.GPU}_linear1_fp16.csv", "bwd")
    assert fwd["non-finite or non-positive shape or duration"] == 2  # nan time, zero dim
    assert bwd["non-finite or non-positive shape or duration"] == 2  # negative time, zero dim
    assert rec.kept["fwd"] == rec.rows - 2


def test_flash_backward_implausibly_fast_is_rejected_and_derived(tmp_path):
    def mutate(cols, times):
        times[1][:] = 0.11 * times[0]  # Vista: bwd/fwd ~ 0.11 where the FLOPs say 2.5

    syn.write_operator(tmp_path, "flash_atten", mutate=mutate)
    (tmp_path / "nccl").mkdir()
    sets, records = load_cluster(tmp_path)
    result = cleaning.clean(sets, records, FACTS)
    derived = result.derived[("flash_attention", "bwd")]
    assert derived.source_phase == "fwd" and derived.scale == "flop_ratio"
    assert ("flash_attention", "bwd") not in result.sets
    _, bwd = _reasons(records, f"{syn.GPU}_flash_atten_fp16.csv", "bwd")
    assert sum(bwd.values()) == len(sets[("flash_attention", "bwd")])
    assert all(reason.startswith("whole set not used") for reason in bwd)


def test_plausible_flash_backward_is_kept(tmp_path):
    syn.write_operator(tmp_path, "flash_atten")
    (tmp_path / "nccl").mkdir()
    sets, records = load_cluster(tmp_path)
    result = cleaning.clean(sets, records, FACTS)
    assert ("flash_attention", "bwd") in result.sets and not result.derived


def test_copied_backward_column_is_derived_from_forward(tmp_path):
    def mutate(cols, times):
        times[1][:] = times[0]

    syn.write_operator(tmp_path, "res_add", mutate=mutate)
    (tmp_path / "nccl").mkdir()
    sets, records = load_cluster(tmp_path)
    result = cleaning.clean(sets, records, FACTS)
    assert result.derived[("res_add", "bwd")].scale == "same"


def test_gross_optimizer_outliers_are_dropped(tmp_path):
    def mutate(cols, times):
        times[0][:5] = 3e7  # 30 s among milliseconds (Vista firstStage_optimizer)

    syn.write_operator(tmp_path, "firstStage_optimizer", mutate=mutate)
    (tmp_path / "nccl").mkdir()
    sets, records = load_cluster(tmp_path)
    result = cleaning.clean(sets, records, FACTS)
    rec, step = _reasons(records, f"{syn.GPU}_firstStage_optimizer_fp16.csv", "step")
    assert sum(n for r, n in step.items() if "outlier" in r) == 5
    assert len(result.sets[("optimizer", "step")]) == rec.rows - 5
    assert result.sets[("optimizer", "step")].seconds.max() < 1.0


def test_isolated_spike_dropped_but_regime_change_kept(tmp_path):
    def mutate(cols, times):
        slow = cols["l"] >= 3072
        times[0][slow] *= 2.0  # a whole region departs from the baseline: structure
        times[0][5] *= 3.0  # one row far from its neighbours: outlier

    syn.write_operator(tmp_path, "linear1", mutate=mutate)
    (tmp_path / "nccl").mkdir()
    sets, records = load_cluster(tmp_path)
    cleaning.clean(sets, records, FACTS)
    _, fwd = _reasons(records, f"{syn.GPU}_linear1_fp16.csv", "fwd")
    assert sum(fwd.values()) == 1
    assert any("nearest samples" in r for r in fwd)


def test_allgather_rows_faster_than_the_link_are_dropped(tmp_path):
    def mutate(elements, t):
        t[10:20] = 117.4  # "117 us" for hundreds of MB across nodes

    syn.write_nccl(tmp_path, "allgather_large", "allgather", 4, 1, mutate=mutate)
    (tmp_path / "operator").mkdir()
    sets, records = load_cluster(tmp_path)
    result = cleaning.clean(sets, records, FACTS)
    _, comm = _reasons(records, f"{syn.GPU}_allgather_large_fp16_4_1.csv", "comm")
    assert comm == {"bus bandwidth above 1.1x the link": 10}
    assert result.sets[("allgather", "comm")].seconds.min() > 1e-3


def test_union_files_are_checked_not_double_counted(tmp_path):
    a = syn.write_nccl(tmp_path, "allreduce", "allreduce", 1, 2)
    b = syn.write_nccl(tmp_path, "allreduce", "allreduce", 2, 1)
    union = tmp_path / "nccl" / f"{syn.GPU}_allreduce_fp16.csv"
    lines_a, lines_b = a.read_text().splitlines(), b.read_text().splitlines()
    union.write_text("\n".join(lines_a + lines_b[1:]) + "\n")
    (tmp_path / "operator").mkdir()
    sets, records = load_cluster(tmp_path)
    assert len(sets[("allreduce", "comm")]) == len(lines_a) + len(lines_b) - 2
    rec = next(r for r in records if r.path == union)
    assert rec.skipped.startswith("union of the per-topology files")

    union.write_text("\n".join(lines_a) + "\n")
    _, records = load_cluster(tmp_path)
    rec = next(r for r in records if r.path == union)
    assert "differs" in rec.skipped


def test_summary_and_unknown_files_are_recorded_as_skipped(tmp_path):
    syn.write_csv(tmp_path / "operator" / f"{syn.GPU}.csv", ["GPU", "Function"], [("x", "y")])
    syn.write_csv(tmp_path / "operator" / f"{syn.GPU}_teleport_fp16.csv", ["a"], [(1.0,)])
    (tmp_path / "nccl").mkdir()
    sets, records = load_cluster(tmp_path)
    assert not sets
    reasons = {r.path.name: r.skipped for r in records}
    assert "summary" in reasons[f"{syn.GPU}.csv"]
    assert "not in the neox-perf vocabulary" in reasons[f"{syn.GPU}_teleport_fp16.csv"]


def test_invalid_optimizer_shapes_are_dropped_not_crashing(tmp_path):
    def mutate(cols, times):
        cols["dim"][0] = np.nan
        cols["encoders"][1] = -3

    syn.write_operator(tmp_path, "middleStage_optimizer", mutate=mutate)
    (tmp_path / "nccl").mkdir()
    sets, records = load_cluster(tmp_path)
    cleaning.clean(sets, records, FACTS)
    _, step = _reasons(records, f"{syn.GPU}_middleStage_optimizer_fp16.csv", "step")
    assert step == {"non-finite or non-positive shape or duration": 2}
