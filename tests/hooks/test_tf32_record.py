"""The hook records whether the run's fp32 matmuls ran as TF32 (torch.backends.cuda.matmul.
allow_tf32, TORCH_ALLOW_TF32_CUBLAS_OVERRIDE, NVIDIA_TF32_OVERRIDE; nothing on a CPU), and
`report` prices the run with what it had, saying so where `check` assumed otherwise."""
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from neox_perf.calibration.fingerprint import tf32_state
from neox_perf.config import load_files
from neox_perf.hooks import engine_facts
from neox_perf.predictors.profile import load_profile
from neox_perf.runs import prediction

EXAMPLES = Path(__file__).resolve().parents[2] / "neox_perf" / "examples"


@pytest.fixture
def flags(monkeypatch):
    """Set the flags a CUDA process would read: (allow_tf32, float32 matmul precision, env)."""
    def set_(allow=False, precision="highest", override=None, nvidia=None):
        monkeypatch.setattr(torch.backends.cuda, "matmul", SimpleNamespace(allow_tf32=allow))
        monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: precision)
        for name, value in (("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", override), ("NVIDIA_TF32_OVERRIDE", nvidia)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
    return set_


def test_what_a_cuda_process_had(flags):
    flags()
    assert tf32_state("cuda", (8, 0))["tf32"] is False  # PyTorch's default since 1.12
    flags(override="1")  # NVIDIA's PyTorch containers
    state = tf32_state("cuda", (9, 0))
    assert state["tf32"] is True and state["tf32_flags"]["TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"] == "1"
    flags(allow=True)
    assert tf32_state("cuda", (8, 0))["tf32"] is True
    flags(precision="high")  # torch.set_float32_matmul_precision("high")
    assert tf32_state("cuda", (8, 0))["tf32"] is True
    flags(allow=True, nvidia="0")  # cuBLAS turns TF32 off whatever the framework asks
    assert tf32_state("cuda", (8, 0))["tf32"] is False
    flags(allow=True)
    assert tf32_state("cuda", (7, 0))["tf32"] is False  # a V100 has no TF32


def test_a_cpu_has_no_tf32(flags):
    flags(allow=True, override="1")
    assert tf32_state("cpu") == {"tf32": None, "tf32_flags": "TF32 does not apply on cpu"}
    missing = []
    assert engine_facts.tf32("cpu", missing)["tf32"] is None and not missing


def test_the_engine_facts_read_the_device(flags, monkeypatch):
    flags(override="1")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    missing = []
    got = engine_facts.tf32("cuda", missing)
    assert got["tf32"] is True and got["tf32_flags"]["capability"] == "9.0" and not missing


def _record():
    raw = load_files([str(EXAMPLES / "llemma-7b.yml")])
    values = dict(raw.values, fp16={"enabled": False}, bf16={"enabled": False})
    return {"values": values, "files": list(raw.files), "vocab": 50277}


def _facts(tf32):
    return {"world_size": 16, "local_world_size": 8, "dtype": "fp32", "device_type": "cuda", "tf32": tf32,
            "tf32_flags": {"allow_tf32": tf32, "float32_matmul_precision": "highest",
                           "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": None, "NVIDIA_TF32_OVERRIDE": None}}


def test_report_prices_the_run_as_it_ran():
    dgx = load_profile(str(EXAMPLES / "clusters" / "dgx-a100.yml"))  # says nothing: the default
    ieee, tf32 = prediction.predict(_record(), _facts(False), dgx), prediction.predict(_record(), _facts(True), dgx)
    assert ieee["fp32_matmuls"]["matmuls"] == "ieee_fp32" and ieee["fp32_matmuls"]["known"]
    assert ieee["fp32_matmuls"]["source"].startswith("the run: torch.backends.cuda.matmul.allow_tf32 False")
    assert tf32["fp32_matmuls"]["matmuls"] == "tf32"
    assert ieee["iteration_seconds"] > 2 * tf32["iteration_seconds"]
    # one line where the run differs from what check assumes on that cluster, none where it agrees
    differs = [n for n in ieee["notes"] if n.startswith("TF32:")]
    assert len(differs) == 1 and "the run had fp32 matmuls as IEEE fp32" in differs[0]
    assert "priced here as the run had them" in differs[0]
    assert not [n for n in tf32["notes"] if n.startswith("TF32:")]
    # a run that recorded nothing (an older hook): the cluster's pricing, as check has it
    older = prediction.predict(_record(), dict(_facts(None), tf32_flags=None), dgx)
    assert not older["fp32_matmuls"]["known"]
    assert older["iteration_seconds"] == pytest.approx(tf32["iteration_seconds"] if older["fp32_matmuls"]["matmuls"] == "tf32"
                                                       else ieee["iteration_seconds"])


def test_a_cpu_run_says_how_its_ranks_allocated(monkeypatch):
    """A CPU rank under glibc's defaults pays page faults on every large tensor, which no
    prediction prices: the hook records the allocator and `report` says it in one line, with
    the settings that compare like with like; a run with them, or on a GPU, gets no line."""
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    plain = engine_facts.cpu_allocator("cpu")
    assert plain["cpu_allocator"] == "glibc default"
    assert set(plain["cpu_allocator_env"]) == {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"}
    line = prediction.cpu_allocator_note(plain)
    assert line.startswith("CPU allocator:") and "\n" not in line
    assert "MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=2147483647" in line
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # set, but below the heap's recycling
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "2147483647")
    assert engine_facts.cpu_allocator("cpu")["cpu_allocator"] == "glibc default"
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1073741824")
    caching = engine_facts.cpu_allocator("cpu")
    assert caching["cpu_allocator"] == "caching" and prediction.cpu_allocator_note(caching) == ""
    assert engine_facts.cpu_allocator("cuda") == {"cpu_allocator": None}
    assert prediction.cpu_allocator_note({"cpu_allocator": None}) == ""
    assert prediction.cpu_allocator_note({}) == ""  # an older hook recorded nothing
