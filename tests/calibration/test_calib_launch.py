"""The launch helpers take back the shared memory DeepSpeed's CPU comm op leaves behind."""
import os

import pytest

from neox_perf.calibration.launch import release_rank_buffer, remove_shm_buffers


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


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")
def test_a_rank_releases_its_own_buffer_only():
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "3", "RANK": "1"}
    uid = os.getuid()
    mine = f"/dev/shm/deepspeed_allreduce_buffer_{uid}_127.0.0.1_3_1"
    peer = f"/dev/shm/deepspeed_allreduce_buffer_{uid}_127.0.0.1_3_0"  # still mapped by rank 0
    for path in (mine, peer):
        with open(path, "wb") as fh:
            fh.write(b"x")
    try:
        assert release_rank_buffer(env) is True
        assert not os.path.exists(mine) and os.path.exists(peer)
        assert release_rank_buffer(env) is False  # nothing left to release
        assert release_rank_buffer({"RANK": "0"}) is False  # not launched: no name to build
    finally:
        for path in (mine, peer):
            if os.path.exists(path):
                os.unlink(path)


# A stand-in for torchrun: fails once as if its port was taken, then reports progress.
FLAKY = """
import os, sys
marker = sys.argv[1]
port = sys.argv[sys.argv.index("--master_port") + 1]
with open(marker, "a") as fh:
    fh.write(port + "\\n")
if len(open(marker).read().split()) == 1:
    print("RuntimeError: The server socket has failed to listen on any local network address. "
          "port: " + port + " EADDRINUSE", flush=True)
    sys.exit(1)
from neox_perf.calibration.launch import progress_line
print("some log text", flush=True)
print(progress_line(measured="job 1"), flush=True)
print(progress_line(measured="job 2"), flush=True)
"""


def test_launch_retries_a_taken_port_and_passes_every_line(tmp_path):
    import sys

    from neox_perf.calibration.launch import launch, progress_event
    marker = tmp_path / "attempts"
    lines = []
    launch([sys.executable, "-c", FLAKY, str(marker), "--master_port", "0"], dict(os.environ),
           tmp_path / "log", on_line=lines.append)
    ports = marker.read_text().split()
    assert len(ports) == 2 and all(int(p) > 0 for p in ports)  # a fresh free port each time
    events = [progress_event(line) for line in lines]
    assert [e for e in events if e] == [{"measured": "job 1"}, {"measured": "job 2"}]
    # every line reached the callback as it came; the log holds the last attempt's
    assert "EADDRINUSE" in lines[0] and lines[1:] == (tmp_path / "log").read_text().splitlines(True)


def test_a_failed_launch_is_one_line_with_the_reason(tmp_path):
    import sys

    from neox_perf.calibration.launch import CalibrationFailed, launch
    script = ("import sys; print('[rank1]: ValueError: bad shape', flush=True); "
              "print('torch.distributed.elastic.multiprocessing.errors.ChildFailedError:'); sys.exit(3)")
    with pytest.raises(CalibrationFailed) as err:
        launch([sys.executable, "-c", script, "--master_port", "0"], dict(os.environ),
               tmp_path / "log", what="workload launch")
    line = err.value.line()
    assert line.startswith("workload launch failed (exit 3): [rank1]: ValueError: bad shape")
    assert "\n" not in line and str(tmp_path / "log") in line


def test_progress_lines_round_trip_and_other_lines_are_not_progress():
    from neox_perf.calibration.launch import progress_event, progress_line
    assert progress_event(progress_line(iteration=3) + "\n") == {"iteration": 3}
    assert progress_event("linear1 fwd: 1.0 us (IQR 0.1 us)") is None
    assert progress_event('{"neox_perf_progress": 3}') is None
    assert progress_event('{"neox_perf_progress": {"a"') is None


def test_a_rank_exits_with_its_code_after_its_exit_handlers_and_output(tmp_path):
    """exit_rank skips the interpreter's teardown (where DeepSpeed/gloo threads can abort a
    finished rank) but not the exit handlers the runtime hook writes its summary from."""
    import subprocess
    import sys
    marker = tmp_path / "handler-ran"
    code = ("import atexit, pathlib\n"
            f"atexit.register(lambda: pathlib.Path({str(marker)!r}).write_text('yes'))\n"
            "from neox_perf.calibration.launch import exit_rank\n"
            "print('written', end='')\n"
            "exit_rank(3)\n"
            "print('never')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3
    assert done.stdout == "written"
    assert marker.read_text() == "yes"
