"""Step terms: what a real step adds to the operator sum, their fit, and the interval."""
import dataclasses

import numpy as np
import pytest

from neox_perf.prediction.estimate import estimate
from neox_perf.prediction.predict import load_cluster, predict
from neox_perf.predictors.fitting import devset, step_fit
from neox_perf.profile.manifest import Manifest
from neox_perf.prediction.corrections import FITTED, REGIMES, Interval, StepTerms, StepTermsSection, of_profile


def _run(**kw):
    base = dict(gpus=4, global_batch=8, micro_batch=2, hidden=1024, heads=16, layers=4, seq_len=1024,
                tp=1, dp=2, pp=2, seconds=1.0)
    base.update(kw)
    return devset.Run(**base)


@pytest.fixture(scope="module")
def profile():
    return load_cluster("perlmutter-a100-80gb")


@pytest.fixture(scope="module")
def cases(profile):
    runs = [_run(tp=tp, dp=dp, pp=pp, micro_batch=mb, hidden=h, global_batch=8 * dp)
            for tp, dp, pp in ((1, 2, 2), (2, 1, 2), (1, 4, 1), (2, 2, 1), (1, 1, 4))
            for mb in (1, 4) for h in (1024, 2048)]
    return step_fit.prepare(runs, lambda r: devset.build_config(r, profile.facts.gpus_per_node))


def test_terms_refuse_negative_and_unknown():
    with pytest.raises(ValueError, match="dispatch_s"):
        StepTerms(dispatch_s=-1e-6)
    with pytest.raises(ValueError, match="unknown step terms"):
        StepTerms.from_dict({"warp_speed": 1.0})
    assert StepTerms().identity and not StepTerms(step_s=0.1).identity


def test_operator_semantics():
    t = StepTerms(compute_scale=1.1, memory_scale=1.5, dispatch_s=5e-5)
    assert t.operator("linear1", 1e-3) == pytest.approx(1.1e-3)
    assert t.operator("layernorm", 1e-3) == pytest.approx(1.5e-3)
    assert t.operator("layernorm", 1e-6) == pytest.approx(1.5e-6)  # the device's own time only
    # a run of calls: the host issues 10 calls while the device works 1 ms -- the device is the
    # bound; 40 calls of the same work take the host 2 ms and the device waits for it
    assert t.issued(1e-3, 10) == pytest.approx(1e-3)
    assert t.issued(1e-3, 40) == pytest.approx(2e-3)
    # where host and device are close, neither hides the other entirely: the p-norm of the two
    q = dataclasses.replace(t, queue_coupling=0.2)
    assert q.issued(1e-3, 20) == pytest.approx(1e-3 * 2 ** 0.2)  # equal: 15% over either
    assert 2e-3 < q.issued(1e-3, 40) < 2e-3 * 1.01  # one twice the other: the max, nearly
    assert q.issued(1e-3, 0) == pytest.approx(1e-3)  # nothing issued by the host: the device
    assert dataclasses.replace(t, queue_coupling=1.0).issued(1e-3, 20) == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="queue_coupling"):
        StepTerms(queue_coupling=-0.1)
    # a tensor-parallel all-reduce is priced as sampled or linked: no step term rides on it
    assert StepTerms(p2p_s=1e-3, dispatch_s=1e-5).collective("mp_allreduce", 1e-4) == 1e-4


def test_a_retired_term_reads_as_absent_at_zero_and_refuses_a_value():
    """tp_sync_s (a fixed wait per tensor-parallel all-reduce) is no longer priced: sections
    written with it at 0 still load, one that gives it a value was fitted with it and says so."""
    assert StepTerms.from_dict({"dispatch_s": 7e-5, "tp_sync_s": 0.0}) == StepTerms(dispatch_s=7e-5)
    with pytest.raises(ValueError, match="tp_sync_s is no longer priced"):
        StepTerms.from_dict({"tp_sync_s": 1.9e-4})


