"""A calibrated profile's interval from its own validation runs.

The bundled profiles carry an interval from the development set's cross-validated residuals
(corrections.Interval). A profile `neox-perf calibrate` made on a user's machine has no such
set, but every `neox-perf validate` against it measures one more real iteration next to its
prediction. Each is recorded in the profile's manifest (sections.Validation, one run per
config set: a re-run replaces it), and once MIN_RUNS are there the profile's interval is the
central 80% of their measured / predicted, widened for predictions that extrapolate as the
development-set interval is (predictors/fitting/step_fit.interval_from_residuals). Bundled
profiles are never written. No torch, no rich.
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import List, Optional

from .errors import ProfileError
from .profile import directory
from .profile.manifest import Manifest
from .profile.protocol import Profile
from .profile.sections import Validation, ValidationRun
from .prediction.corrections import VALIDATION_MIN_RUNS as MIN_RUNS, Interval


def record(profile: Profile, configs: List[str], measured: float, predicted: float,
           extrapolated_share: float) -> Optional[str]:
    """Add one validated iteration to a calibrated profile's manifest and refit its interval
    (a new version of the profile, swapped in whole; the loaded profile sees it too). Returns a
    one-line note of what happened (None when the profile is not one to write)."""
    path = Path(profile.path)
    if _read_only(path) or not directory.has_manifest(path):
        return None
    if not (measured > 0 and predicted > 0):
        return None
    key = " + ".join(os.path.abspath(c) for c in configs)
    run = ValidationRun(key, float(measured), float(predicted), float(extrapolated_share))

    def add(manifest: Manifest) -> Manifest:
        runs = tuple(r for r in (manifest.validation or Validation()).runs if r.config != key) + (run,)
        interval = None
        if len(runs) >= MIN_RUNS:
            import numpy as np

            from .predictors.fitting.step_fit import interval_from_residuals
            interval = Interval.from_dict(interval_from_residuals(
                np.array([r.measured for r in runs]), np.array([r.predicted for r in runs]),
                np.array([r.extrapolated_share for r in runs])))
        return replace(manifest, validation=replace(manifest.validation or Validation(), runs=runs,
                                                    interval=interval))
    try:
        written = directory.update(path, add)
    except ProfileError:  # a manifest it cannot read: nothing to add to
        return None
    profile.manifest = written
    runs, iv = written.validation.runs, written.validation.interval
    note = f"{len(runs)} validated config(s) recorded in {directory.manifest_path(path)}"
    if iv is not None:
        return note + f"; its 80% interval is now x{iv.lo_ratio:.3f} .. x{iv.hi_ratio:.3f}"
    return note + f"; an interval needs {MIN_RUNS}"


def _read_only(path: Path) -> bool:
    # a new version is written beside the profile and swapped in: both must be writable
    return directory.is_bundled(path) or not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK))
