"""benchmarks/host_cost.py: the host's time per framework call, the prior every step-term fit
stands on (step_fit.PRIOR_CENTER). What it divides by is neox-perf's own count of a layer's
calls, for the very config NeoX runs; the NeoX runs themselves need NEOX_PERF_NEOX_SRC."""
import dataclasses

import pytest

from neox_perf.predictors.fitting import step_fit


@pytest.fixture(scope="module")
def host_cost(benchmark_script):
    return benchmark_script("host_cost")


def test_the_layout_runs_as_the_development_set_did_and_its_calls_are_the_decompositions(host_cost):
    small, deep = (host_cost.layout(n) for n in host_cost.DEPTHS)
    assert deep.layers > small.layers and small.gpus == 1 and small.checkpoint
    assert small.extra["hidden_dropout"] > 0 and small.extra["attention_dropout"] > 0
    calls = host_cost.calls_per_layer(small)
    assert calls == host_cost.calls_per_layer(deep)  # per layer: the depth does not change it
    # checkpointing reruns the forward's calls: without it a layer issues fewer
    plain = host_cost.calls_per_layer(dataclasses.replace(small, checkpoint=False))
    assert 0 < plain < calls < 2 * plain
    # dropout is calls of its own
    assert host_cost.calls_per_layer(dataclasses.replace(small, extra={})) < calls


def test_the_prior_centre_is_the_measured_host_cost(host_cost):
    """Only the host's time per call is centred away from its neutral value; the measurement
    is tens of microseconds, inside the term's bounds."""
    centre = step_fit.PRIOR_CENTER
    assert centre.dispatch_s == step_fit.HOST_CALL_S
    lo, hi = step_fit.BOUNDS["dispatch_s"]
    assert lo < 1e-5 < step_fit.HOST_CALL_S < 1e-4 < hi
    neutral = type(centre)()
    assert dataclasses.replace(centre, dispatch_s=neutral.dispatch_s) == neutral


def test_without_gpt_neox_it_says_so_and_measures_nothing(host_cost, monkeypatch, capsys):
    monkeypatch.setenv("NEOX_PERF_NEOX_SRC", "")
    assert host_cost.main(["--rounds", "1"]) == 0
    assert "nothing measured" in capsys.readouterr().out


def test_a_smaller_size_issues_the_same_calls_so_the_two_measure_one_thing(host_cost):
    """--size shrinks the layers until the CPU's own kernel time leaves the per-call cost: the
    division is by the same count of calls, or the two sizes would not be comparable."""
    small = host_cost.layout(2, (16, 2, 8))
    assert (small.hidden, small.heads, small.seq) == (16, 2, 8)
    assert host_cost.calls_per_layer(small) == host_cost.calls_per_layer(host_cost.layout(2))


@pytest.mark.parametrize("size", ["16,3,8", "16,2", "0,1,4", "a,b,c"])
def test_a_size_it_cannot_build_is_one_line(host_cost, size, capsys):
    with pytest.raises(SystemExit) as exc:
        host_cost.main(["--size", size])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--size" in err and "HIDDEN,HEADS,SEQ" in err
