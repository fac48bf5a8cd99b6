"""Real 2-process DeepSpeed runs on CPU + gloo with the hook switched on from outside.

- the reference workload as a 2-stage pipeline under the deepspeed launcher, through
  `neox-perf run` alone (the training script is not touched), then `neox-perf report --json`;
- the same launch without the hook: identical losses;
- a plain DeepSpeed script (tests/hooks/mlp_train.py) under torchrun, via the environment
  switch only; once more with a failure injected into the hook.
"""
import glob
import json
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from hook_helpers import HERE, base_env, cli, free_port, run  # noqa: E402
from workload_specs import VOCAB, write_config  # noqa: E402

from neox_perf.profile.manifest import Manifest  # noqa: E402
from neox_perf.profile.sections import Calibration  # noqa: E402
from neox_perf.profile.values import Coverage  # noqa: E402

ITERS = 12
WINDOWS = "skip=3,warmup=1,active=2,every=4,repeat=2"  # warm-up 3, 7; recorded 4-5, 8-9
MODULE = "neox_perf.calibration.workload.train"
MLP = str(HERE / "mlp_train.py")


def _cluster():
    from neox_perf.predictors.profile import list_profiles
    names = [p.name for p in list_profiles()]
    return "perlmutter-a100" if "perlmutter-a100" in names else (names[0] if names else None)


def _pp2_command(workdir, port):
    cfg = write_config(workdir / "pp2.yml", pipe_parallel_size=2, model_parallel_size=1,
                       gradient_clipping=0.0)
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_nodes", "1",
            "--num_gpus", "2", "--master_port", str(port), "--module", MODULE,
            "--config", cfg, "--iters", str(ITERS), "--vocab-size", str(VOCAB),
            "--out", str(workdir / "out.json")]


def _shm_left(port):
    """DeepSpeed's per-rank CPU comm buffers still in /dev/shm for the launch on ``port``."""
    from neox_perf.calibration.launch import shm_buffer_path
    return sorted(glob.glob(shm_buffer_path(port)))


def _hooked_pp2(workdir):
    run_dir = workdir / "run"
    cluster = _cluster()
    extra = ["--cluster", cluster] if cluster else []
    port = free_port()
    proc = cli(["run", "--run-dir", str(run_dir), "--windows", WINDOWS, *extra, "--",
                *_pp2_command(workdir, port)], cwd=workdir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    shm_left = _shm_left(port)
    rep = cli(["report", str(run_dir), "--json", *extra], cwd=workdir)
    assert rep.returncode == 0, rep.stderr[-3000:]
    return {"proc": proc, "run_dir": run_dir, "cluster": cluster, "shm_left": shm_left,
            "out": json.loads((workdir / "out.json").read_text()), "report": json.loads(rep.stdout)}


def _plain_pp2(workdir):
    port = free_port()
    proc = run(_pp2_command(workdir, port), base_env(), workdir)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return {"proc": proc, "out": json.loads((workdir / "out.json").read_text()),
            "shm_left": _shm_left(port)}


def _mlp(inject=None):
    def make(workdir):
        from neox_perf.hooks import settings
        run_dir = workdir / "run"
        env = base_env(**settings.environment(str(run_dir), windows=WINDOWS))
        if inject:
            env[settings.INJECT] = inject
        proc = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                    "--master_port", str(free_port()), MLP, "--iters", str(ITERS)], env, workdir)
        assert proc.returncode == 0, proc.stderr[-5000:]
        losses = [json.loads(line[len("LOSSES "):]) for line in proc.stdout.splitlines()
                  if line.startswith("LOSSES ")]
        return {"proc": proc, "run_dir": run_dir, "losses": losses[0]}
    return make


@pytest.fixture(scope="module")
def hooked(runs):
    return runs("pp2-hooked", _hooked_pp2)


def test_pipeline_run_is_timed_on_every_rank(hooked):
    from neox_perf.runs.files import read_rank_summaries
    from neox_perf.runs.files import read_iterations
    ranks = read_rank_summaries(str(hooked["run_dir"]))
    assert [s["rank"] for s in ranks] == [0, 1]
    assert [s["facts"]["stage"] for s in ranks] == [0, 1]
    for s in ranks:
        assert s["finished"] and s["disabled"] is None
        assert s["facts"]["engine"] == "PipelineEngine" and s["facts"]["micro_batches"] == 2
        its = read_iterations(str(hooked["run_dir"] / f"rank-{s['rank']:05d}.iterations.jsonl"))
        assert [i for i, _, _ in its] == list(range(ITERS))
        assert all(sec > 0 for _, sec, _ in its)
        # the live-bytes window (2), the profiling windows and the iteration after each
        assert [i for i, _, p in its if p] == [2] + list(range(3, 11))
        assert s["config"]["source"] == "reference workload command line"
        assert s["window_iterations"] == 4


