"""The engine calibration's own processes: DeepSpeed engines per shape in lockstep (then as one ZeRO-1
data-parallel group), and the in-training tensor-parallel all-reduce under torchrun. Real runs, on
tiny shapes."""
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from neox_perf.calibration import engine  # noqa: E402
from neox_perf.calibration.engine import run_engine  # noqa: E402
from neox_perf.calibration.tp_allreduce import run_tp_benchmark  # noqa: E402

# two heads: they split over the tensor-parallel pass's group of two
TINY_SHAPE = (128, 32, 1, "layernorm", "global", 256)


def test_engine_worker_measures_and_resumes(tmp_path):
    path = tmp_path / "engine.json"
    seen = []
    # two processes in lockstep, as calibrate runs them for two "GPUs"
    info = run_engine(path, "cpu", progress=lambda *a: seen.append(a), shapes=(TINY_SHAPE,), nproc=2)
    assert info == {"shapes": 1, "already_stored": 0, "measured": 1, "processes": 2,
                    "zero": {"stage": 1, "already_stored": 0, "measured": 1},
                    "tp": {"size": 2, "shapes": 1, "already_stored": 0, "measured": 1}}
    row = next(iter(json.loads(path.read_text())["shapes"].values()))
    assert row["precision"] == "fp32" and row["layers"] == 2 and row["tensors"] == 2 * 12 + 1 + 2 + 1
    for key in ("forward", "layer_forward", "backward", "layer_backward", "step", "flatten", "accumulate"):
        assert row[key] > 0, key
    assert row["layer_forward"] < row["forward"] and row["layer_backward"] < row["backward"]
    assert seen[-1][0] == seen[-1][1] == 3 * engine.ENGINE_SWEEPS  # each pass's shape, each sweep
    assert json.loads(path.read_text())["processes"] == 2
    # the ZeRO pass: the two processes were one data-parallel group of a ZeRO-1 engine
    zero = next(iter(json.loads(path.read_text())["zero"].values()))
    assert zero["processes"] == 2 and zero["zero_stage"] == 1 and zero["params"] == row["params"]
    assert zero["allreduce_elements"] == row["params"]
    assert 0 <= zero["partition"] - row["params"] / 2 < 64 and zero["allgather_elements"] == zero["partition"]
    for key in ("reduce", "allreduce", "step", "allgather"):
        assert zero[key] > 0, key
    for key in ("allreduce", "allgather"):  # the collectives' median repeat, their fastest beside it
        assert 0 < zero[f"{key}_best"] <= zero[key], key
    # the tensor-parallel pass: the two processes one mp 2 group, each holding half the layers'
    # weights, the layers' all-reduces inside them and timed apart too
    tp = next(iter(json.loads(path.read_text())["tp"].values()))
    assert tp["model_parallel_size"] == 2 and tp["processes"] == 2 and tp["keys"]["model_parallel_size"] == 2
    assert row["params"] / 2 < tp["params"] < row["params"]  # norms and biases stay whole
    for key in ("forward", "layer_forward", "backward", "layer_backward", "allreduce_forward",
                "allreduce_backward"):
        assert tp[key] > 0, key
    # every sweep's repeats pooled, the row's statistics over all of them
    assert tp["sweeps"] == row["sweeps"] == zero["sweeps"] == engine.ENGINE_SWEEPS
    assert len(tp["repeats"]) == engine.ENGINE_SWEEPS * engine.TP_REPEATS
    assert len(row["repeats"]) == len(zero["repeats"]) == engine.ENGINE_SWEEPS * engine.ENGINE_REPEATS
    assert row["layer_forward"] == min(r["layer_forward"] for r in row["repeats"])
    # the plain pass's peers side by side, per repeat: their mean forward + backward, and the
    # slowest's lead over it; peer 0's own lies within that lead of the mean
    assert "arrival" not in row and "busy" not in row
    for r in row["repeats"]:
        assert r["arrival"] >= 0 and r["busy"] > 0
        assert abs(r["forward"] + r["backward"] - r["busy"]) <= r["arrival"] + 1e-12
    assert not any("arrival" in r for r in zero["repeats"] + tp["repeats"])
    # the machine's speed before each shape-sweep: the calibration's reference read by peer 0
    # (profile/one_speed.py brings each sweep's repeats to one speed with it)
    data = json.loads(path.read_text())
    assert data["reference"]["dtype"] == "fp32" and data["reference"]["loops"] >= 1
    for r in (row, zero, tp):
        assert len(r["speeds"]) == engine.ENGINE_SWEEPS and all(0 < s < 0.1 for s in r["speeds"])
    again = run_engine(path, "cpu", shapes=(TINY_SHAPE,), nproc=2)
    assert again["measured"] == 0 and again["zero"]["measured"] == 0 and again["tp"]["measured"] == 0


