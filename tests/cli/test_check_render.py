"""`check`'s text at 80 and 120 columns (issue 26, section 4): the verdict on top, titles whole,
a breakdown of rows that add up to the iteration, operators by the names NeoX users know."""
import contextlib
import io
import json
import re

import pytest

from neox_perf.cli import main

from conftest_paths import EXAMPLES  # noqa: F401  (helper module beside this file)

TITLES = ("Breakdown of one iteration (arXiv 2509.22832, Table IX)",
          "Heaviest operators on the critical stage, per iteration",
          "1F1B timeline of one iteration")
ARGV = ["check", str(EXAMPLES / "gpt-20b.yml"), "--gpus", "128", "--cluster", "perlmutter-a100"]


def render(argv, width, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(width))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        main(argv)
    return out.getvalue()


def data(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(argv + ["--json"])
    return json.loads(out.getvalue())


@pytest.mark.parametrize("width", [80, 120])
def test_fits_the_terminal_and_titles_stay_whole(monkeypatch, width):
    text = render(ARGV, width, monkeypatch)
    lines = text.splitlines()
    assert max(len(l) for l in lines) <= width
    for title in TITLES:
        assert title in lines, title  # a whole line of its own, never wrapped mid-phrase


@pytest.mark.parametrize("width", [80, 120])
@pytest.mark.parametrize("config, gpus", [("13B.yml", "8"), ("llemma/34B.yml", "64"), ("1-3B.yml", "16")])
def test_out_of_memory_refused_and_advised_fit_too(neox_configs, monkeypatch, width, config, gpus):
    """A layout that does not fit, one NeoX refuses, one with a faster layout offered."""
    text = render(["check", str(neox_configs / config), "--gpus", gpus, "--cluster", "perlmutter-a100"],
                  width, monkeypatch)
    lines = text.splitlines()
    assert max(len(l) for l in lines) <= width
    assert lines[0].split()[0] in ("FAIL", "ERROR", "WARNING")
    assert lines[0].split()[0] == [l for l in lines if l.split(" ")[0] in (
        "OK", "WARNING", "FAIL", "ERROR")][-1].split()[0]  # the worst finding is also the last


@pytest.mark.parametrize("width", [80, 120])
def test_the_verdict_is_at_the_top(monkeypatch, width):
    text = render(ARGV, width, monkeypatch)
    summary = data(ARGV)["verdict"]
    first = text.splitlines()[0]
    assert first.startswith(summary["level"].upper()) and summary["text"][:40] in text.replace("\n", " ")
    assert text.index(first) < text.index("neox-perf check")  # above the header panel


@pytest.mark.parametrize("width", [80, 120])
def test_the_breakdown_adds_up_and_hides_zero_rows(monkeypatch, width):
    text = render(ARGV, width, monkeypatch)
    block = text.split(TITLES[0], 1)[1].split(TITLES[2], 1)[0]
    rows = [l for l in block.splitlines() if re.match(r"\s+[+=]\s", l)]
    assert rows[-1].split()[:2] == ["=", "iteration"]
    pred = data(ARGV)["prediction"]

    def seconds(line):
        value, unit = re.search(r"([\d.,]+) (ms|s)\s+\d+%", line).groups()
        return float(value.replace(",", "")) / (1000 if unit == "ms" else 1)
    added = sum(seconds(l) for l in rows[:-1])
    assert added == pytest.approx(pred["iteration_seconds"], rel=2e-3)
    assert seconds(rows[-1]) == pytest.approx(pred["iteration_seconds"], rel=1e-3)
    # gpt-20b ties no embedding across stages: that row is zero and not shown, nor any zero row
    assert pred["breakdown"]["tied_allreduce"] == 0
    assert "tied-embedding" not in block and " 0.0 ms" not in block


@pytest.mark.parametrize("width", [80, 120])
def test_operators_carry_neox_names_beside_the_papers(monkeypatch, width):
    text = render(ARGV, width, monkeypatch)
    block = text.split(TITLES[1], 1)[1]
    for neox, paper in (("MLP h->4h", "linear3"), ("MLP 4h->h", "linear4"), ("QKV", "linear1")):
        assert re.search(rf"{re.escape(neox)}\s+{paper}\s", block), (neox, paper)
    assert "arXiv 2509.22832, Table I" in block


def test_the_paper_is_named(monkeypatch):
    text = " ".join(render(ARGV, 120, monkeypatch).replace("│", " ").split())
    assert "paper Eq. 7" not in text and "paper Table" not in text
    assert "arXiv 2509.22832, Eq. 7" in text


@pytest.mark.parametrize("width", [80, 120])
@pytest.mark.parametrize("config, gpus", [("175B.yml", "1"), ("175B.yml", "512"), ("20B.yml", "96"),
                                          ("llama2/7B.yml", "128")])
def test_the_stage_table_keeps_every_header_and_figure_whole(neox_configs, monkeypatch, width, config, gpus):
    """No header or figure of the stage table is cut to an ellipsis, at 80 columns too (the
    table of a model far out of memory has 4-digit GiB figures)."""
    argv = ["check", str(neox_configs / config), "--gpus", gpus, "--cluster", "perlmutter-a100-80gb",
            "--set", "train_micro_batch_size_per_gpu=4", "--set", "gradient_accumulation_steps=8"]
    lines = render(argv, width, monkeypatch).splitlines()
    start = lines.index(next(l for l in lines if l.startswith("Pipeline stages")))
    end = next(i for i in range(start + 3, len(lines)) if not lines[i].strip())
    table = lines[start:end]
    assert all("…" not in l for l in table), "\n".join(table)
    header = " ".join(" ".join(table[1:4]).split())
    for word in ("stage", "blocks", "params", "weights", "grads", "optim", "activ.", "logits/",
                 "buffers", "device", "overhead", "total", "of", "GPU"):
        assert word in header.split(), word
    assert ("specs" in header.split()) == (width >= 100)
    rows = [l.split() for l in table[4:] if l.strip() and l.split()[0].isdigit()]
    assert rows and all(r[-1].endswith("%") for r in rows)
