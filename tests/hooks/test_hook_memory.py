"""hooks/memory: persistent state per component from the engine's tensors, and the peak."""
import pytest

torch = pytest.importorskip("torch")

from neox_perf.hooks import memory  # noqa: E402


class _Engine:
    def __init__(self, module, optimizer):
        self.module, self.optimizer = module, optimizer


def _trained(width=64):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, width)).sum().backward()
    opt.step()
    return model, opt


def test_components_are_counted_once_from_the_tensors():
    model, opt = _trained()
    n = sum(p.numel() for p in model.parameters())
    got = memory.state_bytes(_Engine(model, opt))
    assert got["weights"] == 4 * n and got["gradients"] == 4 * n
    assert got["master_weights"] == 0  # Adam updates the module's own fp32 tensors
    # exp_avg + exp_avg_sq per parameter (+ a scalar step per tensor)
    assert 8 * n <= got["optimizer_states"] <= 8 * n + 8 * 4


def test_a_separate_master_copy_is_seen():
    model, _ = _trained()
    master = [p.detach().clone().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.SGD(master, lr=0.1)
    got = memory.state_bytes(_Engine(model, opt))
    assert got["master_weights"] == got["weights"] and got["optimizer_states"] == 0


def test_compare_lines_state_up_per_component_and_the_peak():
    model, opt = _trained()
    got = memory.MemoryProbe("cpu").measure(_Engine(model, opt))
    assert got["peak_bytes"] is None and "live-bytes" in got["source"]
    state = got["components"]
    rows = {r["component"]: r for r in memory.compare(dict(got, peak_bytes=100), {
        "weights": state["weights"], "gradients": 0, "master_weights": 0,
        "optimizer_states": 2 * state["optimizer_states"], "persistent": 1, "total": 100})}
    assert rows["weights"]["error"] == 0 and rows["peak"]["error"] == 0
    assert rows["optimizer_states"]["error"] == pytest.approx(1.0)
    assert rows["gradients"]["error"] == pytest.approx(-1.0)
