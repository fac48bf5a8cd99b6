"""The planner's shortcuts against the straightforward path: shared derivation, lower bound,
candidates equal to what `check` predicts for the same layout."""
import dataclasses

import pytest

from neox_perf.config import WorldRequest, build, load_files
from neox_perf.derive import derive
from neox_perf.plan import Candidate, Layout, Planner, divisors, layout_of, rank
from neox_perf.prediction.predict import predict

SMALL = ("num_layers: 12\nhidden_size: 1024\nnum_attention_heads: 16\nseq_length: 1024\n"
         "max_position_embeddings: 1024\ntrain_micro_batch_size_per_gpu: 4\n"
         "gradient_accumulation_steps: 4\npipe_parallel_size: 2\nmodel_parallel_size: 2\n"
         "fp16: {enabled: true}\ncheckpoint_activations: true\ntrain_iters: 1000\n"
         "zero_optimization: {stage: 1, reduce_bucket_size: 50000000}\n")


def cluster():
    from neox_perf.predictors.profile import list_profiles, load_profile
    names = [p.name for p in list_profiles()]
    if not names:
        pytest.skip("no bundled cluster profile")
    return load_profile("vista-gh200" if "vista-gh200" in names else names[0])


def planner(path, **kw):
    profile = cluster()
    return Planner(load_files([path]), profile, 50257, **kw), profile


def test_every_candidate_equals_the_straightforward_path(write_yaml):
    """SharedDerive == derive() and the planned prediction == predict() on every layout."""
    pl, profile = planner(write_yaml("small.yml", SMALL), keep=0)
    plan = pl.run([8])
    assert plan.predicted == plan.admissible > 20  # keep=0: every admissible layout is timed
    for cand in plan.candidates:
        overrides = pl.overrides(cand.layout)
        cfg, verdicts, _ = pl.build(8, overrides)
        assert layout_of(cfg) == cand.layout
        straight = derive(cfg, 50257, profile.facts.gpu_memory_bytes)
        assert pl.shared(cfg) == straight
        pred = predict(cfg, straight, profile)
        assert pred.estimate.iteration_seconds == cand.iteration_seconds
    assert pl.shared.builds < plan.evaluated / 4  # structures really are shared


def test_update_seconds_equal_the_full_prediction(write_yaml):
    """The quick search's gradient sync, optimizer step and parameter all-gather per stage,
    timed alone (predict.update_seconds), == the full prediction's stages, on every layout of a
    plan (ZeRO 0/1/2, pipelines or not), with and without engine terms."""
    from dataclasses import replace as dc_replace
    from neox_perf.prediction.corrections import EngineSection
    from neox_perf.prediction.predict import update_seconds
    pl, profile = planner(write_yaml("small.yml", SMALL), keep=0)
    plan = pl.run([8])

    class WithEngine:  # the profile with engine terms measured in the run's precision
        manifest = dc_replace(profile.manifest, engine=EngineSection.parse({
            "precision": "fp16", "optimizer_step": {"coef": {"t0": 0.5, "per_tensor": 1e-4,
                                                             "per_param": 1e-9}},
            "grad_flatten": {"coef": {"t0": 0.25, "per_param": 1e-10}},
            "zero_step": {"coef": {"t0": 4e-3, "per_param": 2e-9}, "stage": 1, "processes": 2},
            "zero_reduce": {"coef": {"t0": 1e-3, "per_param": 1e-10}, "stage": 1, "processes": 2},
            "dp_arrival": {"fraction": 0.03, "processes": 2}}))

        def __getattr__(self, name):
            return getattr(profile, name)
    zeros, engine_moved, waited = set(), 0, 0
    for cand in plan.candidates:
        cfg, _, _ = pl.build(8, pl.overrides(cand.layout))
        one = pl._one(cfg)
        derived = pl.shared(cfg)
        got = []
        for prof in (profile, WithEngine()):
            full = predict(one, derived, prof).estimate.stages
            got.append(update_seconds(one, derived, prof))
            assert tuple(g[:3] for g in got[-1]) == tuple((t.grad_allreduce, t.optimizer, t.param_allgather)
                                                          for t in full)
            # one micro-batch: the replicas' wait per second of the stage's work
            assert [g[3] for g in got[-1]] == pytest.approx([t.dp_wait / (t.forward + t.backward)
                                                             for t in full], rel=1e-12)
        zeros.add(cand.layout.zero_stage)
        engine_moved += got[0] != got[1]
        waited += cand.layout.data_parallel_size > 1 and all(g[3] > 0 for g in got[1]) and not any(g[3] for g in got[0])
    assert zeros == {0, 1, 2} and engine_moved == len(plan.candidates)
    assert waited == sum(c.layout.data_parallel_size > 1 for c in plan.candidates) > 0


def test_lower_bound_never_exceeds_the_timeline(write_yaml):
    pl, _ = planner(write_yaml("small.yml", SMALL), keep=0)
    plan = pl.run([8, 16])
    batch = plan.global_batch
    checked = 0
    for cand in plan.candidates:
        cfg, _, _ = pl.build(cand.layout.gpus, pl.overrides(cand.layout))
        bound = pl.bound(cfg, pl.shared(cfg), batch)
        assert bound <= cand.seconds_per_batch
        checked += 1
    assert checked > 50