def test_the_tensor_parallel_pass_takes_the_shapes_whose_heads_split():
    assert engine.tp_splits(TINY_SHAPE) and all(engine.tp_splits(s) for s in engine.ENGINE_SHAPES)
    assert not engine.tp_splits((64, 32, 1, "layernorm", "global", 256))  # one head
    assert not engine.tp_splits((192, 32, 1, "layernorm", "global", 256))  # three heads


def test_tensor_parallel_allreduce_in_training(tmp_path):
    path = tmp_path / "tp.json"
    assert run_tp_benchmark(path, 2, "cpu") == {"sizes": 5}
    data = json.loads(path.read_text())
    assert data["processes"] == 2 and len(data["mean"]) == len(data["elements"])
    assert all(m > 0 and med > 0 for m, med in zip(data["mean"], data["median"]))
    assert run_tp_benchmark(tmp_path / "x.json", 1, "cpu") == {"skipped": "one process"}


def test_a_port_taken_before_the_rendezvous_is_retried(monkeypatch, tmp_path):
    """free_port() can lose its port to another process before the rendezvous binds it: the
    pass is launched again on new ports (it resumes past what it stored), and only for that."""
    from neox_perf.calibration import engine
    calls = []

    def once(path, device, nproc, extra, measured, zero, last, mp=1):
        calls.append(last)
        if len(calls) == 1:
            raise engine._PortTaken(2)  # two shapes stored before the clash
        return 3
    monkeypatch.setattr(engine, "_run_peers_once", once)
    assert engine._run_peers(tmp_path / "e.json", "cpu", 2, [], None, zero=0) == 5
    assert calls == [False, False]
    calls.clear()

    def always(path, device, nproc, extra, measured, zero, last, mp=1):
        calls.append(last)
        if last:
            raise engine.CalibrationFailed("engine calibration failed: EADDRINUSE")
        raise engine._PortTaken(0)
    monkeypatch.setattr(engine, "_run_peers_once", always)
    with pytest.raises(engine.CalibrationFailed, match="EADDRINUSE"):
        engine._run_peers(tmp_path / "e.json", "cpu", 2, [], None, zero=0)
    assert calls == [False, False, True]  # three attempts, the last one reports


def test_a_shape_is_measured_in_sweeps_the_second_reversed():
    """Each shape's repeats come from ENGINE_SWEEPS sweeps over the shapes, every other one in
    reverse, so no shape's repeats all share one stretch of the machine's state; a resumed pass
    measures only the sweeps its file lacks (a row from before sweeps counts as complete)."""
    a, b, c = ((128 * k, 32, 1, "layernorm", "global", 256) for k in (1, 2, 3))
    label = lambda s: engine.engine_label(s, engine.ENGINE_DEPTHS[0])
    plan = engine.sweep_plan((a, b, c), {})
    assert engine.ENGINE_SWEEPS == 2 and [(k, s) for k, s, _ in plan] == \
        [(0, a), (0, b), (0, c), (1, c), (1, b), (1, a)]
    # killed after the first sweep of a and b: their second sweeps and c's two are left
    resumed = engine.sweep_plan((a, b, c), {label(a): 1, label(b): 1})
    assert [(k, s) for k, s, _ in resumed] == [(0, c), (1, c), (1, b), (1, a)]
    assert engine.sweeps_done(None) == 0 and engine.sweeps_done({"repeats": []}) == engine.ENGINE_SWEEPS
    assert engine.sweep_plan((a,), {label(a): engine.sweeps_done({"repeats": []})}) == []


