"""Step terms a fit's runs could not see (step_terms.unseen_terms): the interval reaches what each
says at either end of its range, the point prediction stays, and nothing changes without them."""
import json
import shutil
from pathlib import Path
from dataclasses import replace

import numpy as np
import pytest

from neox_perf.cli import main
from neox_perf.predictors import load_profile
from neox_perf.predictors.fitting import step_fit
from neox_perf.profile.directory import bundled_dir
from neox_perf.prediction.corrections import StepTerms, StepTermsSection, unseen
from neox_perf.prediction.corrections.unseen import Z80

EXAMPLES = Path(__file__).resolve().parents[1] / "neox_perf" / "examples"

UNSEEN = {"dispatch_s": 2e-5, "step_s": 2e-2, "memory_scale": 0.2}


def _profile_with(tmp_path, unseen_terms):
    d = tmp_path / "p"
    shutil.copytree(bundled_dir() / "perlmutter-a100-80gb", d)
    data = json.loads((d / "manifest.json").read_text())
    data["step_terms"]["unseen_terms"] = unseen_terms
    (d / "manifest.json").write_text(json.dumps(data))
    return d


def _check(capsys, cluster, gpus="8"):
    code = main(["check", str(EXAMPLES / "llemma-7b.yml"), "--gpus", gpus, "--cluster", str(cluster), "--json"])
    assert code in (0, 3)
    return json.loads(capsys.readouterr().out)["prediction"]


def test_the_section_reads_and_writes_unseen_terms_as_given():
    data = {"terms": StepTerms(dispatch_s=7e-5).to_dict(), "unseen_terms": dict(UNSEEN)}
    section = StepTermsSection.parse(data)
    assert section.unseen_terms == UNSEEN
    assert StepTermsSection.parse(section.to_dict()) == section
    assert list(section.to_dict())[:2] == ["terms", "unseen_terms"]


def test_each_end_is_the_value_plus_minus_z80_sd_and_the_low_end_stops_at_neutral():
    terms = StepTerms(dispatch_s=1e-5, memory_scale=1.05, step_s=0.1)
    got = {n: (lo, hi) for n, lo, hi in unseen.ends(terms, {**UNSEEN, "p2p_s": 0.0})}
    assert set(got) == set(UNSEEN)  # a zero sd spans nothing
    assert got["dispatch_s"][0].dispatch_s == 0.0  # 1e-5 - 1.28 x 2e-5 is below no cost at all
    assert got["dispatch_s"][1].dispatch_s == pytest.approx(1e-5 + Z80 * 2e-5)
    assert got["memory_scale"][0].memory_scale == 1.0  # 1.05 - 0.256: below neutral, stops there
    assert got["step_s"][0].step_s == pytest.approx(0.1 - Z80 * 2e-2)  # far from neutral: the full range
    for name, (lo, hi) in got.items():  # each moves its own term only
        assert replace(lo, **{name: getattr(terms, name)}) == terms == replace(hi, **{name: getattr(terms, name)})


def test_the_spread_adds_independent_terms_in_quadrature_each_side_on_its_own():
    down, up = unseen.spread(10.0, [(10.0, 13.0), (9.0, 14.0)])
    assert up == pytest.approx(np.hypot(0.3, 0.4)) and down == pytest.approx(0.1)
    assert unseen.spread(10.0, [(10.0, 12.0)]) == (0.0, pytest.approx(0.2))  # a cost that only adds
    assert unseen.widened((8.0, 12.0), (0.1, 0.5)) == (pytest.approx(7.2), pytest.approx(18.0))


def test_check_widens_the_interval_by_what_each_unseen_term_prices_and_keeps_the_point(tmp_path, capsys):
    plain = _check(capsys, "perlmutter-a100-80gb")
    assert plain["unseen_terms"] == {}
    got = _check(capsys, _profile_with(tmp_path, UNSEEN))
    assert got["iteration_seconds"] == plain["iteration_seconds"]
    assert set(got["unseen_terms"]) == set(UNSEEN)
    seconds = got["iteration_seconds"]
    for name, (lo, hi) in got["unseen_terms"].items():
        assert lo <= seconds <= hi, name  # every one of these only adds time at its high end
    assert got["unseen_terms"]["step_s"][1] > seconds  # a bookkeeping cost per step: always seen
    by = unseen.spread(seconds, got["unseen_terms"].values())
    want = unseen.widened(plain["interval_seconds"], by)
    assert got["interval_seconds"] == pytest.approx(list(want))
    assert got["interval_seconds"][1] > plain["interval_seconds"][1]
    assert got["slurm_time"] >= plain["slurm_time"]  # sized from the high end


def test_trial_terms_span_nothing_and_a_profile_without_the_key_has_none(tmp_path):
    from neox_perf.config import WorldRequest, build, load_files
    from neox_perf.derive import derive
    from neox_perf.prediction.corrections.of_profile import unseen_of
    from neox_perf.prediction.estimate import estimate
    from neox_perf.prediction.predict import predict
    profile = load_profile(str(_profile_with(tmp_path, UNSEEN)))
    assert unseen_of(profile) == UNSEEN
    assert unseen_of(load_profile("perlmutter-a100-80gb")) == {}
    cfg, _, _ = build(load_files([str(EXAMPLES / "llemma-7b.yml")]), WorldRequest(gpus=8, gpus_per_node=8))
    own = predict(cfg, derive(cfg, 50257), profile)
    assert set(own.estimate.unseen_terms) == set(UNSEEN)
    # a fit's trial terms (estimate with terms=, as step_fit prices them) are its own question:
    # nothing spans them, and the interval is the residuals' alone
    trial = estimate(own.decomposition, profile, StepTerms())
    assert trial.unseen_terms == {}
    # the planner's per-stage bounds (price_other=False) price no ends either
    assert predict(cfg, derive(cfg, 50257), profile, price_other=False).estimate.unseen_terms == {}


def test_a_term_the_runs_cannot_see_keeps_its_prior_sd_and_a_seen_one_narrows():
    rng = np.random.default_rng(0)
    measured = np.full(50, 10.0)
    F = np.zeros((50, len(step_fit.FITTED)))
    F[:, 0] = 10.0 * (1 + 0.1 * rng.standard_normal(50))  # the runs move with compute_scale only
    sd = step_fit.posterior_sd(F, measured)
    assert sd["dispatch_s"] == pytest.approx(step_fit.PRIOR_SD["dispatch_s"])
    assert sd["compute_scale"] < 0.2 * step_fit.PRIOR_SD["compute_scale"]
    got = step_fit.unseen_terms(F, measured)
    assert "compute_scale" not in got and set(got) == set(step_fit.FITTED) - {"compute_scale"}