def test_pruned_plan_keeps_the_exact_top_and_baseline_rank(write_yaml):
    path = write_yaml("small.yml", SMALL)
    full = planner(path, keep=0)[0].run([8, 16])
    pruned = planner(path, keep=5)[0].run([8, 16])
    assert pruned.bounded > 0 and pruned.predicted < full.predicted
    assert [c.layout for c in pruned.candidates[:5]] == [c.layout for c in full.candidates[:5]]
    assert [b.rank for b in pruned.baselines] == [b.rank for b in full.baselines]
    assert ({c.layout for c in pruned.candidates if c.pareto}
            == {c.layout for c in full.candidates if c.pareto})


def test_space_follows_neox_rules(write_yaml):
    pl, _ = planner(write_yaml("small.yml", SMALL.replace("num_attention_heads: 16",
                                                          "num_attention_heads: 12")
                               .replace("hidden_size: 1024", "hidden_size: 1536")))
    pl._prepare([24])
    layouts = list(pl.space(24, 96))
    assert {l.data_parallel_size * l.num_stages * l.model_parallel_size for l in layouts} == {24}
    assert all(l.train_batch_size == 96 for l in layouts)  # 96 divides by every dp of 24 GPUs
    assert {0, 1} <= {l.pipe_parallel_size for l in layouts}
    assert all(l.zero_stage < 2 or (l.pipe_parallel_size == 0 and l.model_parallel_size == 1)
               for l in layouts)
    assert any(l.zero_stage == 2 for l in layouts)
    plan = pl.run([24])
    mps = {c.layout.model_parallel_size for c in plan.candidates}
    assert mps and all(12 % mp == 0 for mp in mps)
    assert plan.rejected.get("heads_divisible_by_mp", 0) > 0  # mp 8 and 24 divide 24, not 12


# 38B parameters: no layout of 8 GPUs fits
BIG = (SMALL.replace("num_layers: 12", "num_layers: 48").replace("hidden_size: 1024", "hidden_size: 8192")
       .replace("num_attention_heads: 16", "num_attention_heads: 64"))


def test_closest_layout_is_the_least_memory_of_every_layout(write_yaml):
    """The branch and bound naming the layout that comes closest to fitting == the minimum over
    every out-of-memory layout derived in full by derive() (the first of equals: layouts whose
    partition methods cut the same stages tie), and it derives a fraction of their stages."""
    pl, profile = planner(write_yaml("big.yml", BIG), keep=2)
    pl._prepare([8])
    batch, _ = pl.global_batch([8])
    stopped = []
    for layout in pl.space(8, batch):
        if pl._structural(layout) is not None:
            continue
        cfg, verdicts, _ = pl.build(8, pl.overrides(layout))
        if pl.refuse(cfg, verdicts) is not None:
            continue
        memories = {}
        assert pl.shared(cfg, stop_above=pl.memory_limit * pl.usable, memories=memories) is None
        stopped.append((cfg, memories))
    totals = [max(s.memory.device_total for s in derive(cfg, 50257, profile.facts.gpu_memory_bytes).stages)
              for cfg, _ in stopped]
    least = min(range(len(totals)), key=totals.__getitem__)
    assert totals.count(totals[least]) > 1  # equals to choose among
    before = sum(len(m) for _, m in stopped)
    fraction, cfg = pl.closest(stopped)
    assert cfg is stopped[least][0] and fraction == totals[least] / pl.usable > pl.memory_limit
    stages = sum(c.parallel.num_stages for c, _ in stopped)
    assert sum(len(m) for _, m in stopped) - before < (stages - before) / 4


def test_nearest_global_batch_is_a_difference(write_yaml):
    text = SMALL.replace("train_micro_batch_size_per_gpu: 4\ngradient_accumulation_steps: 4\n",
                         "train_batch_size: 100\n")
    pl, _ = planner(write_yaml("b.yml", text), keep=0)
    plan = pl.run([8])
    assert plan.global_batch == 100
    diffs = {c.layout.data_parallel_size: c.batch_difference for c in plan.candidates}
    for dp, diff in diffs.items():
        assert (100 + diff) % dp == 0
        assert abs(diff) <= dp / 2  # the nearest multiple of dp


def test_overrides_leave_out_unchanged_keys(write_yaml):
    pl, _ = planner(write_yaml("small.yml", SMALL))
    pl._prepare([8])
    cfg, _, _ = pl.build(8)
    assert pl.overrides(layout_of(cfg)) == {}
    other = dataclasses.replace(layout_of(cfg), zero_stage=0, checkpoint_activations=False)
    over = pl.overrides(other)
    assert set(over) == {"zero_optimization", "checkpoint_activations"}
    assert over["zero_optimization"] == {"stage": 0, "reduce_bucket_size": 50000000}


def _cand(t, gpus, name):
    layout = Layout(gpus, 1, 1, gpus, 1, 1, True, 0, name)
    return Candidate(layout, t, None, 1.0, None, 0.5, True, "compute", t, t * 10, t * 10 * gpus / 3600,
                     0)


