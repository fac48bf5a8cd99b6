"""GPT2ModelPipe's layer list, as DeepSpeed sees it, and the pp=0 sequential model.

The N+5 specs follow NeoX's init_specs: embedding (tied "embed" spec unless
no_weight_tying), _pre_transformer_block, N x ParallelTransformerLayerPipe,
_post_transformer_block, NormPipe, head. The names are load-bearing: DeepSpeed's
"type:transformer|mlp" partitioning matches the two block functions as well as the layer
class, PipelineEngine only casts the attention mask for a module class named
GPT2ModelPipe, and PipelineModule only checkpoints ParallelTransformerLayerPipe chunks.
"""
from __future__ import annotations

from functools import partial
from typing import List

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
from torch import nn

from .dims import WorkloadConfig
from .layers import (EmbeddingPipe, NormPipe, ParallelLinearPipe, ParallelTransformerLayerPipe,
                     _logits_helper)
from .tensor_parallel import vocab_parallel_cross_entropy

CHECKPOINTABLE = ["ParallelTransformerLayerPipe"]


def _pre_transformer_block(args):
    x, mask = args
    return x.transpose(0, 1).contiguous(), mask  # [b, s, h] -> [s, b, h]


def _post_transformer_block(args):
    x, _mask = args
    return x.transpose(0, 1).contiguous()


def cross_entropy(output, labels):
    labels, loss_mask = labels
    losses = vocab_parallel_cross_entropy(output.float().contiguous(), labels)
    loss_mask = loss_mask.view(-1)
    return torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()


def layer_specs(wc: WorkloadConfig) -> list:
    specs: list = []
    if wc.tied:
        specs.append(TiedLayerSpec("embed", EmbeddingPipe, wc,
                                   tied_weight_attr="word_embeddings_weight"))
    else:
        specs.append(LayerSpec(EmbeddingPipe, wc))
    specs.append(_pre_transformer_block)
    specs += [LayerSpec(ParallelTransformerLayerPipe, wc, i) for i in range(wc.num_layers)]
    specs.append(_post_transformer_block)
    specs.append(LayerSpec(NormPipe, wc))
    if wc.tied:
        specs.append(TiedLayerSpec("embed", EmbeddingPipe, wc, forward_fn=_logits_helper,
                                   tied_weight_attr="word_embeddings_weight"))
    else:
        specs.append(LayerSpec(ParallelLinearPipe, wc))
    return specs


class GPT2ModelPipe(PipelineModule):
    def __init__(self, wc: WorkloadConfig, topology, partition_method: str,
                 checkpoint_interval: int):
        super().__init__(layers=layer_specs(wc), loss_fn=cross_entropy, topology=topology,
                         activation_checkpoint_interval=checkpoint_interval,
                         partition_method=partition_method,
                         checkpointable_layers=list(CHECKPOINTABLE))


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn  # a function or a partial over the tied embedding (not re-registered)

    def forward(self, x):
        return self.fn(x)


def build_layers(wc: WorkloadConfig) -> List[nn.Module]:
    """The specs built in order, the tied head reusing the embedding module."""
    layers, tied = [], {}
    for spec in layer_specs(wc):
        if isinstance(spec, TiedLayerSpec):
            if spec.key in tied:
                layers.append(_Fn(partial(spec.forward_fn, tied[spec.key])))
            else:
                tied[spec.key] = spec.build()
                layers.append(tied[spec.key])
        elif isinstance(spec, LayerSpec):
            layers.append(spec.build())
        else:
            layers.append(_Fn(spec))
    return layers


class SequentialModel(nn.Module):
    """NeoX's pp=0 model (GPT2ModelPipe.to_sequential): the same layers, run in order,
    with activation checkpointing of whole-transformer-layer chunks."""

    def __init__(self, wc: WorkloadConfig, checkpoint_interval: int):
        super().__init__()
        self.sequential = nn.Sequential(*build_layers(wc))
        self.checkpoint_interval = checkpoint_interval

    def _run(self, start, end):
        def run(*inputs):
            x = inputs[0] if len(inputs) == 1 else inputs
            for layer in self.sequential[start:end]:
                x = layer(x)
            return x
        return run

    def forward(self, forward_input):
        n, k = len(self.sequential), self.checkpoint_interval
        if k == 0:
            return self._run(0, n)(forward_input)
        x = forward_input
        for start in range(0, n, k):
            end = min(start + k, n)
            if not isinstance(x, tuple):
                x = (x,)
            if all(isinstance(m, ParallelTransformerLayerPipe) for m in self.sequential[start:end]):
                x = ds_checkpointing.checkpoint(self._run(start, end), *x)
            else:
                x = self._run(start, end)(*x)
        return x


def count_params(module: nn.Module) -> int:
    # ds_numel: under ZeRO-3 a parameter's local tensor is a shard; count the whole.
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters() if p.requires_grad)
