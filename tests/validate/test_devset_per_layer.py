"""benchmarks/devset_per_layer.py divides each measured iteration into the per-layer,
per-micro-batch cost its (layout, hidden, micro-batch) cell prints."""
import pytest

HEADER = "gpus,global_batch,micro_batch,hidden,heads,layers,seq_len,tp,dp,pp,iteration_ms\n"


def test_per_layer_cost_of_each_cell(tmp_path, capsys, benchmark_script):
    csv = tmp_path / "runs.csv"
    csv.write_text(HEADER
                   + "8,8,1,1024,16,24,1024,8,1,1,960\n"     # 8 micro-batches x 24 layers: 5 ms
                   + "8,8,1,1024,16,12,1024,8,1,1,480\n"     # the same cell: 5 ms
                   + "8,4,2,1024,16,24,1024,8,1,1,408\n"     # 2 x 24: 8.5 ms
                   + "4,8,1,2048,16,24,1024,1,2,2,240\n")    # 4 micro-batches x 12 layers per stage
    script = benchmark_script("devset_per_layer")
    from neox_perf.predictors.fitting import devset
    table = script.per_layer_ms(devset.load_vtrain(csv))
    assert table[((8, 1, 1), 1024)] == {1: pytest.approx(5.0), 2: pytest.approx(8.5)}
    assert table[((1, 2, 2), 2048)] == {1: pytest.approx(5.0)}
    assert script.main(["--csv", str(csv)]) == 0
    out = capsys.readouterr().out
    assert "(8, 1, 1)   1024    5.00    8.50" in out and "(1, 2, 2)   2048    5.00       -" in out