def test_a_second_sweep_pools_its_repeats_into_the_row():
    first = {"forward": 0.9, "accumulate": 0.1, "params": 10, "sweeps": 1,
             "repeats": [{"forward": 0.9, "accumulate": 0.2}, {"forward": 1.0, "accumulate": 0.1}]}
    second = {"forward": 0.7, "accumulate": 0.3, "params": 10,
              "repeats": [{"forward": 0.7, "accumulate": 0.3}, {"forward": 0.8, "accumulate": 0.4}]}
    row = engine.pooled(first, second, zero=False)
    assert row["sweeps"] == 2 and len(row["repeats"]) == 4
    assert row["forward"] == 0.7 and row["accumulate"] == 0.1  # the fastest over both sweeps
    zero_a = {"sweeps": 1, "repeats": [{"reduce": 1.0, "allreduce": 0.5, "step": 1.0, "allgather": 0.2}]}
    zero_b = {"repeats": [{"reduce": 0.8, "allreduce": 0.9, "step": 0.9, "allgather": 0.4},
                          {"reduce": 0.9, "allreduce": 0.7, "step": 1.1, "allgather": 0.3}]}
    z = engine.pooled(zero_a, zero_b, zero=True)
    assert z["reduce"] == 0.8 and z["allreduce"] == 0.7 and z["allreduce_best"] == 0.5  # median, fastest


def test_the_peers_repeats_give_each_repeat_its_slowest_peers_lead():
    rows = [{"forward": 1.0, "backward": 2.0}, {"forward": 1.5, "backward": 2.5}]
    engine.peer_arrivals(rows, [[3.0, 4.0], [3.3, 3.6]])
    assert rows[0]["busy"] == pytest.approx(3.15) and rows[0]["arrival"] == pytest.approx(0.15)
    assert rows[1]["busy"] == pytest.approx(3.8) and rows[1]["arrival"] == pytest.approx(0.2)
    # not a phase: the row keeps no fastest of them, and a sweep stored before them pools
    old = {"sweeps": 1, "forward": 0.9, "repeats": [{"forward": 0.9, "backward": 2.1}]}
    row = engine.pooled(old, {"forward": 1.0, "repeats": rows}, zero=False)
    assert row["forward"] == 0.9 and "arrival" not in row and len(row["repeats"]) == 3


