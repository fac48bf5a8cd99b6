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
    assert seen[-1][0] == seen[-1][1] == 3
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
    assert len(tp["repeats"]) == engine.TP_REPEATS and len(row["repeats"]) == engine.ENGINE_REPEATS
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
