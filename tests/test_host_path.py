"""benchmarks/host_path.py: the host's time per framework call on each device of one host, the
workload's own layers alone. What a GPU run would add to dispatch_s's CPU-measured prior is the
CUDA minus the CPU figure of one host; here, without a GPU, the CPU side runs and CUDA says so."""
import pytest

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def host_path(benchmark_script):
    return benchmark_script("host_path")


def test_the_layers_are_host_costs_layout_and_the_calls_the_same_count(host_path, benchmark_script):
    host_cost = benchmark_script("host_cost")
    wc = host_path.workload_config((64, 4, 32))
    lay = host_cost.layout(2)
    assert (wc.hidden, wc.heads, wc.seq_length) == (lay.hidden, lay.heads, lay.seq)
    assert wc.hidden_dropout == lay.extra["hidden_dropout"] > 0
    assert host_path.calls_per_layer((64, 4, 32)) == host_cost.calls_per_layer(lay)


def test_on_the_cpu_it_gives_a_cost_per_call_per_round(host_path):
    r = host_path.measure_device("cpu", (8, 1, 4), rounds=2, iters=3, warmup=1)
    assert r["device"] == "cpu" and len(r["rounds"]) == 2
    for rnd in r["rounds"]:
        deep, shallow = rnd["medians_s"][10], rnd["medians_s"][2]
        assert rnd["per_call_s"] == pytest.approx((deep - shallow) / 8 / r["calls_per_layer"])
    assert r["min_per_call_s"] <= r["median_per_call_s"] <= r["max_per_call_s"]
    assert "us a call" in host_path.line(r)


def test_cuda_without_a_gpu_is_one_line(host_path, capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here")
    assert host_path.main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA GPU" in err[0] and "--device cpu" in err[0]


@pytest.mark.parametrize("args", [["--size", "16,3,8"], ["--rounds", "0"]])
def test_arguments_it_cannot_use_are_one_line(host_path, args, capsys):
    with pytest.raises(SystemExit) as exc:
        host_path.main(args)
    assert exc.value.code == 2
