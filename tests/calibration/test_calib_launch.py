"""The launch helpers take back the shared memory DeepSpeed's CPU comm op leaves behind."""
import os

import pytest

from neox_perf.calibration.launch import remove_shm_buffers


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")
def test_only_the_finished_jobs_buffers_are_removed():
    mine = [f"/dev/shm/deepspeed_allreduce_buffer_0_127.0.0.1_1_{rank}" for rank in (0, 1)]
    other = "/dev/shm/deepspeed_allreduce_buffer_0_127.0.0.1_12_0"  # port 12: another job
    for path in mine + [other]:
        with open(path, "wb") as fh:
            fh.write(b"x")
    try:
        assert remove_shm_buffers(1) == 2
        assert not any(os.path.exists(p) for p in mine)
        assert os.path.exists(other)
    finally:
        for path in mine + [other]:
            if os.path.exists(path):
                os.unlink(path)
