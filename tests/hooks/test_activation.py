"""The switch: environment variables, our sitecustomize, the deepspeed import hook."""
import os
import subprocess
import sys

import pytest

from neox_perf.hooks import settings
from neox_perf.hooks.settings import Windows

PROBE = ("import sys, deepspeed; "
         "print('wrapped', getattr(deepspeed.initialize, '_neox_perf_wrapped', False)); "
         "print('torch', 'torch' in sys.modules); "
         "import sitecustomize; print('chained', getattr(sitecustomize, 'USER', False))")


@pytest.fixture
def dirs(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("USER = True\nprint('user sitecustomize ran')\n")
    fake = tmp_path / "fake"
    (fake / "deepspeed").mkdir(parents=True)
    (fake / "deepspeed" / "__init__.py").write_text("def initialize(*a, **k):\n    return (None,) * 4\n")
    return user, fake


def _probe(tmp_path, env):
    base = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON_NEOX_PERF_")}
    proc = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_switch_on_wraps_deepspeed_and_keeps_the_users_sitecustomize(tmp_path, dirs):
    user, fake = dirs
    env = settings.environment(str(tmp_path / "run"),
                               base={"PYTHONPATH": os.pathsep.join([str(user), str(fake)])})
    assert env["PYTHONPATH"].split(os.pathsep) == [settings.site_dir(), str(user), str(fake)]
    out = _probe(tmp_path, env)
    assert "user sitecustomize ran" in out and "chained True" in out
    assert "wrapped True" in out
    assert "torch False" in out  # start-up stays cheap: nothing heavy imported


def test_switch_off_changes_nothing(tmp_path, dirs):
    user, fake = dirs
    env = {"PYTHONPATH": os.pathsep.join([settings.site_dir(), str(user), str(fake)])}
    out = _probe(tmp_path, env)
    assert "wrapped False" in out and "chained True" in out


def test_every_variable_reaches_remote_ranks():
    # DeepSpeed's multi-node runners export only names with these prefixes (runner.py).
    from deepspeed.launcher.runner import EXPORT_ENVS  # noqa: F401 (fails loudly if renamed)
    env = settings.environment("/tmp/r", cluster="c", job="j", windows="off",
                               config_files=["a.yml"], vocab=50257, base={})
    assert all(any(k.startswith(p) for p in EXPORT_ENVS) for k in env), env
    assert set(env) - {"PYTHONPATH"} <= set(settings.ALL)


def test_windows_parse_and_schedule():
    from neox_perf.hooks.profiling import WindowSchedule
    w = Windows.parse("skip=2,warmup=1,active=2,every=5,repeat=2")
    s = WindowSchedule(w)
    names = [s(i).name for i in range(14)]
    assert names == ["NONE", "NONE", "WARMUP", "RECORD", "RECORD_AND_SAVE", "NONE", "NONE",
                     "WARMUP", "RECORD", "RECORD_AND_SAVE", "NONE", "NONE", "NONE", "NONE"]
    assert not Windows.parse("off").enabled and Windows.parse(None) == Windows()
    for bad in ("skip=x", "active=9", "every=2", "wait=3", "skip=-1"):
        with pytest.raises(ValueError):
            Windows.parse(bad)


def test_memory_window_setting():
    """PYTHON_NEOX_PERF_MEMORY: which iteration the live-bytes window tracks, or off."""
    assert settings.parse_memory(None) == settings.MEMORY_ITERATION == 2
    assert settings.parse_memory("5") == 5 and settings.parse_memory("off") is None
    for bad in ("0", "x", "-1"):  # the first iteration builds the optimizer's state
        with pytest.raises(ValueError, match=settings.MEMORY):
            settings.parse_memory(bad)
    assert settings.read({settings.RUN_DIR: "/r", settings.MEMORY: "off"}).memory_iteration is None


def test_activate_prints_the_exports():
    proc = subprocess.run([sys.executable, "-m", "neox_perf.hooks.activate", "--run-dir", "/tmp/r x",
                           "--cluster", "vista-gh200"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    lines = proc.stdout.splitlines()
    assert "export PYTHON_NEOX_PERF_RUN_DIR='/tmp/r x'" in lines
    assert any(line.startswith("export PYTHONPATH=") and settings.site_dir() in line for line in lines)
