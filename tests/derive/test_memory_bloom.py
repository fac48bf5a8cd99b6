"""benchmarks/memory_bloom.py on BigScience's BLOOM layout search (../shared/data; skipped
without it): the device terms cross-validated by model meet the issue's bounds, the bundled
fit is the fit on all rows, and the verdict's band holds every layout that ran out of memory
(FAIL or WARNING) and none that ran (FAIL)."""
import pytest


@pytest.fixture(scope="module")
def bloom(benchmark_script):
    mod = benchmark_script("memory_bloom")
    try:
        runs = mod.devset.load_bloom()
    except FileNotFoundError:
        pytest.skip("../shared/data/bloom-jean-zay is not present")
    return mod, [mod.Row(r, mod.GIB) for r in runs if r.peak_mem_gb is not None or r.oom]


def test_the_bundled_fit_is_the_fit_on_every_peak(bloom):
    mod, rows = bloom
    fit = mod.fit_terms([r for r in rows if r.measured is not None])
    assert fit.nccl_per_communicator == pytest.approx(mod.dm.FITTED.nccl_per_communicator, rel=0.01)
    assert fit.reserve_fraction == pytest.approx(mod.dm.FITTED.reserve_fraction, abs=0.002)
    # a prediction under the bundled fit is the device total derive computes
    for r in rows:
        assert r.peak(mod.dm.FITTED) == pytest.approx(max(x[3].device_total for x in r.node0), abs=2)


def test_cross_validated_peaks_and_verdicts(bloom, capsys):
    mod, _ = bloom
    assert mod.main([]) == 0, capsys.readouterr().out[-2000:]
