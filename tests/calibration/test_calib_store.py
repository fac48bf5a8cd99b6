import multiprocessing
import sqlite3

import pytest

from neox_perf.calibration.store import (COLLECTIVE_PHASE, FORMAT_VERSION, SampleStore,
                                         StoreError)
from neox_perf.calibration.fingerprint import fingerprint_id
from neox_perf.errors import NeoxPerfError

FP = {"kind": "cpu", "device_name": "test CPU", "torch": "x", "torch_threads": 1}


def _store(path):
    store = SampleStore(path)
    dev = store.register_device(FP)
    run = store.register_run("calibrate", device=dev, plan="t")
    return store, dev, run


def test_round_trip_and_rows(tmp_path):
    path = tmp_path / "s.sqlite"
    store, dev, run = _store(path)
    assert store.add_sample("linear1", "fwd", {"m": 8, "k": 16, "n": 24}, 1.5e-3, device=dev,
                            run=run, dtype="fp32", repeats=10, median=1.6e-3, iqr=2e-4,
                            min_seconds=1.5e-3, info={"impl": "x"})
    assert store.add_sample("allreduce", COLLECTIVE_PHASE,
                            {"elements": 1024, "nodes": 1, "gpus_per_node": 2}, 3e-5,
                            device=dev, run=run, dtype="fp32")
    store.close()
    with SampleStore(path) as again:
        [s] = again.samples(op="linear1")
        assert (s.op, s.phase, s.features, s.dtype) == ("linear1", "fwd", {"k": 16, "m": 8, "n": 24}, "fp32")
        assert (s.seconds, s.repeats, s.median, s.iqr, s.min) == (1.5e-3, 10, 1.6e-3, 2e-4, 1.5e-3)
        assert (s.device_id, s.run_id, s.rank, s.stage, s.source) == (dev, run, 0, None, "calibrate")
        assert s.info == {"impl": "x"}
        assert again.device(dev) == FP
        assert len(again.samples()) == 2 and len(again.samples(source="run")) == 0
        rows = again.rows(op="allreduce")
        assert rows[0]["op"] == "allreduce" and rows[0]["phase"] == "comm"
        assert rows[0]["elements"] == 1024 and rows[0]["seconds"] == 3e-5
        mode = sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0]
        assert mode == "wal"


def test_device_ids_are_stable(tmp_path):
    with SampleStore(tmp_path / "s.sqlite") as store:
        a = store.register_device(FP)
        b = store.register_device(dict(reversed(list(FP.items()))))
        c = store.register_device({**FP, "torch_threads": 2})
    assert a == b != c
    assert fingerprint_id(FP) == fingerprint_id(dict(reversed(list(FP.items()))))


def test_unique_key_makes_calibration_resumable(tmp_path):
    store, dev, run = _store(tmp_path / "s.sqlite")
    feats = {"tokens": 64, "d": 32}
    assert store.add_sample("layernorm", "fwd", feats, 1e-4, device=dev, run=run, dtype="fp32")
    # 64 and 64.0 are the same point; a second calibration run still skips it
    run2 = store.register_run("calibrate", device=dev)
    assert store.has_sample("layernorm", "fwd", {"tokens": 64.0, "d": 32}, device=dev, dtype="fp32")
    assert not store.add_sample("layernorm", "fwd", {"d": 32.0, "tokens": 64}, 9e-4,
                                device=dev, run=run2, dtype="fp32")
    # other phase, dtype, device: different points
    assert not store.has_sample("layernorm", "bwd", feats, device=dev, dtype="fp32")
    assert not store.has_sample("layernorm", "fwd", feats, device=dev, dtype="fp16")
    # training-run samples are kept per run and per rank
    job = store.register_run("run", device=dev)
    for rank in (0, 1):
        assert store.add_sample("layernorm", "fwd", feats, 2e-4, device=dev, run=job,
                                dtype="fp32", source="run", rank=rank, stage="first")
    assert not store.add_sample("layernorm", "fwd", feats, 2e-4, device=dev, run=job,
                                dtype="fp32", source="run", rank=1)
    assert [s.seconds for s in store.samples(source="calibrate")] == [1e-4]
    assert len(store.samples(source="run")) == 2
    store.close()


@pytest.mark.parametrize("op, phase, feats, message", [
    ("linear9", "fwd", {"m": 1}, "unknown operator"),
    ("linear1", "step", {"m": 1, "k": 1, "n": 1}, "phases"),
    ("linear1", "fwd", {"m": 1, "k": 1}, "takes features"),
    ("linear1", "fwd", {"m": 1, "k": 1, "n": 1, "x": 2}, "takes features"),
    ("linear1", "fwd", {"m": float("nan"), "k": 1, "n": 1}, "finite"),
    ("allreduce", "fwd", {"elements": 1, "nodes": 1, "gpus_per_node": 2}, "phases"),
])
def test_bad_samples_are_refused(tmp_path, op, phase, feats, message):
    store, dev, run = _store(tmp_path / "s.sqlite")
    with pytest.raises(ValueError, match=message):
        store.add_sample(op, phase, feats, 1e-3, device=dev, run=run, dtype="fp32")
    with pytest.raises(ValueError, match="positive"):
        store.add_sample("layernorm", "fwd", {"tokens": 1, "d": 1}, 0.0, device=dev, run=run, dtype="fp32")
    assert store.count() == 0
    store.close()


