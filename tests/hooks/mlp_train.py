"""A plain DeepSpeed script, not the reference workload: a LayerNorm + 4x MLP classifier
trained with deepspeed.initialize / engine.backward / engine.step. It knows nothing of
neox-perf. Prints one JSON line of losses on rank 0.

    torchrun --nproc_per_node 2 tests/hooks/mlp_train.py --iters 8 [--gas 2]
"""
import argparse
import json

import deepspeed
import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self, d=32, classes=10):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = x + self.down(F.gelu(self.up(self.norm(x))))
        return self.head(h)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--gas", type=int, default=2)
    p.add_argument("--local_rank", type=int, default=0)
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = Net()
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": args.gas,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
              "steps_per_print": 10 ** 9}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(1234 + rank)
    losses = []
    for it in range(args.iters):
        for _ in range(args.gas):
            x = torch.randn(8, 32, generator=g)
            y = torch.randint(0, 10, (8,), generator=g)
            loss = F.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
        losses.append(float(loss))
    if rank == 0:
        print("LOSSES " + json.dumps(losses), flush=True)
    # Without an orderly teardown gloo's threads can abort the process at interpreter exit.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
