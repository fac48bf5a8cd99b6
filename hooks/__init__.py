"""Runtime hooks inside DeepSpeed / GPT-NeoX training runs.

Switched on per job by `neox-perf run -- <launch command>` (or the same environment:
`python -m neox_perf.hooks.activate --run-dir DIR` prints it), the hook wraps
`deepspeed.initialize`, times every iteration on every rank, profiles a few short windows,
maps the profiler's events to the operator decomposition, and reports predicted vs
measured.

settings (the switch), site/sitecustomize.py (reaches every rank), activate (import hook),
engine_patch (wrappers), session (one rank's state), engine_facts, neox_args (the config),
timing, profiling, trace_map (+ trace_events, trace_rules: events -> operators),
sample_writer, summary (run dir files), prediction, report, recalibrate, failures.
Importing this package imports nothing heavy.
"""
