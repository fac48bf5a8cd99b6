"""Record the small CPU profiler traces trace_map's tests read (run once; JSON, no pickle).

    OMP_NUM_THREADS=1 python tests/hooks/traces/make_traces.py

Each trace is what the hook's extractor (profiling.extract_events) gets from torch.profiler
for a tiny model, with the hook's phase ranges around forward / backward / step, plus the
MapContext the hook would use. Regenerate after a torch upgrade if the tests start failing,
and look at what changed: that is exactly what the tests are for.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "workload"))


# Leaves that never carry an autograd number and no rule looks at; dropped to keep the
# files small (parents keep their own inclusive times, so nothing else changes).
TRIVIAL = {"aten::empty", "aten::as_strided", "aten::resolve_conj", "aten::empty_strided",
           "aten::empty_like", "detach", "aten::resize_", "aten::fill_", "aten::zero_"}


def _record(fn):
    from neox_perf.hooks.profiling import extract_events
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    events = extract_events(prof.profiler.kineto_results)
    parents = {e.parent for e in events}
    by_id = {e.id: e for e in events}

    def inside_optimizer(e):  # the optimizer's own ops: one mapped call, nothing else to see
        while e.parent is not None:
            e = by_id[e.parent]
            if e.name.startswith("Optimizer.step#"):
                return True
        return False
    t0 = min(e.start for e in events)
    threads = {t: i for i, t in enumerate(sorted({e.thread for e in events}))}
    out = []
    for e in events:
        if (e.name in TRIVIAL and e.seq < 0 and e.id not in parents) or inside_optimizer(e):
            continue
        d = e.to_dict()
        d["start"] = round(e.start - t0, 3)
        d["thread"] = threads[e.thread]
        if d.get("fwd_thread"):
            d["fwd_thread"] = threads.get(e.fwd_thread, e.fwd_thread)
        if "scaled_dot_product" not in e.name:
            d.pop("concrete", None)
        out.append(d)
    return out


def _save(name, description, context, events):
    data = {"schema": "neox-perf.trace/1", "generator": "tests/hooks/traces/make_traces.py",
            "torch": torch.__version__, "description": description, "context": context,
            "events": events}
    (HERE / name).write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"{name}: {len(events)} events")


def workload_layer():
    """The reference workload (NeoX's layer code paths), 1 layer, 2 micro-batches + Adam."""
    from workload_specs import write_config

    from neox_perf.calibration.workload import dims
    from neox_perf.calibration.workload.data import SyntheticTokens
    from neox_perf.calibration.workload.model import SequentialModel, cross_entropy
    from neox_perf.config import WorldRequest, build, load_files
    with tempfile.TemporaryDirectory() as tmp:
        path = write_config(Path(tmp) / "tiny.yml", num_layers=1, hidden_size=16,
                            num_attention_heads=2, seq_length=8, max_position_embeddings=8,
                            train_micro_batch_size_per_gpu=1, pipe_parallel_size=0)
        cfg, _, _ = build(load_files([path]), WorldRequest(gpus=1))
    wc = dims.from_neox(cfg, 60)
    torch.manual_seed(0)
    model = SequentialModel(wc, 0)
    opt = torch.optim.Adam(model.parameters(), foreach=True)
    data = SyntheticTokens(1, 60, wc.seq_length, 1, 0, torch.device("cpu"))

    def run():
        for i in range(2):
            inputs, labels = data.micro_batch(0, i)
            with record_function("neox_perf::forward"):
                loss = cross_entropy(model(inputs), labels)
            with record_function("neox_perf::backward"):
                loss.backward()
        with record_function("neox_perf::step"):
            opt.step()
    events = _record(run)
    params = sum(p.numel() for p in model.parameters())
    ctx = {"dims": {"hidden": 16, "qkv": 48, "ffn_out": 64, "ffn_in": 64, "vocab": 128,
                    "hidden_local": 16, "source": "config"},
           "device": "cpu", "dtype": "fp32", "optimizer_params": params,
           "groups": {"dp": 1, "mp": 1, "stages": 1, "stage": 0, "local_world": 1}}
    _save("workload_layer.json", "reference workload, 1 layer (h16, 2 heads, s8, b1, vocab "
          "60->128, rotary 25%), 2 micro-batches fwd+bwd, one Adam step", ctx, events)


class _Block(nn.Module):
    def __init__(self, d=16, vocab=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.head = nn.Linear(d, vocab, bias=False)

    def layer(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + a.transpose(1, 2).reshape(b, s, d)
        return x + self.down(F.gelu(self.up(x)))

    def forward(self, ids, recompute):
        x = self.emb(ids)
        if recompute:
            x = torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=True)
        else:
            x = self.layer(x)
        return self.head(x)


def sdpa_recompute():
    """Embedding, SDPA (causal), GELU MLP, cross-entropy; second micro-batch recomputed."""
    torch.manual_seed(0)
    model = _Block()
    ids = torch.randint(0, 32, (2, 8))

    def run():
        for recompute in (False, True):
            with record_function("neox_perf::forward"):
                logits = model(ids, recompute)
                loss = F.cross_entropy(logits.view(-1, 32), ids.view(-1))
            with record_function("neox_perf::backward"):
                loss.backward()
    events = _record(run)
    ctx = {"dims": {"hidden": 16, "qkv": 48, "ffn_out": 64, "ffn_in": 64, "vocab": 32,
                    "hidden_local": 16, "source": "config"},
           "device": "cpu", "dtype": "fp32", "optimizer_params": None,
           "groups": {"dp": 1, "mp": 1, "stages": 1, "stage": 0, "local_world": 1}}
    _save("sdpa_recompute.json", "embedding + causal SDPA + GELU MLP + cross_entropy, b2 s8 "
          "h16; micro-batch 1 plain, micro-batch 2 under torch.utils.checkpoint", ctx, events)


def _collective_worker(rank, port, out):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = torch.ones(1000)

    def run():
        with record_function("neox_perf::reduce_grads"):
            dist.all_reduce(x)
        with record_function("neox_perf::optimizer_step"):
            dist.all_gather_into_tensor(torch.zeros(20), torch.ones(10))
            dist.all_reduce(torch.ones(()))  # a norm: group unknown
        if rank == 0:
            with record_function("neox_perf::send_activations"):
                dist.send(torch.ones(2, 8, 16), 1)
        else:
            with record_function("neox_perf::recv_activations"):
                dist.recv(torch.zeros(2, 8, 16), 0)
        with record_function("neox_perf::iteration"):
            dist.broadcast(x, 0)
        dist.barrier()
    events = _record(run)
    if rank == 0:
        out.put(events)
    dist.destroy_process_group()


def gloo_collectives():
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx_mp = mp.get_context("spawn")
    q = ctx_mp.Queue()
    procs = [ctx_mp.Process(target=_collective_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    events = q.get(timeout=120)
    for p in procs:
        p.join(timeout=120)
    ctx = {"dims": {"source": "none"}, "device": "cpu", "dtype": "fp32", "optimizer_params": None,
           "groups": {"dp": 2, "mp": 1, "stages": 2, "stage": 0, "local_world": 4}}
    _save("gloo_collectives.json", "rank 0 of 2 (gloo): all_reduce in reduce_grads, "
          "all_gather + scalar all_reduce in optimizer_step, send in send_activations, "
          "broadcast in iteration", ctx, events)


if __name__ == "__main__":
    torch.set_num_threads(1)
    workload_layer()
    sdpa_recompute()
    gloo_collectives()
