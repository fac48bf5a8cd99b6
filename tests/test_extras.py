"""setup.cfg's extras are named for what a user does, and each brings what that needs (issue 26,
section 5): the `calibrate` extra covers every library `neox-perf calibrate` (and `--from-run`)
can import, read from the source, so a user who installs it never finds a missing one at the
fit; `calibrate` checks them all before it measures anything."""
import configparser
import importlib.metadata
import re
import sys

import pytest

from neox_perf import exitcodes
from neox_perf.calibration import launch

from test_import_layers import EDGES, MODULES, REPO

# The calibrate command, and every calibration module (the collectives, engine and workload run
# as their own processes under torchrun: `python -m neox_perf.calibration...`).
ROOTS = ["neox_perf.commands.calibrate", "neox_perf.commands.from_run"] + sorted(
    m for m in MODULES if m.startswith("neox_perf.calibration"))
# Imported only where present, inside try: GPT-NeoX's fused softmax kernel (CUDA builds of NeoX),
# and NVML's bindings (calibration/machine.py asks which other processes hold the GPU, and says
# nothing where it cannot ask; a CUDA node has them with its driver stack).
OPTIONAL = {"scaled_upper_triang_masked_softmax_cuda", "pynvml"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(value: str) -> set:
    return {_canonical(re.split(r"[<>=!~;\[ ]", line.strip(), maxsplit=1)[0])
            for line in value.splitlines() if line.strip() and not line.strip().startswith("#")}


def _setup():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    extras = {k: _requirements(v) for k, v in cfg["options.extras_require"].items()}
    return _requirements(cfg["options"]["install_requires"]), extras


CORE, EXTRAS = _setup()


def _reachable(roots):
    seen, todo = set(), list(roots)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for target, _ in EDGES[module]:
            while target and target.startswith("neox_perf") and target not in MODULES:
                target = target.rpartition(".")[0]  # `from ..errors import UsageError`
            if target in MODULES:
                todo.append(target)
    return seen


def _third_party(modules) -> dict:
    """Top-level third-party module -> the package modules importing it."""
    out = {}
    for module in modules:
        for target, _ in EDGES[module]:
            top = target.split(".")[0]
            if top != "neox_perf" and top not in sys.stdlib_module_names:
                out.setdefault(top, set()).add(module)
    return out


def _distribution(top: str) -> str:
    dists = importlib.metadata.packages_distributions().get(top)
    assert dists, f"{top} is imported but not installed here: cannot tell which distribution it is"
    return _canonical(dists[0])


CALIBRATE_IMPORTS = _third_party(_reachable(ROOTS))


def test_the_walk_sees_what_calibrate_imports():
    # the engine step (DeepSpeed) and the fit (scikit-learn, XGBoost, SciPy) are in-function
    # imports several modules away from the command: the walk must reach them
    assert {"torch", "deepspeed", "sklearn", "xgboost", "scipy", "numpy", "yaml"} <= set(CALIBRATE_IMPORTS)


@pytest.mark.parametrize("top", sorted(set(CALIBRATE_IMPORTS) - OPTIONAL))
def test_the_calibrate_extra_covers_every_import(top):
    dist = _distribution(top)
    assert dist in CORE | EXTRAS["calibrate"], (
        f"calibrate imports {top} ({sorted(CALIBRATE_IMPORTS[top])[:3]}), which neither "
        f"install_requires nor the [calibrate] extra installs ({dist})")


def test_calibrate_checks_every_library_its_extra_installs():
    checked = {**launch.MEASURE_LIBRARIES, **launch.ENGINE_LIBRARIES, **launch.FIT_LIBRARIES}
    heavy = {top for top in set(CALIBRATE_IMPORTS) - OPTIONAL if _distribution(top) not in CORE}
    assert set(checked) == heavy
    assert {_canonical(d) for d in checked.values()} == EXTRAS["calibrate"]


def test_the_test_install_covers_calibrate():
    """CI installs '.[runtime,dev]' (README's first command) and the suite runs calibrate."""
    assert EXTRAS["calibrate"] <= EXTRAS["runtime"] | EXTRAS["dev"]
    assert EXTRAS["train"] <= EXTRAS["calibrate"]


def test_xgboost_is_always_the_cpu_build():
    assert not any("xgboost" in extra for extra in EXTRAS.values())  # canonical names
    assert all("xgboost-cpu" in EXTRAS[name] for name in ("calibrate", "train", "dev"))


def test_a_missing_fitting_library_stops_calibrate_before_it_measures(monkeypatch, tmp_path, capsys):
    from neox_perf.calibration import sweep
    from neox_perf.cli import main
    real = launch.has_module
    monkeypatch.setattr(launch, "has_module", lambda name: name != "xgboost" and real(name))
    monkeypatch.setattr(sweep, "calibrate", lambda *a, **k: pytest.fail("measured before the check"))
    code = main(["calibrate", "--cluster", "t", "--quick", "--out", str(tmp_path / "p"),
                 "--store", str(tmp_path / "s.sqlite")])
    err = capsys.readouterr().err
    assert code == exitcodes.USAGE
    assert len(err.strip().splitlines()) == 1
    assert "xgboost-cpu" in err and "[calibrate]" in err
    assert not (tmp_path / "s.sqlite").exists()
    # --no-engine does not need DeepSpeed, the fit still needs the rest
    monkeypatch.setattr(launch, "has_module", lambda name: name != "deepspeed" and real(name))
    assert launch.require_libraries("calibrate", {**launch.MEASURE_LIBRARIES,
                                                  **launch.FIT_LIBRARIES}) is None
    with pytest.raises(Exception, match="deepspeed"):
        launch.require_libraries("calibrate", launch.ENGINE_LIBRARIES)
