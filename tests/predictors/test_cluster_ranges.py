"""Every number of a cluster description against the physical range of its kind (issue 32,
section 3): outside it, one line naming the key, the value and the likely unit slip, exit 2 on
the command line; near its edges, a warning every report carries."""
import contextlib
import io
from pathlib import Path

import pytest

from neox_perf import exitcodes
from neox_perf.cli import main
from neox_perf.predictors import ProfileError, load_profile
from neox_perf.predictors.cluster_file import GPU_RANGES, RANGES
from neox_perf.profile.disturbance import profile_warnings

EXAMPLES = Path(__file__).resolve().parents[2] / "neox_perf" / "examples"

BASE = {"name": "mine", "base": "perlmutter-a100-80gb", "gpu": "A100-SXM4-80GB", "gpus_per_node": 8,
        "intra_node_GBps": 300, "inter_node_Gbps": 1600, "nics_per_node": 8}
V100 = {"name": "V100-SXM2-32GB", "memory_GiB": 32, "hbm_GBps": 900, "fp16_tflops": 125,
        "fp32_tflops": 15.7, "sms": 80, "mhz": 1530}


def _yaml(values: dict) -> str:
    import yaml
    return yaml.safe_dump(values, sort_keys=False)


def _load(tmp_path, key, value, gpu_key=False):
    data = dict(BASE)
    if gpu_key:
        data["gpu"] = {**V100, key: value}
    else:
        data[key] = value
    path = tmp_path / "c.yml"
    path.write_text(_yaml(data))
    return load_profile(str(path))


def _cases():
    for table, gpu_key in ((RANGES, False), (GPU_RANGES, True)):
        for key, rng in table.items():
            yield pytest.param(key, rng, gpu_key, id=key)


def _whole(rng, value):
    return int(value) if rng.unit in ("GPUs per node", "NICs per node", "SMs", "MHz") else value


@pytest.mark.parametrize("key,rng,gpu_key", list(_cases()))
def test_a_value_outside_its_range_is_one_line_naming_key_and_value(tmp_path, key, rng, gpu_key):
    low = _whole(rng, rng.lo / 2) if rng.lo > 1 else rng.lo / 2
    high = _whole(rng, rng.hi * 2)
    bad = [high] + ([low] if low > 0 and (rng.unit not in ("GPUs per node", "NICs per node", "SMs") or low >= 1) else [])
    for value in bad:
        if key.endswith("efficiency") and value > 1:
            continue  # a fraction over 1 is refused as such before its range
        with pytest.raises(ProfileError) as info:
            _load(tmp_path, key, value, gpu_key)
        line = info.value.line()
        assert "\n" not in line and key in line and f"{value:g}" in line and rng.unit in line, line
        slip = rng.slip_low if value < rng.lo else rng.slip_high
        if slip:
            assert f"did you write {slip[0]}?" in line


@pytest.mark.parametrize("key,rng,gpu_key", list(_cases()))
def test_a_value_near_its_edge_is_a_warning_every_report_carries(tmp_path, key, rng, gpu_key):
    inside = [v for v in ((rng.lo + rng.warn_lo) / 2, (rng.warn_hi + rng.hi) / 2)
              if rng.lo < v < rng.warn_lo or rng.warn_hi < v < rng.hi]
    if rng.unit in ("GPUs per node", "NICs per node", "SMs", "MHz"):
        inside = [int(v) for v in inside if rng.lo <= int(v) < rng.warn_lo or rng.warn_hi < int(v) <= rng.hi]
    if key == "gpus_per_node":
        inside = [v for v in inside if v <= 16] or [24]  # 8 NICs: any count above 16 is the edge
    for value in inside:
        profile = _load(tmp_path, key, value, gpu_key)
        warnings = profile_warnings(profile)
        assert any(key in w and "unusually" in w for w in warnings), (value, warnings)
    # and a plain value is no warning
    assert not profile_warnings(_load(tmp_path, "name", "mine"))


def test_the_issue_magnitudes_are_refused_naming_the_unit_on_the_command_line(tmp_path):
    for key, value, unit in (("inter_node_Gbps", 3.2, "Tb/s"), ("intra_node_GBps", 3600, "Gb/s")):
        path = tmp_path / f"{key}.yml"
        path.write_text(_yaml({**BASE, key: value}))
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["check", str(EXAMPLES / "gpt-20b.yml"), "--gpus", "64", "--cluster", str(path)])
        assert code == exitcodes.USAGE
        lines = err.getvalue().strip().splitlines()
        assert len(lines) == 1 and key in lines[0] and f"did you write {unit}?" in lines[0], lines


def test_every_range_is_sourced_in_a_comment():
    import inspect
    from neox_perf.predictors import cluster_file
    text = inspect.getsource(cluster_file)
    block = text[text.index("RANGES: Dict"):text.index("def check_range")]
    for key in (*RANGES, *GPU_RANGES):
        before = block[:block.index(f'"{key}": Range(')]
        assert "#" in before.splitlines()[-1] or "#" in before.rstrip().splitlines()[-1] or any(
            line.strip().startswith("#") for line in before.splitlines()[-4:]), key