def test_operator_samples_of_both_stages_are_in_the_store(hooked):
    from neox_perf.calibration.store import SampleStore
    from neox_perf.runs.files import store_files
    stores = store_files(str(hooked["run_dir"]))
    assert len(stores) == 1  # one node
    with SampleStore(stores[0]) as store:
        samples = store.samples(source="run")
    by_stage = {}
    for s in samples:
        by_stage.setdefault(s.stage, set()).add((s.op, s.phase))
    assert set(by_stage) == {"first", "last"}
    assert {s.rank for s in samples} == {0, 1}
    assert {("embedding", "fwd"), ("linear1", "bwd"), ("qk", "fwd"), ("p2p", "comm")} <= by_stage["first"]
    assert {("linear_final", "fwd"), ("cross_entropy", "bwd"), ("optimizer", "step")} <= by_stage["last"]
    linear1 = [s for s in samples if s.op == "linear1" and s.phase == "fwd"]
    assert {tuple(sorted(s.features.items())) for s in linear1} == {(("k", 64), ("m", 64), ("n", 192))}
    assert all(s.seconds > 0 and s.repeats == 8 for s in linear1)  # 2 layers x 2 mb x 2 iters


# The report's JSON contract: renaming or removing one of these bumps the schema version.
REPORT_KEYS = {"schema", "neox_perf_version", "command", "exit_code", "run_dir", "launch_command",
               "launch_exit_code", "layout", "config", "cluster", "iteration", "components",
               "operators", "unmapped", "prediction", "samples", "notes", "profile_warnings"}


def test_report_predicted_vs_measured(hooked):
    r = hooked["report"]
    assert r["schema"] == "neox-perf/report/v1" and r["exit_code"] == 0
    assert REPORT_KEYS <= set(r)
    assert {"measured", "predicted", "error_min", "error_median", "interval_seconds"} <= set(r["iteration"])
    assert r["layout"]["engine"] == "PipelineEngine" and r["layout"]["stages"] == 2
    m = r["iteration"]["measured"]
    assert m["count"] == ITERS and m["used"] == 2  # 1 and 11 (2: the live-bytes window)
    assert 0 < m["min"] <= m["median"]
    # the hook accounts for its own time at iteration boundaries between windows: there, and
    # small -- its own CPU work under a millisecond per iteration (~0.1-0.3 ms on this 2-core
    # box), so at most 1% of a step of 100 ms or more; this toy pipeline's step is ~18 ms, where
    # that share would sit at the bound, so it is held to 5%. The wall clock of the same
    # moments counts the scheduler's too: two ranks on two cores under CI once put 3.1 ms
    # there (a mean of 3 iterations), so it is held only to lie inside the iteration
    hook = m["hook_overhead"]
    assert 0 < hook["per_iteration_cpu_seconds"] < 1e-3 and 0 < hook["cpu_share"] < 0.05
    # each rank reads its CPU clock inside its wall clock's reads, so its hook CPU time can
    # never exceed its hook wall time (the costliest ranks of each may differ)
    for rank in m["per_rank"]:
        assert 0 < rank["hook_cpu_seconds"] <= rank["hook_seconds"], rank
    assert hook["per_iteration_cpu_seconds"] <= hook["per_iteration_seconds"]
    assert 0 < hook["per_iteration_seconds"] and 0 < hook["share"] < 1
    comp = {c["name"]: c for c in r["components"]}
    for name in ("stage 0 forward (per micro-batch)", "stage 1 backward (per micro-batch)",
                 "optimizer", "pp_p2p"):
        assert comp[name]["measured"] > 0, name
    # a CPU rank's phases are measured outside the profiling windows: the median of each
    # phase's wall time over the iterations the iteration table uses (1 and 11; 2 is the
    # live-bytes window's)
    from neox_perf.runs.files import read_iteration_phases
    for stage in (0, 1):
        rows = {i: ph for i, _, ph in
                read_iteration_phases(str(hooked["run_dir"] / f"rank-{stage:05d}.iterations.jsonl"))}
        assert sorted(rows) == [0, 1, 11]
        fwd = (rows[1]["forward"] + rows[11]["forward"]) / 2 / 2  # median of 2; 2 micro-batches
        assert comp[f"stage {stage} forward (per micro-batch)"]["measured"] == pytest.approx(fwd)
    assert any("outside the profiling windows" in n for n in r["notes"])
    assert r["operators"] and r["samples"]["count"] > 20
    if hooked["cluster"]:
        assert r["cluster"] == hooked["cluster"]
        assert r["iteration"]["predicted"] > 0 and r["iteration"]["error_median"] is not None
        lo, hi = r["iteration"]["interval_seconds"]  # the bundled profile carries residuals
        assert lo < r["iteration"]["predicted"] < hi
        assert comp["stage 1 forward (per micro-batch)"]["predicted"] > 0
        assert any(o["predicted"] for o in r["operators"])
    # `neox-perf run` printed the same report when the launch ended
    out = " ".join(hooked["proc"].stdout.split())  # rich wraps at the terminal width
    assert "Iteration time" in out and "Components" in out and "exit code 0" in out
    assert "the hook's own time between profiling windows" in out


