"""GPT-NeoX's own training program on this machine: needs a checkout.

NEOX_PERF_NEOX_SRC: the GPT-NeoX checkout; NEOX_PERF_NEOX_PYTHON: a Python that imports it
(numpy < 2 ...). Without them every live test here skips; the offline ones always run.
"""
import os

import pytest

from neox_perf.testing import neox_cpu


@pytest.fixture(scope="session")
def neox():
    try:
        src = neox_cpu.neox_src()
    except neox_cpu.NeoxUnavailable as exc:
        pytest.skip(str(exc))
    return src


@pytest.fixture(scope="session")
def neox_work(tmp_path_factory):
    return str(os.environ.get("NEOX_PERF_NEOX_WORK") or tmp_path_factory.mktemp("neox"))
