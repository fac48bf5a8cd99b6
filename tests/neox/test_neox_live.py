"""GPT-NeoX's own deepy.py + train.py under the hook, one run per layout (live: needs a
checkout, see conftest). What NeoX built is checked against what the hook predicts, the
trace against the decomposition, the memory against check's per-stage prediction."""
import json
import os

import pytest

from neox_perf.testing import neox_cpu

WINDOWS = "skip=3,warmup=1,active=2,every=100000,repeat=1"
MAPPED_SHARE = 0.95
_runs = {}


def _run(name, neox, work, hook=True):
    key = (name, hook)
    if key not in _runs:
        hook_dir = os.path.join(work, "runs", name) if hook else None
        _runs[key] = neox_cpu.run_layout(neox_cpu.LAYOUTS[name], work, src=neox,
                                         hook_dir=hook_dir, windows=WINDOWS, iters=8)
    run = _runs[key]
    if not run.ok and "No module named" in run.log:
        pytest.skip("GPT-NeoX present but not importable by NEOX_PERF_NEOX_PYTHON: "
                    + [ln for ln in run.log.splitlines() if "No module named" in ln][-1])
    assert run.ok, run.tail()
    return run


def _summaries(run):
    out = []
    for f in sorted(os.listdir(run.run_dir)):
        if f.startswith("rank-") and f.endswith(".json"):
            with open(os.path.join(run.run_dir, f)) as fh:
                out.append(json.load(fh))
    return out


@pytest.mark.parametrize("name", sorted(neox_cpu.LAYOUTS))
def test_neox_layout_under_the_hook(name, neox, neox_work):
    from neox_perf.hooks.memory import compare
    from neox_perf.runs import prediction
    from neox_perf.runs import report
    run = _run(name, neox, neox_work)
    lay = run.layout
    losses = [float.fromhex(h) for h in run.loss_series()]
    assert len(losses) == lay.iters and losses[-1] < losses[0]  # it trains
    ranks = _summaries(run)
    assert len(ranks) == lay.gpus and all(not s.get("disabled") for s in ranks)
    # the configuration the hook predicts is what NeoX built
    rec = ranks[0]["config"]
    assert rec["source"].startswith("GPT-NeoX")
    cfg, derived, notes = prediction.rebuild(rec, ranks[0]["facts"])
    assert derived.params.neox_logged == run.logged_params, notes
    assert derived.padded_vocab == 512
    assert (cfg.parallel.pipe_parallel_size, cfg.parallel.model_parallel_size,
            cfg.parallel.data_parallel_size) == (lay.pp, lay.mp, lay.dp)
    if lay.pp >= 1:
        assert ranks[0]["facts"]["parts"] == list(derived.parts)
        if run.partition:
            assert run.partition == list(derived.parts)
    for s in ranks:
        st = derived.stages[s["facts"]["stage"] or 0]
        assert s["facts"]["params"] == st.params_per_rank  # DeepSpeed's partition, per rank
    # >= 95% of forward+backward time maps to the decomposition's operators on every rank
    rep = report.build(run.run_dir)
    cov = {c["rank"]: c["fraction"] for c in rep["coverage"]}
    assert len(cov) == lay.gpus and min(cov.values()) >= MAPPED_SHARE, (cov, rep["unmapped"])
    ops = {o["op"] for s in ranks for o in s["ops"]}
    assert {"linear1", "linear2", "linear3", "linear4", "qk", "av", "softmax", "gelu",
            "layernorm"} <= ops
    assert ("rope" in ops) == (lay.pos_emb == "rotary")
    if lay.mp > 1 or lay.dp > 1:
        assert "allreduce" in ops
    # memory: the persistent state is what check predicts for the stage, per component
    assert len(run.memory) == lay.gpus
    for mem in run.memory:
        rows = {r["component"]: r for r in compare(mem, derived.stages[mem["stage"]].memory)}
        for comp in ("weights", "master_weights", "optimizer_states"):  # exact, ZeRO-1 included
            assert rows[comp]["measured"] == rows[comp]["predicted"], rows
        assert mem["peak_bytes"] and mem["peak_bytes"] >= rows["persistent"]["measured"]


def test_loss_is_bit_identical_with_and_without_the_hook(neox, neox_work):
    hooked = _run("pp1", neox, neox_work, hook=True)
    plain = _run("pp1", neox, neox_work, hook=False)
    assert hooked.loss_series() == plain.loss_series()
    assert all(len(set(per_rank.values())) == 1 for per_rank in hooked.losses.values())


def test_report_reads_neox_own_training_log(neox, neox_work, tmp_path):
    """A plain NeoX run (no hook): `report LOG --config` reads NeoX's own log lines, and NeoX's
    logged "approx flops per GPU" is what neox_log computes at the logged iteration time."""
    import contextlib
    import io
    import statistics
    from neox_perf.cli import main
    plain = _run("pp1", neox, neox_work, hook=False)
    log = tmp_path / "train.log"
    log.write_text(plain.log)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["report", str(log), "--config", plain.config, "--cluster", "perlmutter-a100",
                     "--json"])
    assert code == 0
    r = json.loads(out.getvalue())
    assert r["world_size"] == neox_cpu.LAYOUTS["pp1"].gpus  # from the arguments NeoX printed
    used = plain.iteration_ms[1:]
    assert r["logged"]["intervals"] == len(plain.iteration_ms) and r["logged"]["used"] == len(used)
    assert r["measured"]["median_seconds"] * 1000 == pytest.approx(statistics.median(used))
    assert len(used) % 2 == 1  # the median is one logged interval: its flops are NeoX's own figure
    from neox_perf.config import WorldRequest, build, load_files
    from neox_perf.neox_log import units
    cfg, _, _ = build(load_files([plain.config]), WorldRequest(gpus=r["world_size"]))
    ours = units(cfg, 512, r["measured"]["median_seconds"]).approx_flops_per_gpu  # CharLevel: 512
    assert r["measured"]["approx_flops_per_gpu"] == pytest.approx(ours, rel=6e-3)  # NeoX prints 3-4 digits
