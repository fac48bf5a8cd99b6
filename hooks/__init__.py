"""Runtime hooks inside DeepSpeed / GPT-NeoX training runs.

Switched on per job by `neox-perf run -- <launch command>` (or the same environment:
`python -m neox_perf.hooks.activate --run-dir DIR` prints it), the hook wraps
`deepspeed.initialize`, times every iteration on every rank, profiles a few short windows,
maps the profiler's events to the operator decomposition, and reports predicted vs
measured.

Only what runs inside a training rank lives here: settings (the switch),
site/sitecustomize.py (reaches every rank), activate (import hook), attach (wraps
deepspeed.initialize), engine_patch (engine wrappers), session (one rank's state),
engine_facts, neox_args (the config), timing, profiling, trace_map (+ trace_events,
trace_rules: events -> operators), sample_writer, failures. Reading a run dir back (report,
prediction of a run, recalibration) is offline work: neox_perf.runs.
Importing this package imports nothing heavy.
"""
