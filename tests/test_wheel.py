"""The wheel holds only neox_perf/..., with hooks/predictors/calibration mapped inside it."""
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAPPED = {"neox_perf": REPO / "neox_perf", "neox_perf/hooks": REPO / "hooks",
          "neox_perf/predictors": REPO / "predictors", "neox_perf/calibration": REPO / "calibration"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    pytest.importorskip("build")
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation",
                           "--outdir", str(out), str(REPO)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1
    return wheels[0]


def test_only_neox_perf_inside(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"neox_perf"}


def test_every_subpackage_present(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = set()
    for prefix, root in MAPPED.items():
        for init in root.rglob("__init__.py"):
            rel = init.relative_to(root).parent
            if "__pycache__" in rel.parts or (prefix == "neox_perf" and rel.parts[:1] in
                                                  (("hooks",), ("predictors",), ("calibration",))):
                continue
            expected.add("/".join([prefix, *rel.parts, "__init__.py"]))
    assert expected, "no packages found"
    missing = sorted(expected - names)
    assert not missing, f"packages missing from the wheel (add them to setup.cfg): {missing}"
    for sub in ("hooks", "predictors", "predictors/fitting", "calibration", "config", "derive", "render",
                "commands", "profile", "runs"):
        assert f"neox_perf/{sub}/__init__.py" in names


def test_profiles_and_examples_shipped(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("neox_perf/examples/") and n.endswith(".yml") for n in names)
    profiles = [n for n in names if n.startswith("neox_perf/profiles/")]
    assert any(n.endswith("manifest.json") for n in profiles)
    assert any(n.endswith(".npz") for n in profiles)
    # the 40 GB Perlmutter node and the example DGX are descriptions, not trained profiles
    assert "neox_perf/profiles/perlmutter-a100/cluster.yml" in names
    assert "neox_perf/examples/clusters/dgx-a100.yml" in names
    assert "neox_perf/examples/clusters/perlmutter-ss11.yml" in names  # found by name (issue 32)
    assert "neox_perf/calibration/plans/quick.yml" in names


def test_wheel_is_small(wheel):
    assert wheel.stat().st_size <= 30 * 2**20