def test_rank_and_pareto_front():
    cands = [_cand(3.0, 8, "a"), _cand(1.0, 64, "b"), _cand(2.0, 8, "c"), _cand(1.5, 64, "d")]
    rank(cands)
    assert [c.layout.pipe_partition_method for c in cands] == ["b", "d", "c", "a"]
    assert [c.rank for c in cands] == [1, 2, 3, 4]
    # b fastest; d slower and dearer than b; c cheaper than b; a slower and dearer than c
    assert [c.pareto for c in cands] == [True, False, True, False]


def test_divisors():
    assert divisors(1) == [1]
    assert divisors(96) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]


def test_shipped_20b_candidates_match_check(neox_configs):
    """On the real NeoX 20B config: every timed layout equals its straightforward prediction."""
    profile = cluster()
    raw = load_files([str(neox_configs / "20B.yml")])
    pl = Planner(raw, profile, 50277, keep=3, max_micro_batch=2)
    plan = pl.run([64])
    assert plan.candidates
    for cand in plan.candidates[:3] + [b.candidate for b in plan.baselines if b.candidate]:
        cfg, _, _ = build(raw if not pl.overrides(cand.layout) else
                          _merged(raw, pl.overrides(cand.layout)), WorldRequest(gpus=64),
                          profile.facts.gpus_per_node)
        d = derive(cfg, 50277, profile.facts.gpu_memory_bytes)
        assert predict(cfg, d, profile).estimate.iteration_seconds == cand.iteration_seconds


def _merged(raw, overrides):
    from neox_perf.config.loader import RawConfig
    values = dict(raw.values)
    values.update(overrides)
    return RawConfig(values=values, sources=dict(raw.sources), warnings=[], files=list(raw.files))


def test_timeline_stream_memo_is_bit_identical():
    """Layouts that differ only after the last backward reuse one simulated stream."""
    from neox_perf.prediction import timeline as T
    base = [T.StageCost(0.01 + 0.001 * s, 0.02, 0.001, 0.0015, 0.3,
                        tied_allreduce=0.01 if s in (0, 3) else 0.0, optimizer=0.01,
                        param_allgather=0.02) for s in range(4)]
    other = [dataclasses.replace(c, grad_allreduce=0.1 * (c.forward > 0.011), optimizer=0.002,
                                 param_allgather=0.0) for c in base]
    T._STREAMS.clear()
    fresh = T.simulate_1f1b(other, 9)
    T._STREAMS.clear()
    T.simulate_1f1b(base, 9)
    reused = T.simulate_1f1b(other, 9)
    assert len(T._STREAMS) == 1
    assert reused == fresh and reused.events == fresh.events
    assert dict(reused.components) == dict(fresh.components)


def _with_arrival(profile, fraction):
    """The profile with engine terms in the run's precision, the replicas' wait among them."""
    from dataclasses import replace as dc_replace
    from neox_perf.prediction.corrections import EngineSection
    section = {"precision": "fp16", "optimizer_step": {"coef": {"t0": 1e-3}},
               **({"dp_arrival": {"fraction": fraction, "processes": 2}} if fraction else {})}

    class WithEngine:
        manifest = dc_replace(profile.manifest, engine=EngineSection.parse(section))

        def __getattr__(self, name):
            return getattr(profile, name)
    return WithEngine()


def test_the_quick_search_counts_the_replicas_wait(write_yaml):
    """check's quick search (near=) estimates a layout from one micro-batch's stage times: with
    replicas that wait for the slowest (dp_arrival) a data-parallel layout's estimate grows by
    what the full prediction adds, and one without data parallelism does not move. (One stage:
    past it the estimate is the pipeline's drain, which the tails do not extend.)"""
    path = write_yaml("small.yml", SMALL)
    profile = cluster()
    plain, waits = _with_arrival(profile, 0.0), _with_arrival(profile, 0.05)
    cfg0, _, _ = Planner(load_files([path]), plain, 50257).build(8, {})
    near = layout_of(cfg0)
    checked = {True: 0, False: 0}
    for dp, pp, mp in ((8, 1, 1), (4, 1, 2), (2, 1, 4), (1, 1, 8)):
        quick, full = [], []
        for prof in (plain, waits):
            pl = Planner(load_files([path]), prof, 50257, near=near, keep=2)
            cfg, _, _ = pl.build(8, {"pipe_parallel_size": pp, "model_parallel_size": mp})
            assert cfg.parallel.data_parallel_size == dp
            batch = cfg.training.train_batch_size
            quick.append(pl.bound(cfg, pl.shared(cfg), batch))
            full.append(predict(cfg, pl.shared(cfg), prof).estimate.iteration_seconds)
        if dp == 1:
            assert quick[1] == quick[0] and full[1] == full[0]
        else:
            assert full[1] > full[0] and quick[1] - quick[0] == pytest.approx(full[1] - full[0], rel=0.01)
        checked[dp > 1] += 1
    assert checked == {True: 3, False: 1}
