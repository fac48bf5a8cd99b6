import pytest

from calib_helpers import TINY_PLAN


@pytest.fixture
def tiny_plan(tmp_path):
    path = tmp_path / "tiny.yml"
    path.write_text(TINY_PLAN)
    return str(path)
