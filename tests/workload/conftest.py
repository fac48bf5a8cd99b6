import pytest

from workload_specs import write_config


@pytest.fixture
def neox_cfg(tmp_path):
    """neox_cfg(world=1, **keys) -> NeoxConfig built by the lead's loader from a YAML file."""
    from neox_perf.config import WorldRequest, build, load_files

    def make(world=1, **overrides):
        path = write_config(tmp_path / f"cfg{len(list(tmp_path.iterdir()))}.yml", **overrides)
        cfg, verdicts, _ = build(load_files([path]), WorldRequest(gpus=world))
        assert not [v for v in verdicts if v.level == "error"], verdicts
        return cfg
    return make
