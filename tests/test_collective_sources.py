"""Each correction applies only to what it was fitted against (issue 30): the data-parallel
fabric term rides on link-model prices alone, never on collectives sampled on the cluster's own
fabric; it stops growing past the widest group it was fitted on; every priced collective says
where its price came from; and the bundled sampled profile does not move without a measured run."""
import json
from pathlib import Path

import pytest
import yaml

from neox_perf.prediction.predict import load_cluster, predict
from neox_perf.predictors.fitting import devset
from neox_perf.prediction.collective_sources import LINK_MODEL, SAMPLED
from neox_perf.prediction.corrections import FABRIC_NODES_FITTED, StepTerms, fabric_nodes

from cli.cli_run import check_json

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "neox_perf" / "examples"
VTRAIN = REPO / "benchmarks" / "clusters" / "vtrain-a100.yml"
PINS = json.loads((Path(__file__).parent / "pins" / "da1378c_perlmutter_a100.json").read_text())


def test_the_fabric_term_scales_link_model_prices_only():
    t = StepTerms(dp_fabric_per_doubling=0.5)
    assert t.collective("dp_allreduce", 0.1, 8, LINK_MODEL) == pytest.approx(0.1 * (1 + 0.5 * 3))
    # the cluster's own samples already carry the fabric's loss under load
    assert t.collective("dp_allreduce", 0.1, 8, SAMPLED) == pytest.approx(0.1)
    assert t.collective("dp_allgather", 0.1, 8, SAMPLED) == pytest.approx(0.1)
    assert t.collective("dp_allreduce", 0.1, 8, "") == pytest.approx(0.1)  # unknown: as priced


def test_the_fabric_term_stops_growing_past_the_widest_group_it_was_fitted_on():
    t = StepTerms(dp_fabric_per_doubling=0.5)
    at_edge = t.collective("dp_allreduce", 1.0, FABRIC_NODES_FITTED, LINK_MODEL)
    for nodes in (2 * FABRIC_NODES_FITTED, 64, 4096):
        assert fabric_nodes(nodes) == FABRIC_NODES_FITTED
        assert t.collective("dp_allreduce", 1.0, nodes, LINK_MODEL) == pytest.approx(at_edge)


def _run(**kw):
    from test_multi_node import _run as multi_node_run  # the 3.6B model's job, 4 layers here
    return multi_node_run(**{"layers": 4, **kw})


def test_a_group_past_the_fitted_range_is_flagged_and_its_interval_widens():
    profile = load_cluster(str(VTRAIN))
    inside = predict(*devset.build_config(_run(), 8), profile).estimate
    wide = predict(*devset.build_config(_run(gpus=256, dp=256, global_batch=2048), 8), profile).estimate
    assert wide.collective_sources["dp_allreduce"] == LINK_MODEL
    flag = next(f for f in wide.flags if f.what.startswith("dp_allreduce"))
    assert "spans 32" in flag.reason and f"priced at {FABRIC_NODES_FITTED}" in flag.reason
    lo_i, hi_i = inside.interval_seconds
    lo_w, hi_w = wide.interval_seconds
    assert (hi_w - lo_w) / wide.iteration_seconds > (hi_i - lo_i) / inside.iteration_seconds


def test_every_collective_says_where_its_price_came_from():
    """The bundled Perlmutter description has the links its base sampled: its data-parallel
    collectives are the samples'; a DGX A100 description's are its link model's."""
    example = str(EXAMPLES / "gpt-20b.yml")
    _, sampled = check_json(example, "--gpus", "128", "--cluster", "perlmutter-a100")
    _, described = check_json(example, "--gpus", "128", "--cluster",
                              str(EXAMPLES / "clusters" / "dgx-a100.yml"))
    src = sampled["prediction"]["collective_sources"]
    assert src["dp_allreduce"] == SAMPLED and src["mp_allreduce"] == SAMPLED
    assert described["prediction"]["collective_sources"]["dp_allreduce"] == LINK_MODEL
    # with the same terms in both profiles, the sampled fabric is priced as it measured it
    b = sampled["prediction"]["breakdown"]
    assert b["dp_allreduce"] > 0


def _layout_config(tmp_path, example, pp, mp):
    values = yaml.safe_load((EXAMPLES / f"{example}.yml").read_text())
    values = {k: v for k, v in values.items()
              if k.replace("-", "_") not in ("pipe_parallel_size", "model_parallel_size")}
    values.update(pipe_parallel_size=pp, model_parallel_size=mp)
    path = tmp_path / f"{example}-{pp}-{mp}.yml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


@pytest.mark.parametrize("case", sorted(PINS["seconds"]))
def test_the_sampled_perlmutter_profile_stays_where_measured_runs_put_it(tmp_path, case):
    """da1378c was within 5% of measured runs at the paper's layouts on Perlmutter (runs this
    project does not have): a sampled profile does not move without a measured run."""
    example, layout = case.split()
    pp, mp, dp = (int(x) for x in layout.split("-"))
    code, out = check_json(_layout_config(tmp_path, example, pp, mp), "--gpus", str(pp * mp * dp),
                           "--cluster", "perlmutter-a100")
    if out["prediction"] is None:
        # out of memory on the 40 GB nodes as the memory model now reads it (the release that
        # is pinned had another one): the time is pinned where a prediction is made
        assert code == 3 and out["verdict"]["level"] == "fail"
        pytest.skip(f"{case}: refused as out of memory, no prediction to pin")
    pinned = PINS["seconds"][case]
    got = out["prediction"]["iteration_seconds"]
    assert got == pytest.approx(pinned, rel=PINS["tolerance"]), f"{case}: {got:.3f} s vs {pinned:.3f} s"


def test_no_collective_is_priced_faster_than_the_line_rate_of_its_links(monkeypatch):
    from neox_perf.predictors import line_rate, sampled
    profile = load_cluster("perlmutter-a100-80gb")
    facts = profile.facts
    # 1 GiB of fp16 all-reduced across 4 nodes: 2 (N-1)/N of it through each node's NICs
    elements = 2 ** 29
    floor = line_rate.floor_seconds(facts, "allreduce", elements, 4, 4)
    assert floor == pytest.approx(2 * 3 / 4 * elements * 2 / (facts.inter_node_link.bandwidth_gbps * 1e9))
    honest = profile.predict_collective("allreduce", elements, 4, 4)
    assert honest.seconds >= floor and "line rate" not in honest.reason
    # a model that prices it faster than the wire allows (a bogus sample) is raised and flagged
    monkeypatch.setattr(sampled.ClusterProfile, "_collective_seconds", lambda self, *a: floor / 10)
    fresh = load_cluster("perlmutter-a100-80gb")
    fresh._cache.clear()
    fast = fresh.predict_collective("allreduce", elements, 4, 4)
    assert fast.seconds == pytest.approx(floor) and fast.extrapolated and "line rate" in fast.reason