def test_the_barrier_gathers_every_peers_values_on_peer_zero():
    import threading

    from neox_perf.calibration.launch import free_port
    port, got = free_port(), {}

    def peer(i):
        b = engine._Barrier(i, 2, port)
        b()
        got[i] = b.gather([i + 0.5, i + 1.5])
        b.close()
    threads = [threading.Thread(target=peer, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == {0: [[0.5, 1.5], [1.5, 2.5]], 1: None}
    assert engine._Barrier(0, 1, 0).gather([1.0]) == [[1.0]]  # one process: its own


def _swept(rows_by_shape, keys=("forward", "backward")):
    """An engine file's pass from per-shape (sweep 1 totals, sweep 2 totals)."""
    out = {}
    for i, (one, two) in enumerate(rows_by_shape):
        repeats = [{keys[0]: t / 2, keys[1]: t / 2} for t in (*one, *two)]
        out[f"shape {i}"] = {"sweeps": 2, "repeats": repeats}
    return out


def test_a_pass_whose_second_sweep_ran_slow_is_found():
    """The machine slowing for a whole sweep moves every shape's second half the same way: that
    pass is named, with its shift; shapes that scatter both ways, or a shift under the limit, are
    not (the tensor-parallel pass of 2026-12-02's first calibration shifted +11.4%)."""
    import math
    slow = [((1.0, 1.02, 0.98), ((1.14, 1.15, 1.16)[k % 3],) * 3) for k in range(6)]
    scattered = [((1.0, 1.0, 1.0), ((1.3,) * 3 if k % 2 else (0.75,) * 3)) for k in range(6)]
    small = [((1.0, 1.0, 1.0), (1.04, 1.04, 1.04)) for _ in range(6)]
    data = {"tp": _swept(slow), "shapes": _swept(scattered),
            "zero": _swept(small, keys=("reduce", "step"))}
    shifts = engine.sweep_shifts(data)
    assert abs(shifts["tp"]["shift"] - math.log(1.15)) < 1e-9 and shifts["tp"]["shapes"] == 6
    assert abs(shifts["zero"]["shift"] - math.log(1.04)) < 1e-9
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "engine.json"
        path.write_text(json.dumps(data))
        found = engine.sweep_findings(path)
        assert len(found) == 1 and found[0].startswith("its tensor-parallel pass ran +15% in its second sweep")
        assert engine.sweep_findings(Path(tmp) / "missing.json") == []
    # one sweep (a store from before the sweeps): nothing to compare
    assert engine.sweep_shifts({"tp": {k: {**v, "sweeps": 1} for k, v in _swept(slow).items()}}) == {}


def test_engine_sweeps_prints_each_pass_and_the_sign_over_files(tmp_path, capsys, benchmark_script):
    """benchmarks/engine_sweeps.py: what the sweep rule reads, per pass and file, and over the
    files how many second sweeps ran slower (one sign every time is not a random slow stretch)."""
    slow = [((1.0, 1.02, 0.98), (1.15, 1.15, 1.15)) for _ in range(6)]
    fast = [((1.0, 1.0, 1.0), (0.97, 0.97, 0.97)) for _ in range(6)]  # under the limit
    paths = []
    for name, rows in (("a", slow), ("b", fast)):
        path = tmp_path / f"{name}.engine.json"
        path.write_text(json.dumps({"tp": _swept(rows)}))
        paths.append(str(path))
    assert benchmark_script("engine_sweeps").main([*paths, "--shapes"]) == 0
    out = capsys.readouterr().out
    assert "tensor-parallel pass: second sweep +15.0% against the first over 6 shapes" in out
    assert "flagged" in out.split(paths[1])[0] and "flagged" not in out.split(paths[1])[1].split("over the files")[0]
    assert "second sweep slower in 1 of 2" in out
    assert out.count("shape 0") == 2  # --shapes: each file's shapes
    bad = tmp_path / "bad.json"
    for text in ("{", "[1, 2]"):  # not JSON; JSON but not an engine file
        bad.write_text(text)
        assert benchmark_script("engine_sweeps").main([str(bad)]) == 1
        assert "not an engine file" in capsys.readouterr().err


def test_engine_sweeps_levels_tell_a_pass_level_from_a_sweep_level(tmp_path, capsys, benchmark_script):
    """--levels: three files whose two sweeps agree while the files sit 20% apart print every
    file's sweeps at its own level, sweeps 0% apart, and a file's spread equal to a sweep's --
    the mark of a level set once per pass, not sweep by sweep."""
    paths = []
    for name, level in (("a", 0.9), ("b", 1.0), ("c", 1.1)):
        rows = [((level * k,) * 3, (level * k,) * 3) for k in (1, 2, 3, 4)]
        path = tmp_path / f"{name}.engine.json"
        path.write_text(json.dumps({"tp": _swept(rows)}))
        paths.append(str(path))
    assert benchmark_script("engine_sweeps").main([*paths, "--levels"]) == 0
    out = capsys.readouterr().out.split("levels across the files")[1]
    assert "tensor-parallel pass, over 4 shapes" in out and "plain pass" not in out
    assert f"{paths[0]}: sweeps -10.0% -10.0%, apart  +0.0%" in out
    assert f"{paths[2]}: sweeps +10.0% +10.0%, apart  +0.0%" in out
    spread = out.split("spread: ")[1]
    sweep, file = (float(spread.split(name)[1].split("%")[0]) for name in ("a sweep ", "sweeps' mean) "))
    assert sweep == file > 8 and "two sweeps apart 0.0% in the median" in spread