def test_memory_of_both_stages_against_the_prediction(hooked):
    """The hook's live-bytes window (the third iteration, outside the profiling windows) on
    both stages of the workload's pipeline: the peak and what was live at it, against check's
    prediction for the same config on this device (test_pipeline_run_is_timed_on_every_rank:
    the window's iteration is left out of the timings like a profiled one)."""
    rows = hooked["report"]["memory"]
    assert [r["stage"] for r in rows] == [0, 1]
    for r in rows:
        assert abs(r["error"]) <= 0.03, r
        assert r["tracker"]["iteration"] == 2 and r["tracker"]["iteration_seconds"] > 0
        comps = {c["component"]: c for c in r["components"]}
        assert comps["activations"]["measured"] > 0 and abs(comps["activations"]["error"]) <= 0.05
    logits = {c["component"]: c for c in rows[1]["components"]}["logits"]
    assert logits["measured"] > 0 and abs(logits["error"]) <= 0.05  # the last stage's slots


def test_same_seed_same_losses_with_and_without_the_hook(hooked, runs):
    plain = runs("pp2-plain", _plain_pp2)
    assert len(hooked["out"]["losses"]) == ITERS
    assert hooked["out"]["losses"] == plain["out"]["losses"]


def test_plain_deepspeed_script(runs):
    r = runs("mlp-hooked", _mlp())
    err = r["proc"].stderr
    assert "neox-perf: no cluster profile" in err  # rank 0 at start, nothing to predict with
    assert "Iteration time" in err  # rank 0's report at exit (the env switch alone)
    rep = cli(["report", str(r["run_dir"]), "--json", "--top", "40"], cwd=r["run_dir"])
    data = json.loads(rep.stdout)
    assert data["layout"]["engine"] == "DeepSpeedEngine" and data["layout"]["dp"] == 2
    assert data["iteration"]["measured"]["min"] > 0
    from neox_perf.runs.files import read_rank_summaries
    found = {o["op"] for s in read_rank_summaries(str(r["run_dir"])) for o in s["ops"]}
    assert {"layernorm", "linear3", "gelu", "linear4", "cross_entropy", "optimizer",
            "allreduce"} <= found
    unmapped = {u["name"]: u["reason"] for u in data["unmapped"]}
    assert "GEMM 8x32x10: matches no layer width" in unmapped["aten::linear"]  # the 10-way head
    assert data["config"]["source"] is None and "PYTHON_NEOX_PERF_CONFIG" in data["config"]["why"]


def test_a_cpu_run_gives_back_deepspeeds_shared_memory(hooked, runs):
    """Under DeepSpeed's launcher, its CPU comm op maps a ~66 MB /dev/shm buffer per rank and
    never unlinks it (the plain launch leaves both); each hooked rank unlinks its own as it ends."""
    assert len(runs("pp2-plain", _plain_pp2)["shm_left"]) == 2
    assert hooked["shm_left"] == []


