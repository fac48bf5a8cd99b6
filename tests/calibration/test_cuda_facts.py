"""calibration/cuda_facts.py: the CUDA-only branches (TF32 state, reserved memory, CUDA-event
timing, nvidia-smi readings) driven by stand-ins for torch and nvidia-smi, since no GPU is here."""
import threading
import types

import pytest

from neox_perf.calibration import cuda_facts


class FakeEvent:
    """torch.cuda.Event: record() stamps the fake GPU clock; elapsed_time is in milliseconds."""

    def __init__(self, gpu, enable_timing=False):
        assert enable_timing
        self.gpu, self.at = gpu, None

    def record(self):
        self.at = self.gpu.now
        self.gpu.now += self.gpu.step

    def elapsed_time(self, end):
        assert self.gpu.synced, "read before synchronize()"
        return (end.at - self.at) * 1e3


def fake_torch(cuda=True, capability=(9, 0), allow_tf32=False, fp32_precision="none",
               matmul_precision="highest", stats=None):
    gpu = types.SimpleNamespace(now=0.0, step=0.004, synced=False, syncs=0)

    def synchronize():
        gpu.synced = True
        gpu.syncs += 1

    stats = stats or {}
    cuda_ns = types.SimpleNamespace(
        is_available=lambda: cuda,
        get_device_capability=lambda device=0: capability,
        Event=lambda enable_timing=False: FakeEvent(gpu, enable_timing),
        synchronize=synchronize,
        memory_allocated=lambda d=None: stats["allocated"],
        max_memory_allocated=lambda d=None: stats["max_allocated"],
        memory_reserved=lambda d=None: stats["reserved"],
        max_memory_reserved=lambda d=None: stats["max_reserved"])
    backends = types.SimpleNamespace(
        cuda=types.SimpleNamespace(matmul=types.SimpleNamespace(allow_tf32=allow_tf32,
                                                                fp32_precision=fp32_precision)),
        cudnn=types.SimpleNamespace(allow_tf32=True))
    torch = types.SimpleNamespace(cuda=cuda_ns, backends=backends,
                                  get_float32_matmul_precision=lambda: matmul_precision)
    return torch, gpu


