import pytest

from derive_specs import NEOX_20B, NEOX_20B_VALUES, make_config


@pytest.fixture
def neox20b():
    return make_config(values=NEOX_20B_VALUES, **NEOX_20B)