def test_a_layer_phase_is_a_host_queue(profile, cases):
    """Within a layer phase the host runs ahead: the phase takes the longer of its kernels and
    its issue time, not the sum of per-call floors; its collectives add; the breakdown names
    the host's share so the operators still add up to the stage."""
    from neox_perf.prediction.estimate import _Cache
    from neox_perf.prediction.operators import OpCall
    c = next(c for c in cases if c.key == (2, 1, 2))
    work = c.decomposition.stages[0]
    terms = StepTerms(dispatch_s=2e-4)
    cache = _Cache(profile, None, terms)
    calls = work.layer_forward
    ops = [x for x in calls if isinstance(x, OpCall)]
    device = sum(cache.time(x) * x.count for x in ops)
    launches = sum(x.launches * x.count for x in ops)
    comm = sum(cache.time(x) * x.count for x in calls if not isinstance(x, OpCall))
    assert comm > 0  # tensor-parallel all-reduces
    assert cache.total(calls) == pytest.approx(max(device, launches * 2e-4) + comm)
    per_call_floor = sum(max(cache.time(x), x.launches * 2e-4) * x.count for x in ops) + comm
    assert cache.total(calls) < per_call_floor  # long kernels hide the issue of short ones
    est = estimate(c.decomposition, profile, terms)
    assert any(k.startswith("host dispatch") for k in est.operators)
    assert not any(k.startswith("host dispatch")
                   for k in estimate(c.decomposition, profile, StepTerms()).operators)


def test_identity_terms_change_nothing(profile, cases):
    for c in cases[:4]:
        plain = estimate(c.decomposition, profile, StepTerms())
        assert plain.iteration_seconds == estimate(c.decomposition, profile, StepTerms()).iteration_seconds
        slower = estimate(c.decomposition, profile, StepTerms(dispatch_s=1e-4, micro_batch_s=1e-3))
        assert slower.iteration_seconds > plain.iteration_seconds


def test_linearisation_is_exact_where_the_path_holds(profile, cases):
    at = StepTerms(dispatch_s=2e-5, p2p_s=1e-4)
    F, c0 = step_fit.linearise(cases, profile, at)
    moved = dataclasses.replace(at, micro_batch_s=2e-3, step_s=1e-2)  # purely additive terms
    theta = np.array([getattr(moved, n) for n in FITTED])
    lin, real = c0 + F @ theta, step_fit.predict_all(cases, profile, moved)
    # balanced pipelines keep their critical path; the 4-stage one (a layer per stage, the head
    # on the last) moves it -- which is why the fit re-linearises at every round
    balanced = np.array([c.key[2] <= 2 for c in cases])
    assert np.allclose(lin[balanced], real[balanced], rtol=1e-6)
    assert np.all(lin[~balanced] <= real[~balanced] * (1 + 1e-9))  # max-plus: convex in the terms


def test_fit_recovers_known_terms(profile, cases, monkeypatch):
    monkeypatch.setattr(step_fit, "PRIOR_RUNS", 0.0)  # 20 exact runs: nothing for a prior to add
    truth = StepTerms(compute_scale=1.05, memory_scale=1.2, dispatch_s=4e-5, micro_batch_s=1.5e-3,
                      pipeline_micro_batch_s=1e-3, step_s=5e-3, queue_coupling=0.25)
    seconds = step_fit.predict_all(cases, profile, truth)
    synthetic = [dataclasses.replace(c, measured=float(s)) for c, s in zip(cases, seconds)]
    fitted = step_fit.fit(synthetic, profile)
    again = step_fit.predict_all(synthetic, profile, fitted)
    assert np.max(np.abs(again / seconds - 1)) < 0.01
    assert fitted.micro_batch_s + fitted.pipeline_micro_batch_s > 1e-3
    assert 0.1 < fitted.queue_coupling < 0.5


