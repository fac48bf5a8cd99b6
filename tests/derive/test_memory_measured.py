"""check's per-stage memory against what the hook measured on real runs (CPU, fp32): GPT-NeoX's
own train.py on every harness layout and on layouts taking other code paths (RMSNorm, GQA,
SwiGLU, dropout, partial rotary, long sequences, ZeRO-1 under the pipeline engine), and the
reference workload. The fixture holds what each run recorded -- its config as the hook saw it,
the engine's facts, and per stage the peak of live tensor bytes and what was live at it -- and
is rewritten by `benchmarks/memory_table.py --fixture tests/derive/memory_measured.json`
(tests/neox/test_neox_live.py holds fresh NeoX runs to the same bounds).

Beside the issue's bounds (3% per stage, 5% per component), every component must agree to
0.1% of its stage's peak: the prediction reproduces these measurements to a few KB, so a tensor
left out of (or kept too long in) the prediction or the measurement -- one block's context,
its rotary halves, 0.5 MB on these layouts -- fails here, however small its share."""
import json
from pathlib import Path

import pytest

from neox_perf.runs import prediction
from neox_perf.runs.memory import error

FIXTURE = Path(__file__).with_name("memory_measured.json")
RUNS = json.loads(FIXTURE.read_text())["runs"]
STAGE, COMPONENT = 0.03, 0.05
EXACT = 0.001  # of the stage's peak, for every component
# The reference workload makes its own synthetic batches: its data generator keeps tensors
# NeoX's loader does not (a vocabulary-sized token distribution, a cached mask), 0.03-0.1 MB
# of "other" the NeoX prediction does not model (benchmarks/memory_table.WORKLOAD_OWN).
WORKLOAD_OWN = {"other"}


@pytest.mark.parametrize("run", RUNS, ids=[r["name"] for r in RUNS])
def test_predicted_peak_per_stage_and_component(run):
    _, derived, notes = prediction.rebuild(run["config"], run["facts"])
    assert derived is not None, notes
    for stage, measured in run["stages"].items():
        mem = derived.stages[int(stage)].memory
        total = measured["peak_bytes"]
        assert abs(error(mem.total, total)) <= STAGE, (stage, mem.total, total)
        for comp, m in measured["at_peak"].items():
            p = mem.peak[comp]
            assert abs(p - m) <= EXACT * total, (stage, comp, p, m, mem.peak_moment,
                                                 measured["moment"])
            if run["name"].startswith("workload") and comp in WORKLOAD_OWN:
                continue
            assert abs(error(p, m, total)) <= COMPONENT, (stage, comp, p, m)


def test_the_fixture_covers_what_the_issue_asks():
    names = {r["name"] for r in RUNS}
    assert {"pp0", "pp1", "pp2", "mp2", "zero1", "ckpt"} <= names  # every NeoX harness layout
    assert any(n.startswith("workload") for n in names)
    stages = {(r["name"], s) for r in RUNS for s in r["stages"]}
    assert ("pp2", "0") in stages and ("pp2", "1") in stages  # first and last stages
    from neox_perf.config.neox_keys import KEYS
    values = [r["config"]["values"] for r in RUNS]  # the keys that differ from NeoX's defaults

    def seen(key):
        return {v.get(key, KEYS[key][1]) for v in values}
    assert seen("pos_emb") >= {"rotary", "learned"} and seen("no_weight_tying") == {True, False}
    assert seen("checkpoint_activations") == {True, False} and seen("norm") >= {"layernorm", "rmsnorm"}
