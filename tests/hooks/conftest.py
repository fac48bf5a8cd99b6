"""Fixtures of the hook tests. Launches are session-scoped and cached: each distinct run
happens once however many tests read it (DeepSpeed's first process on a machine also
JIT-compiles a small op, ~1 min, cached in ~/.cache/torch_extensions afterwards)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """runs(name) -> dict of a cached launch; see _LAUNCHES in test_runs.py."""
    cache = {}

    def get(name, make):
        if name not in cache:
            cache[name] = make(tmp_path_factory.mktemp(name))
        return cache[name]
    return get
