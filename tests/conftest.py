import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The project's `shared/` beside the repo, or beside an ancestor (a git worktree under it).
SHARED = next((p.parent / "shared" for p in [REPO, *REPO.parents]
               if p.name and (p.parent / "shared" / "data").is_dir()), REPO.parent / "shared")
NEOX_CONFIGS = SHARED / "data" / "gpt-neox-configs"
SAMPLES = SHARED / "data" / "paper-2509.22832-samples"
EXAMPLES = REPO / "neox_perf" / "examples"

# DeepSpeed on CPU is 20-40x slower per step without this; every rank a test spawns inherits it.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True, scope="session")
def _no_leaked_deepspeed_shm():
    """DeepSpeed's CPU comm op leaves ~66 MB of /dev/shm per rank of every launch; the suite
    launches dozens, so take back what this session left (CI has 24 GB)."""
    import glob
    pattern = "/dev/shm/deepspeed_allreduce_buffer_*"
    before = set(glob.glob(pattern))
    yield
    for path in set(glob.glob(pattern)) - before:
        try:
            os.unlink(path)
        except OSError:
            pass


@pytest.fixture(autouse=True, scope="session")
def _private_neox_perf_home(tmp_path_factory):
    """Profiles a developer calibrated under ~/.cache must not leak into the tests."""
    old = os.environ.get("NEOX_PERF_HOME")
    os.environ["NEOX_PERF_HOME"] = str(tmp_path_factory.mktemp("neox-perf-home"))
    yield
    if old is None:
        os.environ.pop("NEOX_PERF_HOME", None)
    else:
        os.environ["NEOX_PERF_HOME"] = old


@pytest.fixture
def neox_configs():
    if not NEOX_CONFIGS.is_dir():
        pytest.skip("../shared/data/gpt-neox-configs is not present")
    return NEOX_CONFIGS


@pytest.fixture
def write_yaml(tmp_path):
    def write(name, text):
        path = tmp_path / name
        path.write_text(text)
        return str(path)
    return write


@pytest.fixture
def sigkill_once():
    """sigkill_once(proc, ready, seconds): SIGKILL ``proc`` as soon as ``ready()`` is true
    (for the kill-and-resume tests); fails if the process ends or never gets there."""
    import signal
    import time

    def kill(proc, ready, seconds=120.0):
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                if ready():
                    return
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else proc.returncode
                time.sleep(0.01)
            pytest.fail("the process never got far enough to be killed")
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    return kill


@pytest.fixture(scope="session")
def benchmark_script():
    """A script of benchmarks/ loaded as a module (they are scripts, not a package); each call
    loads it afresh. Session-wide, so module-wide fixtures load through it too."""
    import importlib.util

    def load(name: str):
        # registered under its own name while it runs, as an import would: dataclasses look
        # their module up in sys.modules
        qualified = f"benchmarks_{name}"
        spec = importlib.util.spec_from_file_location(qualified, REPO / "benchmarks" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = mod
        spec.loader.exec_module(mod)
        return mod
    return load
