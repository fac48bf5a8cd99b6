"""hooks/live_memory: the peak of live tensor bytes and what was live at it, on CPU.

The models here are small enough that every tensor autograd keeps is known by shape, so the
measurement is held to exact bytes: if the tracker missed an activation (or counted one twice,
or put it in the wrong component) these fail."""
import pytest

torch = pytest.importorskip("torch")

from neox_perf.calibration.live_memory import LiveMemory  # noqa: E402

T, H, F, V = 64, 32, 128, 50  # tokens, hidden, MLP width, vocabulary
FP = 4


class _Engine:
    def __init__(self, module, optimizer):
        self.module, self.optimizer, self.device = module, optimizer, torch.device("cpu")


class Block(torch.nn.Module):
    """y = x + W2 relu(W1 x): autograd keeps x (W1's input), relu's output (W2's input) and
    nothing else (relu's backward reads its output; the residual add keeps nothing)."""

    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Linear(H, F, bias=False)
        self.w2 = torch.nn.Linear(F, H, bias=False)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(x)))


class Model(torch.nn.Module):
    def __init__(self, blocks=2, checkpoint=False):
        super().__init__()
        self.word_embeddings = torch.nn.Embedding(V, H)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(blocks))
        self.final_linear = torch.nn.Linear(H, V, bias=False)
        self.checkpoint = checkpoint

    def forward(self, ids):
        x = self.word_embeddings(ids)
        for b in self.blocks:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=True)
            else:
                x = b(x)
        return self.final_linear(x)


def _step(model, opt, lm=None, micro_batches=1):
    torch.manual_seed(1)
    for _ in range(micro_batches):
        ids, labels = torch.randint(0, V, (T,)), torch.randint(0, V, (T,))
        if lm:
            lm.enter("forward")
        logits = model(ids)
        if lm:
            lm.leave_last()
        loss = torch.nn.functional.cross_entropy(logits, labels)
        if lm:
            lm.enter("backward")
        loss.backward()
        if lm:
            lm.leave_last()
        del logits, loss
    if lm:
        lm.enter("step")
    opt.step()
    opt.zero_grad(set_to_none=True)
    if lm:
        lm.leave_last()


def _measure(model, micro_batches=1, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no state: the states stay out of the way
    _step(model, opt)
    lm = LiveMemory(_Engine(model, opt), vocab_local=V, **kw)
    lm.start()
    _step(model, opt, lm, micro_batches)
    lm.stop()
    return lm.result()


def _params(model):
    return FP * sum(p.numel() for p in model.parameters())


def test_the_peak_holds_every_activation_exactly():
    torch.manual_seed(0)
    model = Model()
    got = _measure(model)
    assert got["error"] is None
    at = got["at_peak"]
    assert at["weights"] == _params(model)
    # the peak is in the top block's backward, at W2's (the widest gradients): every block's
    # x [T, H] and relu(W1 x) [T, F] are still kept (the embedding output is the first x)
    assert at["activations"] == 2 * FP * T * (H + F)
    # by then backward has made the head's and W2's weight gradients (first micro-batch:
    # they become param.grad), and the logits [T, V] the caller still holds (+ loss scalars)
    assert at["gradients"] == FP * (V * H + H * F)
    assert FP * T * V <= at["logits"] <= FP * T * V + 16
    # W2's input gradient and relu's backward output, both [T, F], and the block's [T, H] ones
    assert at["temporaries"] >= 2 * FP * T * F
    assert at["recompute"] == 0 and at["master_weights"] == 0 and at["optimizer_states"] == 0
    assert got["peak_bytes"] == sum(at.values())
    assert "backward" in got["peak_moment"]


def test_gradients_are_param_grads_and_the_head_weight_gradient_is_not_logits():
    torch.manual_seed(0)
    model = Model(blocks=1)
    lm_result = _measure(model, micro_batches=2)
    at = lm_result["at_peak"]
    # the second micro-batch: every param.grad exists (made by the first), exactly once
    assert at["gradients"] == _params(model)
    # the head's new weight gradient [V, H] is a temporary added into param.grad
    largest = {(r["component"], tuple(r["shape"] or ())) for r in lm_result["largest_at_peak"]}
    assert ("logits", (V, H)) not in largest


def test_checkpointed_blocks_recompute_in_backward():
    torch.manual_seed(0)
    plain = _measure(Model(blocks=2))["at_peak"]
    ckpt = _measure(Model(blocks=2, checkpoint=True))
    at = ckpt["at_peak"]
    # a checkpointed block keeps only its input; its own tensors come back as recompute
    assert at["recompute"] > 0 and at["activations"] < plain["activations"]
    assert any(r["component"] == "recompute" and "relu" in r["made_by"]
               for r in ckpt["largest_at_peak"])


def test_optimizer_states_and_master_copies_are_named_from_the_optimizer():
    torch.manual_seed(0)
    model = Model(blocks=1)
    master = [p.detach().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.Adam(master, lr=1e-3)
    for p in master:
        p.grad = torch.zeros_like(p)
    opt.step()  # makes exp_avg, exp_avg_sq
    lm = LiveMemory(_Engine(model, opt), vocab_local=V)
    lm.start()
    lm.stop()
    start = lm.result()["at_start"]
    n = _params(model)
    assert start["weights"] == n and start["master_weights"] == n
    assert start["gradients"] == n  # the master copies' .grad
    assert n * 2 <= start["optimizer_states"] <= n * 2 + 64  # + one step counter per tensor


def test_a_failure_inside_the_tracker_never_reaches_training(monkeypatch):
    torch.manual_seed(0)
    model = Model(blocks=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lm = LiveMemory(_Engine(model, opt), vocab_local=V)
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("tracker bug")
    monkeypatch.setattr(lm.tracker, "_track", broken)
    lm.start()
    _step(model, opt, lm)  # trains on
    lm.stop()
    got = lm.result()
    assert calls and "tracker bug" in got["error"] and "peak_bytes" not in got
    # and the mode is gone: ops after stop() are not dispatched to it
    n = len(calls)
    torch.ones(3) + 1
    assert len(calls) == n


def test_only_the_window_is_tracked_and_its_cost_is_recorded():
    torch.manual_seed(0)
    model = Model(blocks=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lm = LiveMemory(_Engine(model, opt), vocab_local=V)
    lm.start()
    lm.stop()
    seen = len(lm.tracker._WINFO)
    _step(model, opt)  # outside the window: nothing new is tracked
    assert len(lm.tracker._WINFO) <= seen
    assert lm.result()["tracker_seconds"] > 0
