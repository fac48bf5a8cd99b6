"""benchmarks/gpu_check.py: its --dry-run walks every step on the CPU (a tiny calibration with the
engine and the fit, a real DeepSpeed run predicted four ways, memory, the hook's overhead), and
the parts that only a GPU exercises are checked on stand-ins."""
import json
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def gpu_check(benchmark_script):
    return benchmark_script("gpu_check")


def test_missing_libraries_are_named_in_one_line_before_anything_runs(gpu_check, monkeypatch,
                                                                        tmp_path, capsys):
    assert gpu_check.missing({"json": "json", "no_such_module_x": "nsm-dist",
                              "no_such_pkg_y.sub": "y-dist"}) == ["nsm-dist", "y-dist"]
    monkeypatch.setattr(gpu_check, "NEEDS", {**gpu_check.NEEDS, "no_such_module_x": "deepspeed-x"})
    assert gpu_check.main(["--out", str(tmp_path / "o"), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "deepspeed-x" in err and "docs/gpu-check.md" in err
    assert not (tmp_path / "o" / "gpu_check.json").exists()


def test_without_a_gpu_the_real_check_refuses_in_one_line(gpu_check, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available() or gpu_check.missing():
        pytest.skip("a GPU is here, or a library is missing")
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "CUDA GPU" in err and "--dry-run" in err


def test_the_default_configs_are_one_gpu_neox_configs_the_workload_runs(gpu_check):
    from neox_perf.commands.validate import predict
    from neox_perf.prediction.predict import load_cluster
    mod = gpu_check
    assert 2 <= len(mod.CONFIGS) <= 3
    profile = load_cluster("perlmutter-a100-80gb")
    layouts = set()
    for config in mod.CONFIGS:
        p = predict([str(config)], 1, profile, None, "cuda")  # the workload's own refusals run here
        par = p.cfg.parallel
        assert (par.model_parallel_size, par.data_parallel_size) == (1, 1)
        assert p.precision in ("fp16", "bfloat16") and 0 < p.estimate.iteration_seconds < 1.0
        layouts.add((par.pipe_parallel_size, p.cfg.model.uses_flash, p.cfg.training.checkpoint_activations))
    assert len(layouts) == len(mod.CONFIGS)  # each config shows something the others do not


def test_the_transfer_description_names_the_detected_gpu(gpu_check, tmp_path):
    from neox_perf.prediction.predict import load_cluster
    from neox_perf.predictors import gpus
    h100 = gpu_check.gpu_row({"gpu": "NVIDIA H100 80GB HBM3"}, dry_run=False)
    assert h100.name == "H100-SXM5-80GB"
    assert gpu_check.gpu_row({}, dry_run=False) is None
    ways = gpu_check.prediction_ways(h100, tmp_path)
    assert list(ways) == ["fresh", "a100-transferred", "a100-as-is", "dgx-h100"]
    profile = load_cluster(ways["a100-transferred"])
    assert profile.facts.gpus_per_node == 1 and gpus.find_gpu(profile.facts.gpu_name).name == "H100-SXM5-80GB"
    a100 = gpu_check.gpu_row({"gpu": "NVIDIA A100-SXM4-80GB"}, dry_run=False)
    assert "dgx-h100" not in gpu_check.prediction_ways(a100, tmp_path)
    # the sized quick plan: every operator kept, within its budget on the GPU's rates
    plan, sizing = gpu_check.sized_quick_plan(h100, 60.0, 0.05)
    assert sizing["stride"] > 1 and sizing["estimated_seconds"] <= 60.0
    assert sizing["points_kept"] == len(plan.points) < sizing["points_in_quick"]
    assert plan.sweeps == 1  # the lent GPU's minutes buy points, not a second sweep
    whole, why = gpu_check.sized_quick_plan(None, 60.0, 0.05)  # a GPU the table does not know
    assert why["stride"] == 1 and len(whole.points) == why["points_in_quick"] and "whole" in why["why"]


def test_gpu_memory_readings_are_reported_beside_the_prediction(gpu_check):
    """What only a GPU run fills in: the allocator's peaks, nvidia-smi's used memory, the
    device terms; the workload's share of nvidia-smi is the peak less what was used before."""
    row = {"stage": 0, "predicted": 6 << 30, "measured": 5 << 30, "error": 0.2, "moment": "m",
           "predicted_moment": "p", "components": [], "device_total": 7 << 30,
           "device_terms": {"CUDA context": 512 << 20},
           "cuda": {"max_allocated": 5 << 30, "max_reserved": 6 << 30}, "tracker": {}}
    v = types.SimpleNamespace(memory=[row])
    (m,) = gpu_check.memory_summary(v, {"peak_bytes": 8 << 30}, 1 << 30)
    assert (m["max_memory_allocated"], m["max_memory_reserved"]) == (5 << 30, 6 << 30)
    assert m["nvidia_smi_workload"] == 7 << 30 and m["predicted_device_total"] == 7 << 30
    report = {"dry_run": False, "finished": "now", "seconds": 300.0, "budget_s": 480.0,
              "exit_code": 0, "steps": [{"step": "machine", "status": "ok", "seconds": 1.0, "why": None}],
              "machine": {"gpu": "NVIDIA H100 80GB HBM3", "gpu_memory_bytes": 80 << 30,
                          "tf32": {"fp32_matmuls_as_tf32": False, "why": "default"}},
              "runs": [{"label": "a", "iterations": 30, "measured_seconds": 0.1,
                        "predicted": {"fresh": {"seconds": 0.11, "error": 0.1,
                                                "interval_seconds": [0.09, 0.12], "measured_inside": True},
                                      "dgx-h100": {"error_line": "boom"}},
                        "memory": [m]}],
              "overhead": {"device": "cuda", "timer": "torch.cuda.Event (GPU clock)",
                           "plain_median_s": 0.01, "hooked_median_s": 0.0101, "overhead": 0.01,
                           "plain_iqr": 0.02, "machinery_s": 3e-5, "machinery_share": 0.003,
                           "loss": {"micro_batches": 20, "identical": True, "max_abs_difference": 0.0}}}
    text = gpu_check.markdown(report)
    assert "| a | 30 | 0.1000 | 0.1100 (+10.0%, [0.0900, 0.1200] holds it) | failed: boom |" in text
    assert "| a s0 | 6,144.0 | 5,120.0 (+20.0%) | 5,120.0 | 6,144.0 | 7,168.0 | 7,168.0 |" in text
    assert "torch.cuda.Event" in text


def test_dry_run_walks_every_step_on_the_cpu(gpu_check, tmp_path):
    for lib in ("torch", "deepspeed", "sklearn", "xgboost"):
        pytest.importorskip(lib)
    out = tmp_path / "out"
    config = str(REPO / "benchmarks" / "gpu_check" / "a-pp1-fp16-flash-layernorm.yml")
    import os
    env, cwd = dict(os.environ), os.getcwd()
    # the budget is the device's 8 minutes; here every step must run, and on a busy CPU box
    # calibrate's watched steps may each wait for a quiet spell (step_watch.QUIET_WAIT_S) first
    code = gpu_check.main(["--out", str(out), "--dry-run", "--work", str(tmp_path / "work"),
                           "--budget-s", "3600", config])
    assert dict(os.environ) == env and os.getcwd() == cwd  # NEOX_PERF_HOME etc. were its own
    files = sorted(p.name for p in out.iterdir())
    assert files == ["gpu_check.json", "gpu_check.md"]
    assert all((out / f).stat().st_size < 16 << 20 for f in files)
    report = json.loads((out / "gpu_check.json").read_text())
    steps = {s["step"]: s for s in report["steps"]}
    assert list(steps) == ["machine", "calibrate", "run a-pp1-fp16-flash-layernorm", "host", "overhead"]
    assert all(s["status"] == "ok" for s in steps.values()), steps
    assert code == 0 and report["exit_code"] == 0
    assert report["machine"]["tf32"]["fp32_matmuls_as_tf32"] is False
    cal = report["calibrate"]
    assert cal["points_measured"] == cal["points_total"] > 0 and cal["fit_rows"] > 0
    assert set(cal["seconds"]) == {"operators", "collectives", "engine", "fit"}
    assert cal["engine"]["measured"] == 1  # the tiny engine shape
    (run,) = report["runs"]
    assert run["iterations"] == 3 and run["measured_seconds"] > 0
    assert set(run["predicted"]) == {"fresh", "a100-transferred", "a100-as-is", "dgx-h100"}
    for way, p in run["predicted"].items():
        assert p["seconds"] > 0 and p["error"] == pytest.approx(p["seconds"] / run["measured_seconds"] - 1), way
    # the A100's interval is widened on another GPU: the transferred one is the wider
    a, t = run["predicted"]["a100-as-is"], run["predicted"]["a100-transferred"]
    assert (t["interval_seconds"][1] / t["interval_seconds"][0]
            > a["interval_seconds"][1] / a["interval_seconds"][0])
    (mem,) = run["memory"]
    # the live-bytes tracker against check's prediction: the CPU stand-in agrees within 5%
    assert mem["live_tracker_peak"] > 0 and abs(mem["live_tracker_error"]) < 0.05
    assert mem["max_memory_allocated"] is None and mem["predicted_device_terms"] == {}  # no GPU
    # the host step: no CUDA here, the CPU at both sizes, each a cost per call of the same 44
    host = report["host"]
    assert set(host) == {"cpu 64,4,32", "cpu 8,1,4"}
    assert all(r["median_per_call_s"] > 0 and r["calls_per_layer"] == 44 for r in host.values())
    ov = report["overhead"]
    assert ov["device"] == "cpu" and len(ov["plain"]) == len(ov["hooked"]) > 0
    assert ov["loss"]["identical"] is True and ov["loss"]["micro_batches"] > 0
    md = (out / "gpu_check.md").read_text()
    assert "--dry-run" in md and "## Hook overhead" in md and "## Host time per framework call" in md
    assert (tmp_path / "work" / "profile" / "manifest.json").is_file()
