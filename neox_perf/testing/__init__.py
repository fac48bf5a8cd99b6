"""Running GPT-NeoX's own deepy.py + train.py on a CPU-only machine, for tests and benchmarks.

`neox_cpu` builds the tiny offline dataset, writes the NeoX YAML of a layout, launches
deepy.py (optionally under `neox-perf run`) and parses what NeoX logged; `neox_perf.hooks.neox_train` is the
script deepy.py launches in place of train.py: it applies the CPU shims, then calls NeoX's
own `train.main()`. Nothing here edits or copies NeoX: it needs a checkout
(NEOX_PERF_NEOX_SRC) and a Python that can import it (NEOX_PERF_NEOX_PYTHON).
"""
