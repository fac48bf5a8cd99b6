"""The hook inside one process, on a stand-in engine: iteration boundaries, windows, failing
safely, unwrapping. The stand-in has the DeepSpeedEngine methods the hook wraps."""
import json

import pytest

torch = pytest.importorskip("torch")

from neox_perf.hooks import failures  # noqa: E402
from neox_perf.hooks.session import Session  # noqa: E402
from neox_perf.hooks.settings import Settings, Windows  # noqa: E402
from neox_perf.runs.files import read_iterations  # noqa: E402


class Engine(torch.nn.Module):
    """forward / backward / step with gradient accumulation, like DeepSpeedEngine."""

    def __init__(self, gas=2):
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(8)
        self.up = torch.nn.Linear(8, 32)
        self.down = torch.nn.Linear(32, 8)
        self.optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        self.gas, self.micro_steps, self.global_steps = gas, 0, 0
        self.device = torch.device("cpu")

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    def backward(self, loss):
        (loss / self.gas).backward()

    def step(self):
        self.micro_steps += 1
        if self.micro_steps % self.gas == 0:
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.global_steps += 1

    def gradient_accumulation_steps(self):
        return self.gas


def train(engine, iters=6):
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(iters):
        for _ in range(engine.gas):
            loss = engine(torch.randn(4, 8, generator=g)).pow(2).mean()
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses


@pytest.fixture
def session(tmp_path):
    failures._reset_for_tests()
    s = Session(Settings(run_dir=str(tmp_path), windows=Windows.parse(
        "skip=1,warmup=1,active=2,every=4,repeat=1"), report_at_exit=False))
    yield s
    s.finish()
    failures._reset_for_tests()


def test_iterations_end_at_accumulation_boundaries(session, tmp_path):
    engine = Engine()
    session.attach(engine, (), {})
    plain = train(Engine())
    assert train(engine) == plain  # bit-identical with the hook on
    its = read_iterations(str(tmp_path / "rank-00000.iterations.jsonl"))
    assert [i for i, _, _ in its] == list(range(6))
    assert [i for i, _, p in its if p] == [1, 2, 3, 4]  # warm-up 1, recorded 2-3, then 4
    s = session.summary(False)
    # the live-bytes window: the third iteration is in a profiling window, so the first one
    # after it (already perturbed by the window's mapping) is tracked instead
    live = s["memory"]["live"]
    assert live["iteration"] == 4 and live["error"] is None
    assert live["peak_bytes"] >= sum(s["memory"]["components"].values()) > 0
    assert live["at_peak"]["activations"] > 0 and live["at_peak"]["weights"] > 0
    assert s["window_iterations"] == 2 and s["phases"]["forward"]["calls"] == 4
    ops = {(o["op"], o["phase"]): o for o in s["ops"]}
    # no config, but the LayerNorm width names the 4x MLP
    assert ops[("linear3", "fwd")]["features"] == {"m": 4, "k": 8, "n": 32}
    assert ops[("linear4", "bwd")]["calls"] == 4
    assert ops[("optimizer", "step")]["features"] == {"params": sum(p.numel() for p in engine.parameters())}
    assert s["facts"]["missing"]  # a stand-in has no fp16_enabled(), dp_world_size, ...


def test_a_failure_unwraps_the_engine_and_is_logged_once(session, tmp_path, capsys):
    engine = Engine()
    session.attach(engine, (), {})
    assert "forward" in engine.__dict__
    session.settings = Settings(**{**session.settings.__dict__, "inject": "iteration"})
    plain = train(Engine(), 8)
    assert train(engine, 8) == plain
    assert not session.live and "forward" not in engine.__dict__ and "step" not in engine.__dict__
    err = capsys.readouterr().err
    assert err.count("neox-perf: rank") == 1 and "injected failure after iteration 3" in err
    assert (tmp_path / "errors.log").read_text().count("hook disabled") == 1
    its = read_iterations(str(tmp_path / "rank-00000.iterations.jsonl"))
    assert len(its) == 3  # timing stopped with the hook
    data = json.loads((tmp_path / "rank-00000.json").read_text())
    assert "injected failure" in data["disabled"]


def test_training_errors_pass_through_untouched(session):
    engine = Engine()
    session.attach(engine, (), {})
    with pytest.raises(RuntimeError, match="normalized_shape"):
        engine(torch.zeros(2, 3))  # wrong width: the model's own error
    assert session.live  # the user's error is not the hook's


def test_cpu_phases_are_timed_outside_windows_only(session, tmp_path):
    from neox_perf.runs.files import read_iteration_phases
    engine = Engine()
    session.attach(engine, (), {})
    train(engine)
    path = str(tmp_path / "rank-00000.iterations.jsonl")
    its = {i: (sec, p) for i, sec, p in read_iterations(path)}
    phases = {i: ph for i, _, ph in read_iteration_phases(path)}
    # profiled iterations (1-4) carry no phase times: the profiler slows them
    assert sorted(phases) == [i for i, (_, p) in sorted(its.items()) if not p] == [0, 5]
    for i, ph in phases.items():
        assert set(ph) == {"forward", "backward", "step"}
        # every phase is inside the iteration, and together a real share of it: on this
        # microsecond model the hook's own per-iteration work is of the same order (one CI run
        # timed the phases at 3.5 of an 8.7 ms iteration, where a half was asserted)
        assert 0.25 * its[i][0] < sum(ph.values()) <= its[i][0]
