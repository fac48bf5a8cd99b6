import pytest

from validate_helpers import TINY_PLAN


@pytest.fixture
def tiny_plan(tmp_path):
    path = tmp_path / "tiny.yml"
    path.write_text(TINY_PLAN)
    return path


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A private NEOX_PERF_HOME: user profiles of one test never leak into another."""
    path = tmp_path / "home"
    monkeypatch.setenv("NEOX_PERF_HOME", str(path))
    return path
