"""A layout's parallel groups are made once per process group where the caller keeps them:
DeepSpeed's grid makes gloo groups whose threads live until the process group ends, and the
engine calibration's tensor-parallel pass builds one engine per shape and sweep."""
import pytest

pytest.importorskip("torch")
topology = pytest.importorskip("deepspeed.runtime.pipe.topology")

from neox_perf.calibration.workload import tensor_parallel  # noqa: E402


class _Grid:
    """Stands in for PipelineParallelGrid (which needs a process group): counts how many were made."""
    made = 0

    def __init__(self, topology):
        type(self).made += 1
        self.topology = topology

    def get_slice_parallel_rank(self):
        return 1

    def get_slice_parallel_group(self):
        return f"group of grid {type(self).made}"


@pytest.fixture
def grids(monkeypatch):
    _Grid.made = 0
    monkeypatch.setattr(topology, "PipelineParallelGrid", _Grid)
    yield _Grid
    tensor_parallel.set_tp_state(tensor_parallel.TPState())


def test_a_kept_layout_is_built_once_and_each_call_sets_the_state(grids):
    built = {}
    _, first, mpu = tensor_parallel.parallel_groups(1, 2, 1, False, "cpu", built)
    tensor_parallel.set_tp_state(tensor_parallel.TPState())  # another engine's state in between
    _, again, _ = tensor_parallel.parallel_groups(1, 2, 1, True, "cpu", built)
    assert grids.made == 1 and again is first and mpu.grid is first
    state = tensor_parallel.tp()
    # the state is this call's (its fp32_allreduce), on the one grid's group
    assert (state.rank, state.world_size, state.group, state.fp32_allreduce) == (1, 2, "group of grid 1", True)
    tensor_parallel.parallel_groups(1, 2, 2, False, "cpu", built)  # another layout: its own grid
    assert grids.made == 2 and set(built) == {(1, 2, 1), (1, 2, 2)}


def test_without_a_keeper_every_call_builds(grids):
    # the reference workload's one call per process: nothing to keep
    tensor_parallel.parallel_groups(1, 2, 1, False, "cpu")
    tensor_parallel.parallel_groups(1, 2, 1, False, "cpu")
    assert grids.made == 2
