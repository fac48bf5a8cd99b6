"""A calibrated profile's interval from its own validation runs.

The bundled profiles carry an interval from the development set's cross-validated residuals
(step_terms.Interval). A profile `neox-perf calibrate` made on a user's machine has no such
set, but every `neox-perf validate` against it measures one more real iteration next to its
prediction. Each is recorded in the profile's manifest (one per config set: a re-run replaces
it), and once MIN_RUNS are there the profile's interval is the central 80% of their
measured / predicted, widened for predictions that extrapolate as the development-set
interval is (predictors/step_fit.interval_from_residuals). Bundled profiles are never written.
No torch, no rich.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

from .step_terms import VALIDATION_MIN_RUNS as MIN_RUNS, VALIDATION_SECTION as SECTION


def record(profile, configs: List[str], measured: float, predicted: float,
           extrapolated_share: float) -> Optional[str]:
    """Add one validated iteration to a calibrated profile's manifest and refit its interval.
    Returns a one-line note of what happened (None when the profile is not one to write)."""
    path = getattr(profile, "path", None)
    manifest = getattr(profile, "manifest", None)
    if path is None or manifest is None or _read_only(Path(path)):
        return None
    if not (measured > 0 and predicted > 0):
        return None
    file = Path(path) / "manifest.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    section = data.setdefault(SECTION, {})
    key = " + ".join(os.path.abspath(c) for c in configs)
    runs = [r for r in section.get("runs", []) if r.get("config") != key]
    runs.append({"config": key, "measured": float(measured), "predicted": float(predicted),
                 "extrapolated_share": float(extrapolated_share)})
    section["runs"] = runs
    note = f"{len(runs)} validated config(s) recorded in {file}"
    if len(runs) >= MIN_RUNS:
        import numpy as np

        from .predictors.fitting.step_fit import interval_from_residuals
        section["interval"] = interval_from_residuals(
            np.array([r["measured"] for r in runs]), np.array([r["predicted"] for r in runs]),
            np.array([r["extrapolated_share"] for r in runs]))
        iv = section["interval"]
        note += f"; its 80% interval is now x{iv['lo_ratio']:.3f} .. x{iv['hi_ratio']:.3f}"
    else:
        section.pop("interval", None)
        note += f"; an interval needs {MIN_RUNS}"
    _replace(file, data)
    manifest[SECTION] = section  # the loaded profile sees it too
    return note


def _read_only(path: Path) -> bool:
    from .predictors.profile import is_bundled
    return is_bundled(path) or not os.access(path, os.W_OK)


def _replace(file: Path, data: Dict[str, Any]) -> None:
    """The manifest rewritten whole and renamed over the old one: a kill keeps one or the other."""
    fd, tmp = tempfile.mkstemp(prefix=".manifest-", dir=str(file.parent))
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1, allow_nan=False)
            fh.write("\n")
        os.chmod(tmp, file.stat().st_mode & 0o777)
        os.replace(tmp, file)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