def test_a_step_that_raises_the_real_loss_is_not_taken(profile, cases, monkeypatch):
    """The fit steps on a linearisation; where the real path bends away from it, the step is
    halved: the real loss never rises."""
    truth = StepTerms(dispatch_s=6e-5, micro_batch_s=1e-3, queue_coupling=0.3)
    measured = step_fit.predict_all(cases, profile, truth)
    synthetic = [dataclasses.replace(c, measured=float(s)) for c, s in zip(cases, measured)]
    real = step_fit.predict_all
    # a linearisation that overshoots: every solve asks for the far bound of the coupling
    solve = step_fit.solve
    monkeypatch.setattr(step_fit, "solve", lambda F, c0, m, names=FITTED, rounds=50: np.where(
        np.array(names) == "queue_coupling", 1.0, solve(F, c0, m, names, rounds)))
    start = StepTerms(dispatch_s=6e-5, micro_batch_s=1e-3, queue_coupling=0.1)
    fitted = step_fit.fit(synthetic, profile, rounds=3, start=start)
    assert fitted.queue_coupling < 1.0  # the full step was never taken
    start_loss = step_fit.loss(measured, real(synthetic, profile, start))
    assert step_fit.loss(measured, real(synthetic, profile, fitted)) <= start_loss


def test_solve_is_not_pulled_by_a_few_runs_no_term_explains(monkeypatch):
    """Two parameters, 40 runs on the line, 4 runs 30% off: the soft-L1 fit stays near the
    line where squared error moves off it; and bounds hold (the prior, which would pull the
    5-sd dispatch_s here, is another test's)."""
    from scipy.optimize import lsq_linear
    monkeypatch.setattr(step_fit, "PRIOR_RUNS", 0.0)
    rng = np.random.default_rng(0)
    names = ("compute_scale", "dispatch_s")
    truth = np.array([1.1, 1e-4])
    F = np.column_stack([rng.uniform(0.5, 2.0, 44), rng.uniform(100, 2000, 44)])
    c0 = rng.uniform(0.0, 0.2, 44)
    measured = c0 + F @ truth
    measured[:4] *= 1.3  # runs the model cannot explain
    got = step_fit.solve(F, c0, measured, names)
    lo = [step_fit.BOUNDS[n][0] for n in names]
    hi = [step_fit.BOUNDS[n][1] for n in names]
    squared = lsq_linear(F / measured[:, None], 1 - c0 / measured, bounds=(lo, hi)).x
    # soft-L1 is not redescending: the outliers still lean on it, a third as hard at most
    assert np.all(np.abs(got / truth - 1) < np.abs(squared / truth - 1) / 3)
    assert got == pytest.approx(truth, rel=0.1)

    def clean_error(theta):
        return np.median(np.abs((c0 + F @ theta) / measured - 1)[4:])
    assert clean_error(got) < 0.005 < clean_error(squared)
    # a term the data would drive negative stops at its bound
    assert step_fit.solve(F, c0 + 10.0, measured, names)[1] == 0.0


def test_cross_validation_predicts_every_held_out_group(profile, cases):
    at = StepTerms(dispatch_s=3e-5)
    cv = step_fit.cross_validate(cases, profile, at)
    assert not np.isnan(cv.predicted).any()
    assert set(cv.terms) == {c.key for c in cases}


def test_interval_covers_what_it_promises():
    rng = np.random.default_rng(0)
    predicted = np.ones(2000)
    measured = np.exp(rng.normal(0.0, 0.1, 2000))
    iv = step_fit.interval_from_residuals(measured, predicted)
    inside = (measured >= iv["lo_ratio"]) & (measured <= iv["hi_ratio"])
    assert 0.78 <= inside.mean() <= 0.82
    lo, hi = Interval.from_dict(iv).around(10.0, extrapolated_share=0.0)
    assert lo < 10.0 < hi
    wide = Interval.from_dict({**iv, "widen_per_extrapolated": 0.5}).around(10.0, 1.0)
    assert wide[0] < lo and wide[1] > hi


