"""A profile says what network its collectives stand on, and when it was measured (#24 §6)."""
import json
from pathlib import Path

import pytest

from neox_perf.cli import main
from neox_perf.prediction.network import PROBE_ELEMENTS, reading
from neox_perf.prediction.predict import load_cluster

EXAMPLES = Path(__file__).resolve().parents[1] / "neox_perf" / "examples"


def test_the_reading_is_the_profiles_own_all_reduce():
    prof = load_cluster("perlmutter-a100-80gb")
    r = reading(prof)
    t = prof.predict_collective("allreduce", PROBE_ELEMENTS, 2, prof.facts.gpus_per_node).seconds
    ranks = 2 * prof.facts.gpus_per_node
    assert r.allreduce_bus_GBps == pytest.approx(PROBE_ELEMENTS * 2 / t * 2 * (ranks - 1) / ranks / 1e9)
    # the published Perlmutter samples' network: a few GB/s, far below an InfiniBand node's
    assert r.how == "sampled" and r.allreduce_bus_GBps < 10 and "2509.22832" in r.measured
    dgx = reading(load_cluster(str(EXAMPLES / "clusters" / "dgx-a100.yml")))
    assert dgx.how == "link model" and dgx.measured is None and dgx.allreduce_bus_GBps > 10 * r.allreduce_bus_GBps
    # a description on its base's own network stands on the base's samples, and says when
    same = reading(load_cluster("perlmutter-a100"))
    assert same.how == "sampled" and same.measured == r.measured


def test_check_and_clusters_show_it(capsys):
    assert main(["check", str(EXAMPLES / "gpt-20b.yml"), "--gpus", "128", "--cluster", "perlmutter-a100-80gb",
                 "--json"]) in (0, 3)
    net = json.loads(capsys.readouterr().out)["cluster"]["network"]
    assert net["how"] == "sampled" and net["measured"] and net["allreduce_bus_GBps"] > 0
    main(["check", str(EXAMPLES / "gpt-20b.yml"), "--gpus", "128", "--cluster", "perlmutter-a100-80gb"])
    text = " ".join(capsys.readouterr().out.split())
    assert "network" in text and "--cluster dgx-a100" in text  # where to describe today's nodes, from any directory
    assert main(["clusters", "--json"]) == 0
    rows = {p["name"]: p for p in json.loads(capsys.readouterr().out)["profiles"]}
    assert rows["vista-gh200"]["measured"] and rows["vista-gh200"]["network"]["how"] == "sampled"


def test_a_profile_without_collectives_has_no_reading_and_check_still_runs():
    """A profile calibrated for a 1-GPU config samples no collective: it has no network to show,
    and `check` of a 1-GPU job on it still predicts (it needs no collective)."""
    from neox_perf.errors import ProfileError

    class NoCollectives:
        def __init__(self, prof):
            self._prof = prof

        def __getattr__(self, name):
            return getattr(self._prof, name)

        def predict_collective(self, kind, *args):
            raise ProfileError("mine", f"profile mine has no model for {kind}", "calibrate it")

    assert reading(NoCollectives(load_cluster("perlmutter-a100-80gb"))) is None
