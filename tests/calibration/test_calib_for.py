"""`calibrate --for CONFIG`: the plan gains every shape the config runs, and only what is missing."""
from pathlib import Path

import pytest

from neox_perf.calibration.plan import (leading_feature, load_plan,
                                        with_targets)
from neox_perf.cli import build_parser
from neox_perf.commands.calibrate import config_targets

VALIDATION = Path(__file__).resolve().parents[2] / "benchmarks" / "validation"
MP2 = VALIDATION / "pp1-mp2-flash.yml"          # mp 2, untied, flash, 4 layers
PP2 = VALIDATION / "pp2-untied-layernorm.yml"   # two pipeline stages


def _decomp(config, gpus):
    from neox_perf.config import WorldRequest, build, load_files
    from neox_perf.derive import derive
    from neox_perf.prediction.operators import decompose
    from neox_perf.prediction.predict import stage_shapes
    cfg, _, _ = build(load_files([str(config)]), WorldRequest(gpus=gpus))
    derived = derive(cfg, 50257, None)
    return decompose(cfg, derived.padded_vocab, stage_shapes(derived))


def _calls(decomp):
    for st in decomp.stages:
        yield from (*st.layer_forward, *st.layer_backward, *st.forward, *st.backward, st.optimizer)


def test_targets_cover_every_call_and_collective_of_the_config():
    points, sizes = config_targets([str(MP2)], 2)
    have = {(p.op, p.phase, p.features) for p in points}
    decomp = _decomp(MP2, 2)
    ops = [c for c in _calls(decomp) if not hasattr(c, "elements")]
    assert {c.op for c in ops} >= {"linear_final", "cross_entropy", "flash_attention", "optimizer"}
    for call in ops:
        feats = tuple(sorted((k, float(round(v))) for k, v in call.features))
        assert (call.op, call.phase, feats) in have, call
        lead = leading_feature(call.op)
        for factor in (0.5, 2):  # the neighbourhood on the leading size feature
            moved = dict(feats)
            moved[lead] = float(round(moved[lead] * factor))
            assert (call.op, call.phase, tuple(sorted(moved.items()))) in have
    # tensor-parallel all-reduce of b*s*d elements, as the decomposition counts it
    tokens_d = 2 * 256 * 768
    assert tokens_d in sizes["allreduce"]


def test_pipeline_config_adds_p2p_and_a_second_config_only_adds_what_is_missing():
    plan = load_plan("quick")
    points1, colls1 = config_targets([str(MP2)], 2)
    first = with_targets(plan, points1, colls1)
    assert first.points[:len(plan.points)] == plan.points  # resumed runs keep the plan's order
    assert len(set(first.points)) == len(first.points)
    again = with_targets(first, points1, colls1)
    assert again.points == first.points  # nothing new the second time
    points2, colls2 = config_targets([str(PP2)], 2)
    assert "p2p" in colls2
    second = with_targets(first, points2, colls2)
    added = set(second.points) - set(first.points)
    assert added and added <= set(points2)
    assert added.isdisjoint(first.points)


def test_quick_plan_already_holds_shapes_it_samples():
    plan = load_plan("quick")
    one = plan.points[0]
    assert with_targets(plan, [one], {}).points == plan.points


def test_cli_parses_for_and_gpus():
    args = build_parser().parse_args(["calibrate", "--cluster", "x", "--quick", "--for", str(MP2),
                                      str(PP2), "--gpus", "4"])
    assert args.for_configs == [str(MP2), str(PP2)] and args.gpus == 4 and args.quick


def test_bad_config_is_one_line(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text("{num_layers: 4, hidden_size: 100, num_attention_heads: 3, seq_length: 64}")
    from neox_perf.errors import NeoxPerfError
    with pytest.raises(NeoxPerfError) as err:
        config_targets([str(bad)], 1)
    assert "bad.yml" in str(err.value) and "\n" not in str(err.value)


TINY_FOR_PLAN = """
name: tiny-for
protocol: {warmup: 0, repeats: 2, min_seconds: 0.03, max_repeats: 100000}
defaults: {mp: 1, b: 1, l: [16, 32], d: [32, 64], h: 2, vocab: 256}
ops:
  linear1: {}
  layernorm: {}
  optimizer: {params: [1000, 4000]}
"""

TINY_CONFIG = """{
  "pipe_parallel_size": 1, "model_parallel_size": 1, "num_layers": 2, "hidden_size": 64,
  "num_attention_heads": 2, "seq_length": 32, "max_position_embeddings": 32,
  "pos_emb": "learned", "norm": "layernorm", "no_weight_tying": true,
  "tokenizer_type": "CharLevelTokenizer", "train_micro_batch_size_per_gpu": 1,
  "gradient_accumulation_steps": 1, "precision": "fp16", "fp16": {"enabled": true},
  "optimizer": {"type": "Adam", "params": {"lr": 0.0006}},
}"""


def test_for_resumes_after_sigkill_and_samples_each_point_once(tmp_path, monkeypatch, sigkill_once):
    """SIGKILL `calibrate --for` mid-way; the same command again measures only what is
    missing, and every targeted shape ends up in the store exactly once."""
    import json
    import sqlite3
    import subprocess
    import sys

    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    from neox_perf.calibration.store import SampleStore
    monkeypatch.setenv("NEOX_PERF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    plan, config = tmp_path / "plan.yml", tmp_path / "tiny.yml"
    plan.write_text(TINY_FOR_PLAN)
    config.write_text(TINY_CONFIG)
    store, out = tmp_path / "s.sqlite", tmp_path / "profile"
    cmd = [sys.executable, "-m", "neox_perf.cli", "calibrate", "--cluster", "tiny", "--plan", str(plan),
           "--for", str(config), "--gpus", "1", "--store", str(store), "--out", str(out),
           "--nproc", "1", "--no-engine", "--json"]
    total = len(with_targets(load_plan(str(plan)), *config_targets([str(config)], 1)).points)

    def count():
        try:
            conn = sqlite3.connect(store)
            try:
                return conn.execute("SELECT COUNT(*) FROM samples").fetchone()[0]
            finally:
                conn.close()
        except sqlite3.OperationalError:  # schema not there yet
            return 0

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sigkill_once(proc, lambda: store.exists() and count() >= 12, 300.0)
    before = count()
    assert 12 <= before < total, "killed too late to test a resume"
    # what the killed run's disturbance watch marked (a busy moment on a shared box does it)
    # is measured again on resume, not kept (tests/calibration/test_disturbance.py)
    conn = sqlite3.connect(store)
    try:
        flagged = conn.execute("SELECT COUNT(*) FROM samples WHERE source='calibrate' AND "
                               "info LIKE '%\"disturbed\"%'").fetchone()[0]
    finally:
        conn.close()
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    ops = json.loads(rerun.stdout)["operators"]
    assert ops["points"] == total
    assert ops["already_stored"] == before - flagged
    assert ops["remeasured"] <= flagged
    assert ops["already_stored"] + ops["remeasured"] + ops["measured"] + len(ops["failed"]) == total
    with SampleStore(store) as s:
        keys = [(x.op, x.phase, tuple(sorted(x.features.items()))) for x in s.samples()]
    assert len(keys) == len(set(keys)) == count()
    # a second run with the same config finds everything stored
    third = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert third.returncode == 0, third.stderr
    assert json.loads(third.stdout)["operators"]["measured"] == 0
    # the local trainer marks its profile for efficiency-curve extrapolation
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["extrapolation"] == "efficiency-curve"
    assert "efficiency" in manifest["operators"]["linear1"]["fwd"]
