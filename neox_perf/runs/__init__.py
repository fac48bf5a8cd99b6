"""Offline analysis of a hooked run's directory: no torch, no rich.

The hook (neox_perf.hooks) writes a run dir from inside the training ranks; this package
reads it back afterwards:

files        the run dir's layout (written by the hook, read here)
prediction   the recorded config predicted with neox_perf.predict
report       predicted vs measured (`neox-perf report`)
recalibrate  how far off a profile is on a run; the level correction (`calibrate --from-run`)
merge        a run's samples merged into a calibration store (the refit)
engine_rows  engine-term rows from the run's stage times (the refit)
"""


class FromRunError(Exception):
    """Run data that cannot be used; the message is one line naming the path and the fix."""
