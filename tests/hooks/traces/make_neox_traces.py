"""Record the GPT-NeoX traces trace_map's tests read: NeoX's own train.py, tiny layouts.

    NEOX_PERF_NEOX_SRC=/path/to/gpt-neox NEOX_PERF_NEOX_PYTHON=/path/to/venv/bin/python \\
    OMP_NUM_THREADS=1 python tests/hooks/traces/make_neox_traces.py

Each layout trains a few iterations with NeoX's deepy.py under `neox-perf run` (the harness in
neox_perf.testing.neox_cpu); the hook saves its profiling window's events
(PYTHON_NEOX_PERF_TRACE_DUMP) exactly as it mapped them, with its MapContext. Kept: rank 0,
trimmed as make_traces.py trims (trivial leaves, the optimizer's inner ops), JSON.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

from neox_perf.hooks.trace_map import Event  # noqa: E402
from neox_perf.testing import neox_cpu  # noqa: E402

TRIVIAL = {"aten::empty", "aten::as_strided", "aten::resolve_conj", "aten::empty_strided",
           "aten::empty_like", "detach", "aten::resize_", "aten::fill_", "aten::zero_",
           "aten::detach", "aten::lift_fresh", "aten::_local_scalar_dense", "aten::item",
           "aten::is_nonzero"}
WINDOWS = "skip=2,warmup=1,active=1,every=100000,repeat=1"
TINY = dict(micro=1, layers=1, hidden=32, heads=2, seq=16, iters=5)
LAYOUTS = {
    "neox_pp1_rotary.json": neox_cpu.Layout("trace_pp1", gpus=1, pp=1, gas=2, pos_emb="rotary",
                                            tied=False, **TINY),
    "neox_mp2_learned.json": neox_cpu.Layout("trace_mp2", gpus=2, pp=0, mp=2, gas=1,
                                             pos_emb="learned", tied=True, **TINY),
}


def _shapes_read(name: str) -> bool:
    from neox_perf.hooks import trace_rules as r
    return (name in r.RULES or name in r.FORWARD_ONLY_RULES or name in r._FUSED
            or bool(r.COLLECTIVE_EVENT.match(name)) or bool(r._VOCAB_CE.search(name))
            or name in ("aten::expand_as", "aten::expand"))


def trim(events):
    parents = {e.parent for e in events}
    by_id = {e.id: e for e in events}

    def inside_optimizer(e):
        while e.parent is not None:
            e = by_id[e.parent]
            if e.name.startswith("Optimizer.step#"):
                return True
        return False
    kept = [e for e in events
            if not ((e.name in TRIVIAL and e.seq < 0 and e.id not in parents) or inside_optimizer(e))]
    t0 = min(e.start for e in kept)
    threads = {t: i for i, t in enumerate(sorted({e.thread for e in kept}))}
    out = []
    for e in kept:
        d = e.to_dict()
        # 0.1 us is finer than the profiler's own resolution on CPU; keeps files < 200 KB
        d["start"] = round(e.start - t0, 1)
        d["dur"] = round(e.dur, 1)
        d["thread"] = threads[e.thread]
        if d.get("fwd_thread"):
            d["fwd_thread"] = threads.get(e.fwd_thread, e.fwd_thread)
        d.pop("concrete", None)
        if not _shapes_read(e.name):
            d.pop("shapes", None)  # no rule reads them: only the size of the file changes
        out.append(d)
    return out


def main() -> int:
    neox_cpu.neox_src()
    with tempfile.TemporaryDirectory() as tmp:
        for name, lay in LAYOUTS.items():
            dump = Path(tmp) / "dump" / lay.name
            os.environ["PYTHON_NEOX_PERF_TRACE_DUMP"] = str(dump)
            run = neox_cpu.run_layout(lay, tmp, hook_dir=str(Path(tmp) / "runs" / lay.name),
                                      windows=WINDOWS)
            if not run.ok:
                print(run.tail(30))
                return 1
            data = json.loads((dump / "rank0-window0.json").read_text())
            events = trim([Event.from_dict(e) for e in data["events"]])
            out = {"schema": "neox-perf.trace/1", "generator": "tests/hooks/traces/make_neox_traces.py",
                   "description": f"GPT-NeoX train.py, {lay.describe()}, {lay.layers} layer h{lay.hidden} "
                                  f"s{lay.seq} b{lay.micro}: one profiled iteration, rank 0",
                   "neox_logged_params": run.logged_params, "context": data["context"],
                   "events": events}
            (HERE / name).write_text(json.dumps(out, separators=(",", ":")) + "\n")
            print(f"{name}: {len(events)} events, {(HERE / name).stat().st_size // 1024} KB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
