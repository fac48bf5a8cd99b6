import os
import socket

import pytest

torch = pytest.importorskip("torch")

from neox_perf.calibration.fingerprint import fingerprint, fingerprint_id  # noqa: E402
from neox_perf.calibration.sweep import pick_threads, pinned_threads  # noqa: E402


def test_cpu_fingerprint_is_stable_and_anonymous():
    with pinned_threads(1):
        a, b = fingerprint("cpu"), fingerprint("cpu")
        assert a == b and fingerprint_id(a) == fingerprint_id(b) and len(fingerprint_id(a)) == 16
        assert a["kind"] == "cpu" and a["device_name"] and a["torch"] == torch.__version__
        assert a["torch_threads"] == 1 and a["omp_num_threads"] == "1"
        assert "nccl" not in a  # only with CUDA
        assert socket.gethostname() not in str(a.values())
    with pinned_threads(2):
        assert fingerprint_id(fingerprint("cpu")) != fingerprint_id(a)


def test_thread_pinning_is_restored(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    with pinned_threads(2):
        assert torch.get_num_threads() == 2 and os.environ["OMP_NUM_THREADS"] == "2"
    assert torch.get_num_threads() == before and os.environ["OMP_NUM_THREADS"] == "1"
    assert pick_threads(None, "cpu") == 1 and pick_threads(3, "cpu") == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert pick_threads(None, "cpu") == 1 and pick_threads(None, "cuda") is None
    with pytest.raises(ValueError):
        pick_threads(0, "cpu")