def test_bundled_profile_carries_fitted_terms_and_interval():
    prof = load_cluster("perlmutter-a100-80gb")
    terms, intervals = of_profile(prof)
    assert not terms.identity, "run benchmarks/endtoend.py --write-terms to fit the step terms"
    for regime in REGIMES:
        interval = intervals.of(regime)
        assert interval.lo_ratio < 1 < interval.hi_ratio
    section = prof.manifest.to_dict()["step_terms"]
    assert section["cross_validation"]["by_layout"]["runs"] > 0


def test_devset_rows_read_as_neox_configs(profile):
    cfg, derived = devset.build_config(_run(tp=2, dp=1, pp=2, global_batch=8), profile.facts.gpus_per_node)
    assert cfg.parallel.model_parallel_size == 2 and cfg.parallel.num_stages == 2
    assert cfg.training.gradient_accumulation_steps == 4
    assert derived.padded_vocab == 50432  # 50257 padded to a multiple of 128 * mp
    # Megatron-DeepSpeed's dropout 0.1: the attention probabilities are dropped out, per rank
    p = predict(cfg, derived, profile)
    drops = [c for c in p.decomposition.stages[0].layer_forward if getattr(c, "op", "") == "attn_dropout"]
    assert [c.feature_dict() for c in drops] == [{"batch": 2 * 16 / 2, "l": 1024.0}]  # b*heads/tp
    est = p.estimate
    assert est.iteration_seconds > 0 and est.interval_seconds is not None
    # Megatron-DeepSpeed's GPTModelPipe splits the transformer layers evenly: its transposes
    # are lambdas, which 'type:transformer' does not count, unlike NeoX's block functions
    from neox_perf.prediction.operators import stage_shapes
    _, derived = devset.build_config(_run(gpus=4, tp=1, dp=1, pp=4, layers=12, global_batch=8),
                                     profile.facts.gpus_per_node)
    assert [s.transformer_layers for s in stage_shapes(derived)] == [3, 3, 3, 3]


def test_vtrain_runs_load_when_shared_is_present():
    try:
        runs = devset.load_vtrain()
    except FileNotFoundError:
        pytest.skip("../shared/data/vtrain-a100 not present")
    assert len(runs) == 1440
    assert {r.gpus for r in runs} == {2, 4, 8} and all(r.tp * r.dp * r.pp == r.gpus for r in runs)


def test_refit_moves_only_the_named_terms(profile, cases):
    base = StepTerms(dispatch_s=3e-5, memory_scale=1.1)
    truth = dataclasses.replace(base, micro_batch_s=4e-3)
    seconds = step_fit.predict_all(cases[:3], profile, truth)
    runs = [dataclasses.replace(c, measured=float(s)) for c, s in zip(cases[:3], seconds)]
    got = step_fit.refit(runs, profile, base, ["micro_batch_s"])
    assert got.micro_batch_s == pytest.approx(4e-3, rel=0.02)
    assert (got.dispatch_s, got.memory_scale) == (base.dispatch_s, base.memory_scale)
    with pytest.raises(ValueError, match="unknown"):
        step_fit.refit(runs, profile, base, ["nonsense"])


def test_interval_widens_on_a_gpu_the_terms_were_not_fitted_on():
    class P:
        def __init__(self, gpu):
            self.facts = type("F", (), {"gpu_name": gpu})()
            self.manifest = Manifest("p", step_terms=StepTermsSection.parse(
                {"terms": {"dispatch_s": 1e-5}, "interval": {"lo_ratio": 0.9, "hi_ratio": 1.1},
                 "fitted_gpu": "NVIDIA A100-SXM4-80GB", "other_gpu_widen": 0.1}))
    _, same = of_profile(P("A100-SXM4-80GB"))
    _, other = of_profile(P("NVIDIA GH200 120GB"))
    for regime in REGIMES:  # an older section's one interval serves every regime
        assert (same.of(regime).lo_ratio, same.of(regime).hi_ratio) == (0.9, 1.1)
        assert other.of(regime).lo_ratio == pytest.approx(0.9 / 1.1)
        assert other.of(regime).hi_ratio == pytest.approx(1.21)


