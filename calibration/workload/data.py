"""Synthetic, deterministic token batches in NeoX's pipe format.

A micro-batch is ((tokens, position_ids, attention_mask), (labels, loss_mask)), as
NeoX's get_batch_pipe returns. Tokens follow a Zipf-like law so the loss visibly falls
within a few steps. Each micro-batch is drawn from its own generator keyed by (seed,
iteration, data-parallel rank, micro index): the same on every pipe stage and TP rank,
identical across runs, and independent of how many micro-batches were drawn before.
"""
from __future__ import annotations

import hashlib

import torch


def _seed(*parts) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def causal_mask(seq: int, device) -> torch.Tensor:
    """[1, 1, s, s] bool, True where attention is masked (NeoX's get_attn_mask)."""
    return torch.tril(torch.ones((1, seq, seq), device=device)).view(1, 1, seq, seq) < 0.5


class SyntheticTokens:
    def __init__(self, seed: int, vocab_size: int, seq_length: int, micro_batch: int,
                 dp_rank: int, device):
        self.seed, self.seq, self.micro, self.dp_rank = seed, seq_length, micro_batch, dp_rank
        self.device = device
        ranks = torch.arange(vocab_size, dtype=torch.float64)
        self.probs = (1.0 / (ranks + 10.0)).float()
        self.mask = causal_mask(seq_length, device)
        self.positions = torch.arange(seq_length, device=device).unsqueeze(0).expand(
            micro_batch, -1)

    def micro_batch(self, iteration: int, index: int):
        g = torch.Generator().manual_seed(_seed(self.seed, iteration, self.dp_rank, index))
        text = torch.multinomial(self.probs, self.micro * (self.seq + 1), replacement=True,
                                 generator=g).view(self.micro, self.seq + 1).to(self.device)
        tokens = text[:, :-1].contiguous()
        labels = text[:, 1:].contiguous()
        loss_mask = torch.ones(labels.shape, dtype=torch.float, device=self.device)
        return (tokens, self.positions, self.mask), (labels, loss_mask)

    def iterator(self, iteration: int, micro_batches: int):
        for i in range(micro_batches):
            yield self.micro_batch(iteration, i)
