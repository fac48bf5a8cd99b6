"""Rank script: train the reference workload under DeepSpeed's real PipelineEngine and record
every communication call the engine makes, per train_batch and per pipeline instruction.

    torchrun --nproc_per_node 4 tests/workload/record_engine_collectives.py \
        --record DIR --config pp2mp2.yml --iters 2 --vocab-size 500 --out result.json

Arguments after --record are the workload's own (neox_perf.calibration.workload.train). The
calls are caught where DeepSpeed's engine makes them: the engine, its p2p module and
PartitionedTensor all call through ``deepspeed.comm`` (``from deepspeed import comm as
dist``), whose module attributes are looked up at each call, so replacing them here sees
every call those code paths make. The model's own tensor-parallel all-reduces go straight to
torch.distributed and are not recorded. Each rank writes DIR/rank<R>.json:
{"rank", "stage", "iterations": [[{op, phase, numel, dtype, group, peer}, ...], ...]}.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# deepspeed.comm name -> (where its tensor is: positional index, keyword), peer keyword
RECORDED = {
    "all_gather_into_tensor": ((1, "input_tensor"), None),  # the rank's own chunk
    "all_gather": ((1, "tensor"), None),
    "broadcast": ((0, "tensor"), "src"),
    "all_reduce": ((0, "tensor"), None),
    "reduce_scatter_tensor": ((1, "input_tensor"), None),
    "send": ((0, "tensor"), "dst"),
    "recv": ((0, "tensor"), "src"),
    "isend": ((0, "tensor"), "dst"),
    "irecv": ((0, "tensor"), "src"),
}


def _install(state):
    import deepspeed.comm as ds_comm
    import torch.distributed as tdist
    from deepspeed.runtime.pipe.engine import PipelineEngine

    def wrap(name, fn):
        (pos, key), peer_key = RECORDED[name]

        def run(*args, **kwargs):
            if state["calls"] is not None:
                tensor = kwargs.get(key, args[pos] if len(args) > pos else None)
                group = kwargs.get("group")
                if group is None and name == "broadcast" and len(args) > 2:
                    group = args[2]
                peer = kwargs.get(peer_key, args[1] if peer_key and len(args) > 1 else None)
                state["calls"].append({
                    "op": name, "phase": state["phase"], "numel": int(tensor.numel()),
                    "dtype": str(tensor.dtype).replace("torch.", ""),
                    "group": (sorted(tdist.get_process_group_ranks(group)) if group is not None
                              else list(range(tdist.get_world_size()))),
                    "peer": peer})
            return fn(*args, **kwargs)
        return run

    for name in RECORDED:
        setattr(ds_comm, name, wrap(name, getattr(ds_comm, name)))

    def label(phase, fn):
        def run(*args, **kwargs):
            state["phase"] = phase
            try:
                return fn(*args, **kwargs)
            finally:
                state["phase"] = "train_batch"
        return run

    # The schedule's instructions run through this class-level table of plain functions.
    PipelineEngine._INSTRUCTION_MAP = {instr: label(instr.__name__, fn)
                                       for instr, fn in PipelineEngine._INSTRUCTION_MAP.items()}
    train_batch = PipelineEngine.train_batch

    def recorded_train_batch(self, *args, **kwargs):
        state["stage"] = self.stage_id
        state["calls"], state["phase"] = [], "train_batch"
        try:
            return train_batch(self, *args, **kwargs)
        finally:
            state["iterations"].append(state["calls"])
            state["calls"] = None
    PipelineEngine.train_batch = recorded_train_batch


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    i = argv.index("--record")
    where = Path(argv[i + 1])
    del argv[i:i + 2]
    state = {"calls": None, "phase": None, "stage": None, "iterations": []}
    _install(state)
    from neox_perf.calibration.workload import train
    code = train.main(argv)
    rank = int(os.environ.get("RANK", "0"))
    where.mkdir(parents=True, exist_ok=True)
    (where / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "stage": state["stage"], "iterations": state["iterations"]}))
    return code


if __name__ == "__main__":
    from neox_perf.calibration.launch import exit_rank
    exit_rank(main())