def test_tf32_is_off_by_default_and_on_by_each_switch_on_ampere_and_later():
    off = cuda_facts.tf32_state(fake_torch()[0], env={})
    assert off["fp32_matmuls_as_tf32"] is False and off["capability"] == "9.0"
    assert "default" in off["why"]
    for torch, env in ((fake_torch(allow_tf32=True)[0], {}),
                       (fake_torch(fp32_precision="tf32")[0], {}),
                       (fake_torch(matmul_precision="high")[0], {}),
                       (fake_torch()[0], {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"})):
        on = cuda_facts.tf32_state(torch, env=env)
        assert on["fp32_matmuls_as_tf32"] is True, on
    # the override variable set to anything but 1 does not turn it on
    assert not cuda_facts.tf32_state(fake_torch()[0], env={cuda_facts.OVERRIDE_ENV: "0"})["fp32_matmuls_as_tf32"]
    # a Volta has no TF32 whatever is asked; no GPU: no capability
    volta = cuda_facts.tf32_state(fake_torch(capability=(7, 0), allow_tf32=True)[0], env={})
    assert volta["fp32_matmuls_as_tf32"] is False and "< 8.0" in volta["why"]
    cpu = cuda_facts.tf32_state(fake_torch(cuda=False, allow_tf32=True)[0], env={})
    assert cpu["fp32_matmuls_as_tf32"] is False and cpu["capability"] is None


def test_memory_stats_read_allocated_and_reserved_peaks():
    stats = {"allocated": 1, "max_allocated": 5, "reserved": 8, "max_reserved": 10}
    assert cuda_facts.memory_stats(fake_torch(stats=stats)[0]) == stats
    assert cuda_facts.memory_stats(fake_torch(cuda=False)[0]) is None


def test_event_timer_reads_gpu_milliseconds_as_seconds_after_one_synchronize():
    torch, gpu = fake_torch()
    timer = cuda_facts.EventTimer(torch)
    assert timer.cuda and "cuda.Event" in timer.method
    for _ in range(3):
        timer.start()
        timer.stop()
    assert gpu.syncs == 0  # nothing waits for the GPU while it is being timed
    assert timer.seconds() == pytest.approx([0.004] * 3)
    assert gpu.syncs == 1
    with pytest.raises(RuntimeError):
        timer.stop()


def test_event_timer_falls_back_to_the_host_clock_without_cuda():
    timer = cuda_facts.EventTimer(fake_torch(cuda=False)[0])
    timer.start()
    timer.stop()
    (s,) = timer.seconds()
    assert not timer.cuda and 0 <= s < 1


def test_nvidia_smi_parses_its_csv_and_reports_failures_as_readings():
    seen = []

    def runner(cmd):
        seen.append(cmd)
        return "NVIDIA H100 80GB HBM3, 580.159.04, 81559, 1234\n"
    fields = ("name", "driver_version", "memory.total", "memory.used")
    got = cuda_facts.nvidia_smi(fields, runner=runner)
    assert got == {"name": "NVIDIA H100 80GB HBM3", "driver_version": "580.159.04",
                   "memory.total": "81559", "memory.used": "1234"}
    assert "--query-gpu=name,driver_version,memory.total,memory.used" in seen[0]
    assert cuda_facts.mib_bytes(got["memory.used"]) == 1234 * 2 ** 20
    assert cuda_facts.mib_bytes("[N/A]") is None
    short = cuda_facts.nvidia_smi(fields, runner=lambda cmd: "a, b\n")
    assert "2 values for 4 fields" in short["error"]

    def broken(cmd):
        raise OSError("no driver")
    assert "no driver" in cuda_facts.nvidia_smi(fields, runner=broken)["error"]


def test_the_poller_keeps_the_peak_until_stopped():
    readings = iter(["100", "300", "200"])
    done = threading.Event()

    def runner(cmd):
        try:
            return next(readings) + "\n"
        except StopIteration:
            done.set()
            return "150\n"
    poller = cuda_facts.SmiPoller(interval=0.001, runner=runner).start()
    assert done.wait(5)
    got = poller.stop()
    assert got["peak"] == 300 and got["peak_bytes"] == 300 * 2 ** 20 and got["samples"] >= 4
    assert got["error"] is None
    failing = cuda_facts.SmiPoller(interval=0.001, runner=lambda cmd: 1 / 0).start().stop()
    assert failing["peak"] is None and "ZeroDivisionError" in failing["error"]


def test_versions_on_this_machine_are_plain_data():
    torch = pytest.importorskip("torch")
    v = cuda_facts.versions(torch)
    assert v["torch"] == torch.__version__ and v["cuda_available"] == torch.cuda.is_available()
    assert "nccl" in v


def test_nvidia_override_zero_vetoes_tf32_and_a_given_capability_is_used():
    """NVIDIA_TF32_OVERRIDE=0 turns TF32 off in cuBLAS whatever PyTorch asks; the hook passes
    the capability it read, which wins over the device query (one reader for both callers)."""
    torch = fake_torch(allow_tf32=True)[0]
    vetoed = cuda_facts.tf32_state(torch, env={cuda_facts.NVIDIA_OFF_ENV: "0"})
    assert vetoed["fp32_matmuls_as_tf32"] is False and "NVIDIA_TF32_OVERRIDE=0" in vetoed["why"]
    assert cuda_facts.tf32_state(torch, env={cuda_facts.NVIDIA_OFF_ENV: "1"})["fp32_matmuls_as_tf32"] is True
    given = cuda_facts.tf32_state(torch, env={}, capability=(7, 0))
    assert given["capability"] == "7.0" and given["fp32_matmuls_as_tf32"] is False