def _one_line(exc):
    text = exc.value.line()
    assert "\n" not in text and "Traceback" not in text
    assert isinstance(exc.value, NeoxPerfError)
    return text


def test_non_sqlite_file_is_refused_untouched(tmp_path):
    path = tmp_path / "notes.sqlite"
    path.write_bytes(b"my precious notes\n" * 100)
    with pytest.raises(StoreError) as exc:
        SampleStore(path)
    text = _one_line(exc)
    assert str(path) in text and "not a SQLite file" in text and "fix:" in text
    assert path.read_bytes() == b"my precious notes\n" * 100


def test_foreign_sqlite_is_refused_untouched(tmp_path):
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE customers (name TEXT)")
    conn.execute("INSERT INTO customers VALUES ('ada')")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError) as exc:
        SampleStore(path)
    assert "not a neox-perf sample store" in _one_line(exc)
    conn = sqlite3.connect(path)
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert tables == {"customers"}
    assert conn.execute("SELECT name FROM customers").fetchall() == [("ada",)]


def test_newer_format_is_refused(tmp_path):
    path = tmp_path / "s.sqlite"
    store, dev, run = _store(path)
    store.add_sample("gelu", "fwd", {"tokens": 4, "width": 8}, 1e-5, device=dev, run=run, dtype="fp32")
    store.close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value = ? WHERE key = 'version'", (str(FORMAT_VERSION + 1),))
    conn.commit()
    conn.close()
    with pytest.raises(StoreError) as exc:
        SampleStore(path)
    text = _one_line(exc)
    assert "newer neox-perf" in text and "upgrade" in text
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT COUNT(*) FROM samples").fetchone()[0] == 1


def test_corrupt_store_is_refused_and_kept(tmp_path):
    path = tmp_path / "s.sqlite"
    store, dev, run = _store(path)
    for i in range(300):  # several pages of rows
        store.add_sample("gelu", "fwd", {"tokens": i + 1, "width": 8}, 1e-5, device=dev, run=run,
                         dtype="fp32", info={"pad": "x" * 200})
    store.close()
    raw = bytearray(path.read_bytes())
    page = int.from_bytes(raw[16:18], "big")
    for p in range(1, len(raw) // page):  # scribble over every page but the header page
        raw[p * page + 8: p * page + 64] = b"\xff" * 56
    path.write_bytes(bytes(raw))
    damaged = path.read_bytes()
    with pytest.raises(StoreError) as exc:
        SampleStore(path)
    text = _one_line(exc)
    assert "damaged" in text and str(path) in text
    assert path.read_bytes() == damaged


def test_directory_is_refused(tmp_path):
    with pytest.raises(StoreError) as exc:
        SampleStore(tmp_path)
    assert "directory" in _one_line(exc)


def _writer(path, worker, barrier, n):
    barrier.wait()  # all open the (maybe not yet created) file at the same moment
    with SampleStore(path) as store:
        dev = store.register_device(FP)
        run = store.register_run("run", device=dev)
        for i in range(n):
            store.add_sample("res_add", "fwd", {"tokens": i + 1, "d": 8}, 1e-5 * (i + 1),
                             device=dev, run=run, dtype="fp32", source="run", rank=worker)
            # the same calibration point from every worker: exactly one must survive
            store.add_sample("res_add", "bwd", {"tokens": i + 1, "d": 8}, 1e-5, device=dev,
                             run=run, dtype="fp32", source="calibrate")


def test_concurrent_writers_lose_nothing(tmp_path):
    path = str(tmp_path / "shared.sqlite")
    ctx = multiprocessing.get_context("fork")
    workers, n = 4, 40
    barrier = ctx.Barrier(workers)
    procs = [ctx.Process(target=_writer, args=(path, w, barrier, n)) for w in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * workers
    with SampleStore(path) as store:
        assert store.integrity_check() == "ok"
        run_rows = store.samples(source="run")
        assert len(run_rows) == workers * n
        assert {(s.rank, s.features["tokens"]) for s in run_rows} == \
            {(w, i + 1) for w in range(workers) for i in range(n)}
        assert len(store.samples(source="calibrate")) == n
        assert len(store.devices()) == 1 and len(store.runs()) == workers


def test_collective_phase_matches_the_trainer():
    from neox_perf.predictors.fitting import samples
    assert samples.COLLECTIVE_PHASE == COLLECTIVE_PHASE