def test_the_prior_keeps_a_term_the_runs_cannot_see_at_its_centre(profile, cases):
    """Runs that cannot tell two terms apart put the difference where the prior says it is
    cheapest, and leave a term no run depends on at the prior's centre: a fit on one model class
    (BLOOM's layout search) does not bend a term it cannot identify to its bound, and takes the
    host's measured cost per call (step_fit.HOST_CALL_S), not a host that costs nothing."""
    truth = StepTerms(compute_scale=1.1)
    seconds = step_fit.predict_all(cases, profile, truth)
    synthetic = [dataclasses.replace(c, measured=float(s)) for c, s in zip(cases, seconds)]
    F, c0 = step_fit.linearise(synthetic, profile, StepTerms())
    # one more column that no run depends on: only the prior decides it
    names = step_fit.FITTED
    flat = names.index("dp_fabric_per_doubling")
    F[:, flat] = 0.0
    theta = step_fit.solve(F, c0, np.array(seconds))
    assert theta[flat] == pytest.approx(0.0, abs=1e-9)
    host = names.index("dispatch_s")
    F[:, host] = 0.0  # no run host-bound: the measured cost, not 0
    theta = step_fit.solve(F, c0, np.array(seconds))
    assert theta[host] == pytest.approx(step_fit.HOST_CALL_S, rel=1e-6) and step_fit.HOST_CALL_S > 0
    centre = step_fit.PRIOR_CENTER
    assert step_fit.prior_cost(centre) == pytest.approx(0.0, abs=1e-20) and step_fit.prior_cost(StepTerms()) > 0.0
    assert step_fit.prior_cost(dataclasses.replace(centre, memory_scale=1.2)) == pytest.approx(
        step_fit.PRIOR_RUNS * step_fit.ROBUST_SCALE ** 2)



def test_runs_share_tells_a_term_the_runs_pin_from_one_they_cannot_see(profile, cases):
    """runs_share: 0 where only the prior speaks, less where two terms look alike to the runs,
    and the host's per-launch cost seen by small models' runs far more than by large ones'
    (the BLOOM layout search's 180B models cannot show it)."""
    F, _ = step_fit.linearise(cases, profile, step_fit.START)
    measured = step_fit.predict_all(cases, profile, step_fit.START)
    names = step_fit.FITTED
    flat = names.index("dp_fabric_per_doubling")
    F[:, flat] = 0.0  # no run spans nodes: nothing but the prior says anything about it
    share = step_fit.runs_share(F, measured)
    assert share["dp_fabric_per_doubling"] == pytest.approx(0.0, abs=1e-9)
    assert all(0.0 <= v <= 1.0 for v in share.values())
    # a copy of the compute column: the runs fix the two scales' sum, not each of them
    i, j = names.index("compute_scale"), names.index("memory_scale")
    G = F.copy()
    G[:, j] = G[:, i]
    both = step_fit.runs_share(G, measured)
    assert both["compute_scale"] < share["compute_scale"] - 0.1
    # the same layouts at hidden 8192, micro-batch 4: never host-bound
    big = step_fit.prepare([_run(tp=tp, dp=dp, pp=pp, micro_batch=4, hidden=8192, heads=64,
                                 global_batch=16 * dp)
                            for tp, dp, pp in ((1, 2, 2), (2, 1, 2), (1, 4, 1), (2, 2, 1), (1, 1, 4))],
                           lambda r: devset.build_config(r, profile.facts.gpus_per_node))
    Fb, _ = step_fit.linearise(big, profile, step_fit.START)
    large = step_fit.runs_share(Fb, step_fit.predict_all(big, profile, step_fit.START))
    assert share["dispatch_s"] > 0.5 > large["dispatch_s"]