def test_a_failure_inside_the_hook_is_logged_once_and_training_goes_on(runs):
    ok = runs("mlp-hooked", _mlp())
    broken = runs("mlp-injected", _mlp("sample_writer"))
    assert broken["losses"] == ok["losses"]
    lines = [line for line in broken["proc"].stderr.splitlines() if "hook disabled" in line]
    assert len(lines) == 2 and all(line.startswith("neox-perf: rank ") for line in lines)
    assert "injected failure in the sample writer" in lines[0]
    log = (broken["run_dir"] / "errors.log").read_text()
    assert log.count("hook disabled") == 2
    from neox_perf.runs.files import read_rank_summaries
    assert all("sample writer" in s["disabled"] for s in read_rank_summaries(str(broken["run_dir"])))


def test_report_of_a_missing_run_dir_is_one_line(tmp_path):
    proc = cli(["report", str(tmp_path / "nope")], cwd=tmp_path)
    assert proc.returncode == 1  # a data error, as a missing config is (issue 32)
    assert proc.stderr.strip().startswith("neox-perf:") and len(proc.stderr.strip().splitlines()) == 1


class _FlatProfile:
    """A stand-in cluster profile: every operator call 10 us, every collective 20 us."""

    name = "flat-test"
    path = "flat-test"
    base = None
    collective_dtype = "fp16"
    # timed on the run's own machine in the run's element type (as a CPU calibration is): no
    # precision to convert, no GPU row to cap at
    manifest = Manifest("flat-test", calibration=Calibration(dtype="fp32", device="cpu"))

    class facts:
        gpus_per_node = 8
        gpu_name = "test GPU"

    class _P:
        def __init__(self, s):
            self.seconds, self.extrapolated, self.reason = s, False, ""

    def predict(self, op, phase, features):
        return self._P(1e-5)

    def predict_collective(self, kind, elements, nodes, gpus_per_node):
        return self._P(0.0 if nodes * gpus_per_node == 1 else 2e-5)

    def coverage(self, op, phase, features):
        return Coverage("in range", 1.0, "")


def test_prediction_is_rebuilt_offline_from_the_recorded_config(hooked):
    from neox_perf.runs.report import build
    r = build(str(hooked["run_dir"]), profile=_FlatProfile())
    assert r["cluster"] == "flat-test"
    comp = {c["name"]: c for c in r["components"]}
    # stage 0: embedding + 2 layers; every op 10 us per call
    fwd0 = comp["stage 0 forward (per micro-batch)"]
    assert fwd0["predicted"] > 0 and fwd0["measured"] > 0
    assert fwd0["error"] == pytest.approx((fwd0["predicted"] - fwd0["measured"]) / fwd0["measured"])
    assert r["iteration"]["predicted"] > 0
    assert all(o["predicted"] == pytest.approx(1e-5) for o in r["operators"]
               if o["op"] not in ("p2p", "allreduce", "allgather"))
    # the recorded ops and the decomposition agree on the layer shapes
    assert {o["op"] for o in r["operators"]} and r["prediction"]["profile"] == "flat-test"


def test_recalibrated_profile_predicts_the_run_it_came_from(hooked, tmp_path):
    if not hooked["cluster"]:
        pytest.skip("no bundled cluster profile")
    from neox_perf.calibration.store import SampleStore
    from neox_perf.runs import prediction
    from neox_perf.runs.recalibrate import recalibrate_from_run
    from neox_perf.runs.files import store_files
    from neox_perf.predictors.profile import load_profile
    out = recalibrate_from_run(str(hooked["run_dir"]), hooked["cluster"], str(tmp_path / "cpu-run"))
    assert out["factors"]["linear1/fwd"]["calls"] >= 8
    new = load_profile(str(tmp_path / "cpu-run"))
    assert new.name == "cpu-run" and new.manifest.provenance.recalibrated["from_profile"]
    with SampleStore(store_files(str(hooked["run_dir"]))[0]) as store:
        lin = [s for s in store.samples(source="run") if (s.op, s.phase) == ("linear1", "fwd")]
    before = [s.median / prediction.predict_call(load_profile(hooked["cluster"]), s.op, s.phase,
                                                 s.features, s.dtype)[0] for s in lin]
    after = [s.median / prediction.predict_call(new, s.op, s.phase, s.features, s.dtype)[0]
             for s in lin]
    # one sample per rank: the factor is their weighted median, so one lands exactly, and the
    # others keep their ratio to it (a level, not a reshaping: how far the ranks of a shared
    # 2-core machine differ is theirs, not the correction's)
    assert min(abs(r - 1) for r in after) < 1e-9
    assert max(after) / min(after) == pytest.approx(max(before) / min(before), rel=1e-9)
    assert min(before) > 5.0  # A100 samples on a CPU run: every call far slower than predicted
