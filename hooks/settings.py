"""The switch and its settings: environment variables every rank can see.

All names start with ``PYTHON`` because DeepSpeed's multi-node runners (pdsh, OpenMPI,
MPICH, Slurm, ...) export to remote ranks only the variables whose names start with one of
``EXPORT_ENVS = ['MLFLOW', 'PYTHON', 'MV2', 'UCX']`` (deepspeed/launcher/runner.py), plus
``.deepspeed_env``. torchrun and DeepSpeed's single-node launch.py pass the whole
environment. PYTHONPATH itself is among the exported names, which is how our
``sitecustomize`` reaches every rank.

Nothing here imports torch: sitecustomize reads these in every Python process.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional

PREFIX = "PYTHON_NEOX_PERF_"
RUN_DIR = PREFIX + "RUN_DIR"  # the switch: set => the hook attaches; the value is the run dir
CLUSTER = PREFIX + "CLUSTER"  # cluster profile name or directory (prediction)
JOB = PREFIX + "JOB"  # job id shared by all ranks of one launch
WINDOWS = PREFIX + "WINDOWS"  # profiling windows, "skip=3,warmup=1,active=2,every=50,repeat=3" or "off"
CONFIG = PREFIX + "CONFIG"  # NeoX YAML files (os.pathsep-separated) when the script is not NeoX
VOCAB = PREFIX + "VOCAB"  # raw tokenizer vocabulary for CONFIG
REPORT = PREFIX + "REPORT"  # "exit": rank 0 prints the report at exit; "none": the CLI prints it
INJECT = PREFIX + "INJECT"  # test-only fault injection: initialize | iteration | sample_writer | summary
MEMORY = PREFIX + "MEMORY"  # the iteration whose live tensor bytes are tracked (0-based), or "off"
USER_CLUSTER = "NEOX_PERF_CLUSTER"  # the user's default profile (read where the hook runs)

ALL = (RUN_DIR, CLUSTER, JOB, WINDOWS, CONFIG, VOCAB, REPORT, INJECT, MEMORY)
# the third iteration: the optimizer's state exists (made by the first step) and every
# cache and pipeline buffer has been built, so this is the run's steady state
MEMORY_ITERATION = 2


@dataclass(frozen=True)
class Windows:
    """Profiling windows: `skip` iterations, then every `every` iterations a window of
    `warmup` + `active` profiled iterations, `repeat` times (0 = profiling off)."""

    skip: int = 5
    warmup: int = 1
    active: int = 2
    every: int = 50
    repeat: int = 3

    # Kineto buffers every event of a window in memory: keep windows short.
    MAX_ACTIVE = 5

    @property
    def enabled(self) -> bool:
        return self.repeat > 0 and self.active > 0

    @classmethod
    def parse(cls, text: Optional[str]) -> "Windows":
        if text is None or not text.strip():
            return cls()
        if text.strip().lower() in ("off", "0", "none", "no"):
            return cls(repeat=0)
        values = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in ("skip", "warmup", "active", "every", "repeat"):
                raise ValueError(f"{WINDOWS}: cannot read {part!r} (expected e.g. "
                                 f"skip=5,warmup=1,active=2,every=50,repeat=3 or off)")
            values[key] = int(value)
        w = cls(**{**cls().__dict__, **values})
        if min(w.skip, w.warmup, w.active, w.every, w.repeat) < 0:
            raise ValueError(f"{WINDOWS}: values must be >= 0, got {text!r}")
        if w.active > cls.MAX_ACTIVE:
            raise ValueError(f"{WINDOWS}: active={w.active} > {cls.MAX_ACTIVE}; profiler buffers "
                             f"grow with the window, keep it short")
        if w.every < w.warmup + w.active:
            raise ValueError(f"{WINDOWS}: every={w.every} is shorter than warmup+active")
        return w

    def text(self) -> str:
        if not self.enabled:
            return "off"
        return (f"skip={self.skip},warmup={self.warmup},active={self.active},"
                f"every={self.every},repeat={self.repeat}")


@dataclass(frozen=True)
class Settings:
    run_dir: str
    cluster: Optional[str] = None
    job: Optional[str] = None
    windows: Windows = field(default_factory=Windows)
    config_files: List[str] = field(default_factory=list)
    vocab: Optional[int] = None
    report_at_exit: bool = True
    inject: Optional[str] = None
    memory_iteration: Optional[int] = MEMORY_ITERATION  # None: no live-bytes measurement


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return bool(environ.get(RUN_DIR, "").strip())


def read(environ: Mapping[str, str] = os.environ) -> Settings:
    """Settings of this process; raises ValueError on a malformed value."""
    vocab = environ.get(VOCAB)
    files = [f for f in environ.get(CONFIG, "").split(os.pathsep) if f]
    return Settings(
        run_dir=os.path.abspath(environ[RUN_DIR]),
        cluster=environ.get(CLUSTER) or environ.get(USER_CLUSTER) or None,
        job=environ.get(JOB) or None,
        windows=Windows.parse(environ.get(WINDOWS)),
        config_files=files,
        vocab=int(vocab) if vocab else None,
        report_at_exit=environ.get(REPORT, "exit").strip().lower() != "none",
        inject=environ.get(INJECT) or None,
        memory_iteration=parse_memory(environ.get(MEMORY)),
    )


def parse_memory(text: Optional[str]) -> Optional[int]:
    """PYTHON_NEOX_PERF_MEMORY: an iteration index (0-based), "off", or unset (the default)."""
    if text is None or not text.strip():
        return MEMORY_ITERATION
    if text.strip().lower() in ("off", "no", "none"):
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 1:
        raise ValueError(f"{MEMORY}: {text!r} is not an iteration index >= 1 (the first "
                         f"iteration builds the optimizer state) or off")
    return value


def site_dir() -> str:
    """The directory holding our sitecustomize.py (put it first on PYTHONPATH)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")


def environment(run_dir: str, *, cluster: Optional[str] = None, job: Optional[str] = None,
                windows: Optional[str] = None, config_files: Optional[List[str]] = None,
                vocab: Optional[int] = None, report_at_exit: bool = True,
                base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The variables that switch the hook on for every rank a launch command starts."""
    base = dict(os.environ if base is None else base)
    site = site_dir()
    old = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and p != site]
    env = {RUN_DIR: os.path.abspath(run_dir),
           "PYTHONPATH": os.pathsep.join([site] + old)}
    if cluster:
        env[CLUSTER] = cluster
    if job:
        env[JOB] = job
    if windows:
        Windows.parse(windows)  # refuse a bad value here, not in every rank
        env[WINDOWS] = windows
    if config_files:
        env[CONFIG] = os.pathsep.join(os.path.abspath(f) for f in config_files)
    if vocab:
        env[VOCAB] = str(int(vocab))
    env[REPORT] = "exit" if report_at_exit else "none"
    return env
