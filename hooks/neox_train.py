"""What deepy.py launches in place of NeoX's train.py on a CPU-only machine.

    python deepy.py /path/to/neox_train.py config.yml     # cwd: the NeoX checkout

NeoX's training code asks for CUDA in a few places that have a CPU meaning (see
../shared/reference/gpt-neox-on-cpu.md): those names are shimmed here, in this process only,
and NeoX's unmodified `train.main()` runs with the arguments deepy.py passed. Every shim
keeps NeoX's own behaviour on a machine that does have CUDA: they are only installed when
torch sees no GPU.

Optional records (environment, for the harness): NEOX_PERF_NEOX_LOSS_FILE gets one JSON
line per iteration and rank with the exact loss (float.hex) and the train_step wall time;
NEOX_PERF_NEOX_MEMORY_FILE one JSON line per rank with hooks.memory's measurement (the
persistent state per component), taken after training.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time


def _neox_src() -> str:
    src = os.environ.get("NEOX_PERF_NEOX_SRC") or os.getcwd()
    if not os.path.isfile(os.path.join(src, "megatron", "training.py")):
        sys.exit(f"neox_train: {src} is not a GPT-NeoX checkout (no megatron/training.py); "
                 f"set NEOX_PERF_NEOX_SRC")
    return os.path.abspath(src)


def _cpu_shims(torch) -> None:
    cuda = torch.cuda
    # Timers synchronise, parameter counting and batch broadcasts ask for "the" device.
    cuda.synchronize = lambda *a, **k: None
    cuda.current_device = lambda: "cpu"
    # NeoX builds a few tensors as torch.cuda.LongTensor(...): the CPU type is the meaning.
    for name in ("LongTensor", "FloatTensor", "IntTensor", "ByteTensor", "BoolTensor",
                 "HalfTensor", "BFloat16Tensor", "DoubleTensor"):
        if hasattr(torch, name):
            setattr(cuda, name, getattr(torch, name))
    torch.Tensor.cuda = lambda self, *a, **k: self


@contextlib.contextmanager
def _devices_as_ranks(torch):
    """While NeoX initialises: one 'device' per local rank, so it builds the model-parallel
    groups and the RNG tracker as on a GPU node (they are skipped when device_count() == 0)."""
    cuda = torch.cuda
    saved = cuda.device_count, cuda.set_device
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)
    cuda.device_count = lambda: local
    cuda.set_device = lambda *a, **k: None
    try:
        yield
    finally:
        cuda.device_count, cuda.set_device = saved


def _patch_initialize(training, torch) -> None:
    original = training.initialize_megatron

    def initialize_megatron(neox_args, allow_no_cuda=False):
        with _devices_as_ranks(torch):
            return original(neox_args, allow_no_cuda=True)

    training.initialize_megatron = initialize_megatron


def _record_losses(training, path: str) -> None:
    original = training.train_step
    count = [0]

    def train_step(neox_args, *args, **kwargs):
        t0 = time.perf_counter()
        out = original(neox_args, *args, **kwargs)
        seconds = time.perf_counter() - t0
        metrics = out[0] if isinstance(out, tuple) else out
        loss = metrics.get("lm_loss") if isinstance(metrics, dict) else None
        value = float(loss.item() if hasattr(loss, "item") else loss) if loss is not None else None
        rank = int(os.environ.get("RANK", "0"))
        count[0] += 1
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"rank": rank, "iteration": count[0],
                                 "loss": value.hex() if value is not None else None,
                                 "seconds": seconds}) + "\n")
        return out

    training.train_step = train_step


def _record_memory(training, path: str):
    """Keeps NeoX's engine when it is built; returns the callable that writes its state."""
    from neox_perf.hooks.memory import MemoryProbe
    original = training.setup_model_and_optimizer
    held = {}

    def setup_model_and_optimizer(*args, **kwargs):
        out = original(*args, **kwargs)
        engine = out[0]
        probe = MemoryProbe(getattr(getattr(engine, "device", None), "type", "cpu"))
        held.update(engine=engine, probe=probe)
        return out

    training.setup_model_and_optimizer = setup_model_and_optimizer

    def write():
        if not held:
            return
        got = held["probe"].measure(held["engine"])
        got["rank"] = int(os.environ.get("RANK", "0"))
        got["stage"] = int(getattr(held["engine"], "stage_id", 0) or 0)
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(got) + "\n")
    return write


def main() -> None:
    src = _neox_src()
    if src not in sys.path:
        sys.path.insert(0, src)
    import torch
    if not torch.cuda.is_available():
        _cpu_shims(torch)
    import megatron.training as training
    if not torch.cuda.is_available():
        _patch_initialize(training, torch)
    loss_file = os.environ.get("NEOX_PERF_NEOX_LOSS_FILE")
    if loss_file:
        _record_losses(training, loss_file)
    memory_file = os.environ.get("NEOX_PERF_NEOX_MEMORY_FILE")
    write_memory = _record_memory(training, memory_file) if memory_file else None
    import train  # NeoX's train.py, from the checkout
    train.main()
    if write_memory is not None:
        write_memory()


if __name__ == "__main__":
    main()
    try:
        from neox_perf.calibration.launch import exit_rank
    except ImportError:  # neox-perf not importable by NeoX's python: a plain exit
        sys.exit(0)
    exit_rank(0)  # past NeoX's train.main(), teardown can abort a finished rank (see there)
