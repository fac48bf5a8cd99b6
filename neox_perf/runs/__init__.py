"""Offline analysis of a hooked run's directory: no torch, no rich.

The hook (neox_perf.hooks) writes a run dir from inside the training ranks; this package
reads it back afterwards:

files        the run dir's layout (written by the hook, read here)
prediction   the recorded config predicted with neox_perf.prediction.predict
report       predicted vs measured (`neox-perf report`)
recalibrate  how far off a profile is on a run; the level correction (`calibrate --from-run`)
merge        a run's samples merged into a calibration store (the refit)
engine_rows  engine-term rows from the run's stage times (the refit)
from_run     `calibrate --from-run`'s use case: merge and refit, or level; the swap
"""
from ..errors import NeoxPerfError


class RunError(NeoxPerfError):
    """A run dir's data that cannot be used: one line naming the path and the fix. The CLI
    exits with the data-error code (the same as an invalid config), not the usage code."""

    def line(self) -> str:
        return " ".join(str(self).split())


class FromRunError(RunError):
    """Run data `calibrate --from-run` cannot recalibrate from."""
