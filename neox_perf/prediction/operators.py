"""The operator calls one training iteration makes, per pipeline stage, with no timing.

Each transformer layer, the embedding and the head become the operators of the paper's
Table I with *generic per-rank shapes* (see opspec), so GQA, gated MLPs and odd widths are
described exactly rather than as multiples of d. Communication is counted from GPT-NeoX's
and DeepSpeed's real code:
- tensor parallel (megatron/mpu/mappings.py): a RowParallelLinear all-reduces its output in
  forward; a ColumnParallelLinear all-reduces its input gradient in backward. A layer has
  two of each (attention dense + MLP out; QKV + MLP in), except gpt_j_residual, whose two
  branches share a single forward reduction. VocabParallelEmbedding reduces in forward; the
  column-parallel head reduces its input gradient in backward.
- pipeline: DeepSpeed partitions the p2p activation over the tensor-parallel ranks
  (PipelineEngine.is_pipe_partitioned = is_model_parallel), so each rank sends b*l*d/mp, and
  all-gathers it back over the tensor-parallel group where it is needed (pp_allgather, see
  _partition_allgathers).
- data parallel (runtime/engine.py, runtime/zero/stage_1_and_2.py): without ZeRO the engine
  all-reduces the flattened gradients in MEMORY_OPT_ALLREDUCE_SIZE (5e8) buckets whatever the
  config says; ZeRO-1/2 all-reduce them whole in reduce_bucket_size buckets (reduce_scatter
  with the default use_multi_rank_bucket_allreduce is an all-reduce, each rank keeping its
  slices) -- once per iteration at stage 1, in every micro-batch's backward at stage 2 -- and,
  after the step, all-gather the updated partitions (counted here in allgather_bucket_size
  calls; with all_gather_into_tensor, as in any recent torch, DeepSpeed makes one call per
  parameter group instead: the same bytes).
Ranks are placed as DeepSpeed's PipeModelDataParallelTopology does: model innermost, then
data, then pipe, filling nodes of gpus_per_node GPUs in rank order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..config.specs import NeoxConfig
from .opspec import FP16_BYTES, op_bytes, op_flops

Features = Tuple[Tuple[str, float], ...]

# an fp32 run: predict.predict replaces this with how the profile's GPU prices it from its
# samples' precision (predictors/achievable.py), or drops it where the samples are fp32
FP32_FROM_FP16 = "fp32 training is predicted from fp16 operator samples"


@dataclass(frozen=True)
class OpCall:
    op: str  # opspec operator name
    phase: str  # fwd | bwd | step
    features: Features  # per-rank workload shape, sorted by name
    count: float  # calls per micro-batch (per iteration for the optimizer)
    scope: str  # layer | embedding | head | loss | recompute | optimizer
    flops: float  # per call
    bytes: float  # per call
    # framework calls one call of the operator issues: each costs the host its dispatch time
    # (StepTerms.dispatch_s), so a layer of small kernels, or an operator the program runs as
    # several of them, is host-bound sooner than its sampled timings say
    launches: int = 1

    def feature_dict(self) -> Dict[str, float]:
        return dict(self.features)


def framework_calls(calls) -> float:
    """Framework calls a run of calls issues, each costing the host StepTerms.dispatch_s: every
    operator's launches times its count (collectives are not counted)."""
    return sum(c.launches * c.count for c in calls if isinstance(c, OpCall))


@dataclass(frozen=True)
class CommCall:
    kind: str  # allreduce | allgather | p2p
    # mp_allreduce | dp_allreduce | dp_allgather | pp_p2p | tied_allreduce | pp_allgather
    purpose: str
    phase: str  # fwd | bwd | step
    elements: float  # fp16 elements per rank, as the collective samples define them
    nodes: int  # nodes the group spans
    gpus_per_node: int  # group members per node
    count: float  # calls per micro-batch (per iteration for dp/tied/allgather)
    scope: str


@dataclass(frozen=True)
class StageShape:
    """What the decomposition needs to know about one pipeline stage."""

    index: int
    transformer_layers: int
    has_embedding: bool
    has_head: bool
    params_per_rank: int  # parameters this stage's ranks hold (incl. a tied embedding copy)


@dataclass(frozen=True)
class StageWork:
    index: int
    transformer_layers: int
    layer_forward: Tuple[object, ...]  # one transformer layer's fwd calls (count = per layer)
    layer_backward: Tuple[object, ...]
    # non-layer calls of the stage per micro-batch (embedding, head, loss, and the all-gathers
    # that rebuild the pipeline's partitioned tensors, which open its forward / backward)
    forward: Tuple[object, ...]
    backward: Tuple[object, ...]
    recompute_layers: int  # layers whose forward reruns in backward (activation checkpointing)
    send_activation: Optional[CommCall]
    send_gradient: Optional[CommCall]
    grad_sync: Tuple[CommCall, ...]
    tied_sync: Tuple[CommCall, ...]
    optimizer: OpCall
    param_allgather: Tuple[CommCall, ...]
    # Sizes the profile's engine terms scale with (see estimate.EngineTerms): elements of one
    # layer's activations on this rank, of the logits (head stage), and parameter tensors.
    activation_elements: float = 0.0
    logits_elements: float = 0.0
    param_tensors: int = 0
    params_per_rank: int = 0


@dataclass(frozen=True)
class Decomposition:
    stages: Tuple[StageWork, ...]
    micro_batches: int
    dtype_bytes: int
    notes: Tuple[str, ...]  # approximations the user should know about
    zero_stage: int = 0
    precision: str = ""  # what the run computes in (fp16 | bfloat16 | fp32)
    pipeline_engine: bool = False  # DeepSpeed's PipelineEngine (pipe_parallel_size >= 1) runs it
    gpus_per_node: int = 1  # of the cluster the ranks are placed on


def stage_shapes(derived, transformer_layers: Optional[Sequence[int]] = None) -> List[StageShape]:
    """The decomposition's view of each derived pipeline stage. ``transformer_layers``
    overrides the derived count per stage, for a run whose engine partitioned differently."""
    stages = derived.stages
    if transformer_layers is not None and len(transformer_layers) != len(stages):
        raise ValueError(f"{len(transformer_layers)} layer counts for {len(stages)} stages")
    last = len(stages) - 1
    return [StageShape(index=s.index,
                       transformer_layers=(transformer_layers[s.index] if transformer_layers is not None
                                           else s.transformer_layers),
                       has_embedding=s.index == 0, has_head=s.index == last,
                       params_per_rank=s.params_per_rank) for s in stages]


def group_placement(size: int, stride: int, gpus_per_node: int,
                    firsts: Optional[Sequence[int]] = None) -> Tuple[int, int]:
    """(nodes, members per node) of a group of `size` ranks spaced `stride` apart.

    firsts: the groups' first ranks, when only some offsets form such a group (the tied
    embedding pairs the first stage's ranks with the last's). Where node boundaries do not
    fall between groups evenly, the group spanning the most nodes is returned: collectives
    of one kind run in lockstep, so the slowest placement sets the pace.
    """
    if size <= 1:
        return 1, 1
    if stride >= gpus_per_node:
        return size, 1
    if firsts is None and gpus_per_node % stride == 0:
        per_node = max(1, min(size, gpus_per_node // stride))
        return math.ceil(size / per_node), per_node
    worst = (1, 1)
    for first in (firsts if firsts is not None else range(stride))[:4096]:
        per: Dict[int, int] = {}
        for i in range(size):
            node = (first + i * stride) // gpus_per_node
            per[node] = per.get(node, 0) + 1
        worst = max(worst, (len(per), max(per.values())))
    return worst


def tensor_parallel_placement(mp: int, gpus_per_node: int) -> Tuple[int, int]:
    """(nodes, per node) of one tensor-parallel group: its ranks are adjacent (the innermost axis
    of DeepSpeed's grid). The decomposition prices its all-reduces on it, check warns where it
    spans nodes (advice.tensor_parallel_verdicts) and plan marks those layouts: one placement."""
    return group_placement(mp, 1, gpus_per_node)


def p2p_placement(boundary: int, stage_ranks: int, gpus_per_node: int) -> Tuple[int, int]:
    """(nodes, per node) of the sends between stage ``boundary`` and the next: each rank of the
    stage sends to the rank ``stage_ranks`` after it (pipe is the outermost axis). The pairs run
    in lockstep, so one pair across a node boundary puts the whole boundary across nodes; where a
    stage is smaller than a node, some boundaries fall inside a node and some on its edge."""
    first = boundary * stage_ranks
    # a pair group spaced stage_ranks apart, from each rank of the stage (one node's worth)
    return group_placement(2, stage_ranks, gpus_per_node,
                           range(first, first + min(stage_ranks, gpus_per_node)))


def _call(op: str, phase: str, count: float, scope: str, dtype_bytes: int, launches: int = 1,
          **features) -> OpCall:
    feats = tuple(sorted((k, float(v)) for k, v in features.items()))
    fd = dict(feats)
    if op == "optimizer":
        phase_key = "step"
    else:
        phase_key = phase
    return OpCall(op, phase, feats, float(count), scope,
                  float(op_flops(op, phase_key, fd, dtype_bytes)),
                  float(op_bytes(op, phase_key, fd, dtype_bytes)), int(launches))


def mlp_widths(cfg: NeoxConfig) -> Tuple[int, int]:
    """(linear1 output, linear2 input) widths: derive.params holds NeoX's ParallelMLP rule."""
    from ..derive.params import mlp_widths as model_mlp_widths
    return model_mlp_widths(cfg.model)


def _unfused_softmax_launches(opts, precision: str) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """(fwd, bwd) framework calls of NeoX's unfused softmax path, for the fillmask and the
    softmax operator: FusedScaleMaskSoftmax.forward_torch_softmax upcasts 16-bit scores when
    the softmax runs in fp32 (attention_softmax_in_fp32, forced by
    apply_query_key_layer_scaling), multiplies by the layer-number scale under
    apply_query_key_layer_scaling, masks (gpt2_attention_mask_func builds the mask value as a
    device tensor, then masked_fill_), runs the softmax and casts back. Autograd runs one
    backward call per forward call that carries a gradient (the mask value's tensor has none)."""
    half = precision in ("fp16", "bfloat16")
    fp32 = int(half and (opts.attention_softmax_in_fp32 or opts.apply_query_key_layer_scaling))
    scale = int(opts.apply_query_key_layer_scaling)
    mask = (2 + scale + fp32, 1 + scale + fp32)
    soft = (1 + fp32, 1 + fp32)
    return mask, soft


def _layer_calls(cfg: NeoxConfig, dt: int, mp_group: Tuple[int, int], notes: List[str],
                 precision: str) -> Tuple[Tuple[object, ...], Tuple[object, ...]]:
    from ..derive.options import DeriveOptions
    opts = DeriveOptions.from_values(cfg.values)
    m, mp = cfg.model, cfg.parallel.model_parallel_size
    b, l, d = cfg.training.micro_batch_size, m.seq_length, m.hidden_size
    tokens, hd = b * l, m.head_dim
    heads, kv = m.num_attention_heads // mp, max(m.num_kv_heads // mp, 1)
    norm = "rmsnorm" if "rms" in m.norm else "layernorm"
    ffn_out, ffn_in = mlp_widths(cfg)
    fwd: List[object] = []
    bwd: List[object] = []

    def both(op, count=1, launches=(1, 1), **f):
        fwd.append(_call(op, "fwd", count, "layer", dt, launches[0], **f))
        bwd.append(_call(op, "bwd", count, "layer", dt, launches[1], **f))

    both(norm, 2, tokens=tokens, d=d)  # input_layernorm and post_attention_layernorm
    both("linear1", m=tokens, k=d, n=(d + 2 * m.num_kv_heads * hd) // mp)
    if m.pos_emb == "rotary":
        rot = int(hd * m.rotary_pct)
        if rot > 0:
            both("rope", tokens=tokens, heads=(heads + kv) / 2.0, rot_dim=rot)
    kinds = set(m.attention_types)
    if kinds - {"global", "flash"}:
        notes.append(f"attention types {sorted(kinds - {'global', 'flash'})} are predicted as "
                     f"dense global attention")
    if m.uses_flash and len(kinds) == 1:
        both("flash_attention", b=b, l=l, heads=heads, head_dim=hd, causal=1)
    else:
        batch = b * heads
        both("qk", batch=batch, l=l, head_dim=hd)
        # NeoX's FusedScaleMaskSoftmax takes the fused kernel only for 16-bit inputs with
        # 16 < sk <= 2048 (megatron/model/fused_softmax.py); otherwise masked_fill + softmax.
        fused = (m.fused_softmax and precision in ("fp16", "bfloat16")
                 and 16 < l <= 2048 and batch % 4 == 0)
        if fused:
            both("fused_softmax", batch=batch, l=l)
        else:
            mask, soft = _unfused_softmax_launches(opts, precision)
            both("fillmask", batch=batch, l=l, launches=mask)
            both("softmax", batch=batch, l=l, launches=soft)
        if opts.attention_dropout > 0:
            # ParallelSelfAttention drops out the probabilities before scores.V (torch's
            # native_dropout: one kernel each way); nn.Dropout(0) launches nothing.
            both("attn_dropout", batch=batch, l=l)
        both("av", batch=batch, l=l, head_dim=hd)
    both("linear2", m=tokens, k=d // mp, n=d)
    both("linear3", m=tokens, k=d, n=ffn_out // mp)
    if m.activation != "gelu":
        notes.append(f"activation {m.activation!r} is predicted with the GeLU regressor at its width")
    both("gelu", tokens=tokens, width=ffn_out // mp)
    both("linear4", m=tokens, k=ffn_in // mp, n=d)
    both("res_add", 2, tokens=tokens, d=d)
    if mp > 1:
        nodes, gpn = mp_group
        fwd_reductions = 1 if m.gpt_j_residual else 2
        fwd.append(CommCall("allreduce", "mp_allreduce", "fwd", tokens * d, nodes, gpn,
                            fwd_reductions, "layer"))
        bwd.append(CommCall("allreduce", "mp_allreduce", "bwd", tokens * d, nodes, gpn, 2, "layer"))
    return tuple(fwd), tuple(bwd)


def _norm_tensors(norm: str) -> int:
    return {"layernorm": 2, "non_parametric_layernorm": 0}.get(norm, 1)


def param_tensors(cfg: NeoxConfig, st: "StageShape") -> int:
    """Parameter tensors one rank of the stage holds (weights and biases are separate tensors;
    an optimizer and gradient clipping loop over them)."""
    m = cfg.model
    per_layer = 4 + (2 if m.use_bias_in_attn_linear else 0) + (2 if m.use_bias_in_mlp else 0)
    per_layer += 2 * _norm_tensors(m.norm)
    n = st.transformer_layers * per_layer
    if st.has_embedding:
        n += 1 + (1 if m.pos_emb == "learned" else 0)
    if st.has_head:
        n += _norm_tensors(m.norm) + (1 if m.no_weight_tying or not st.has_embedding else 0)
    return n


def _partition_allgathers(index: int, num_stages: int, mp: int, elements: float,
                          mp_group: Tuple[int, int]) -> Tuple[Tuple[CommCall, ...], Tuple[CommCall, ...]]:
    """(forward, backward) all-gathers of one micro-batch with which DeepSpeed's PipelineEngine
    rebuilds the tensors it partitions over the tensor-parallel ranks for the p2p.

    With model parallelism PipelineEngine sets is_pipe_partitioned and is_grad_partitioned
    (deepspeed/runtime/pipe/engine.py: is_model_parallel and the config's pipeline
    pipe_partitioned / grad_partitioned, both True by default; neither NeoX nor
    Megatron-DeepSpeed changes them). The first tensor of a stage's output (the hidden
    states) is split into mp equal chunks
    (runtime/utils.py PartitionedTensor; b*l*d always divides by mp) and each rank sends its
    own chunk. PartitionedTensor.full() gathers the chunks back with one all_gather_into_tensor
    over the slice-parallel group (grid.get_slice_parallel_group(): the tensor-parallel ranks,
    adjacent in DeepSpeed's rank order), each rank contributing b*l*d/mp elements:
    - forward, every stage but the first: _exec_forward_pass gathers the received activation
      before running its layers;
    - backward, every stage but the last: _exec_backward_pass gathers its own output back
      (its data was freed after the send, autograd needs it whole) and then the received
      partitioned gradient, before running backward.
    Both sit on the receiving rank's critical path, after the recv that fed them. Per
    micro-batch: first stage 0 + 2, middle stages 1 + 2, last stage 1 + 0
    (tests/workload/test_pipe_partition_collectives.py records them in the real engine).
    Not priced (docs/pipeline-partitioning.md): the small meta tensor each partitioned send
    adds (a latency per send, of the kind the fitted p2p step term carries), and the [1, 1, l, l] attention
    mask NeoX's GPT2ModelPipe sends whole beside the activation (Megatron-DeepSpeed, which
    the development set ran, keeps it out of the p2p)."""
    if num_stages < 2 or mp < 2:
        return (), ()
    fwd = () if index == 0 else (CommCall("allgather", "pp_allgather", "fwd", elements, *mp_group,
                                          1, "pipeline"),)
    bwd = () if index == num_stages - 1 else (CommCall("allgather", "pp_allgather", "bwd", elements,
                                                       *mp_group, 2, "pipeline"),)
    return fwd, bwd


def _partitioning_changed(cfg: NeoxConfig) -> bool:
    """Whether the config hands DeepSpeed a pipeline section (NeoX merges deepspeed_extra_args
    into the DeepSpeed config) that turns either partitioning off."""
    extra = cfg.values.get("deepspeed_extra_args")
    pipeline = extra.get("pipeline") if isinstance(extra, dict) else None
    return isinstance(pipeline, dict) and any(
        pipeline.get(k, True) is not True for k in ("pipe_partitioned", "grad_partitioned"))


# deepspeed/runtime/constants.py: the bucket of the non-ZeRO gradient all-reduce
MEMORY_OPT_ALLREDUCE_SIZE = 500000000


def _buckets(total: float, bucket: int) -> List[Tuple[float, int]]:
    """[(elements, count)] of DeepSpeed-style fixed-size buckets covering `total`."""
    if total <= 0:
        return []
    bucket = max(int(bucket), 1)
    full, rest = divmod(int(total), bucket)
    out = [(float(bucket), full)] if full else []
    if rest:
        out.append((float(rest), 1))
    return out


def decompose(cfg: NeoxConfig, padded_vocab: int, stages: Sequence[StageShape],
              precision: Optional[str] = None, pipe_sends_mask: bool = True) -> Decomposition:
    """precision: what the run really computes in, when that is not the config's (the
    reference workload runs fp32 on a CPU whatever the config asks); default the config's.

    pipe_sends_mask: whether each forward send between stages carries the attention mask.
    NeoX's pipeline layers pass (hidden, mask) tuples, and DeepSpeed's PipelineEngine casts
    the [1, 1, l, l] bool mask to fp16 to send it with every activation ("NCCL does not like to
    send torch.BoolTensor types", deepspeed/runtime/pipe/engine.py), unpartitioned: at l = 2048
    that is 8 MiB per micro-batch, as much as a 20B model's activation chunk at mp 4, and it grows
    with l^2. Megatron-DeepSpeed's GPTModelPipe keeps the mask in its args instead (the dev set's
    runs: predictors/fitting/devset.py passes False)."""
    m, par, tr = cfg.model, cfg.parallel, cfg.training
    mp, dp, gpn = par.model_parallel_size, par.data_parallel_size, par.gpus_per_node
    run_precision = precision or tr.precision
    dt = 4 if run_precision == "fp32" else 2
    b, l, d = tr.micro_batch_size, m.seq_length, m.hidden_size
    tokens, vocab = b * l, padded_vocab // mp
    notes: List[str] = []
    mp_group = tensor_parallel_placement(mp, gpn)
    dp_group = group_placement(dp, mp, gpn)
    layer_fwd, layer_bwd = _layer_calls(cfg, dt, mp_group, notes, run_precision)
    recompute = tr.checkpoint_activations
    # fp32_allreduce reduces 16-bit gradients in fp32: twice the bytes of the run's elements
    grad_elems_factor = 4 // dt if tr.fp32_allreduce else 1
    tied = not m.no_weight_tying and len(stages) > 1
    out: List[StageWork] = []
    for st in stages:
        fwd: List[object] = []
        bwd: List[object] = []
        if st.has_embedding:
            fwd.append(_call("embedding", "fwd", 1, "embedding", dt, tokens=tokens, vocab=vocab, d=d))
            bwd.append(_call("embedding", "bwd", 1, "embedding", dt, tokens=tokens, vocab=vocab, d=d))
            if mp > 1:
                fwd.append(CommCall("allreduce", "mp_allreduce", "fwd", tokens * d, *mp_group, 1,
                                    "embedding"))
        if st.has_head:
            norm = "rmsnorm" if "rms" in m.norm else "layernorm"
            for phase, seq in (("fwd", fwd), ("bwd", bwd)):
                seq.append(_call(norm, phase, 1, "head", dt, tokens=tokens, d=d))
                seq.append(_call("linear_final", phase, 1, "head", dt, m=tokens, k=d, n=vocab))
                seq.append(_call("cross_entropy", phase, 1, "loss", dt, tokens=tokens, vocab=vocab))
            if mp > 1:
                bwd.append(CommCall("allreduce", "mp_allreduce", "bwd", tokens * d, *mp_group, 1,
                                    "head"))
        gather_fwd, gather_bwd = _partition_allgathers(st.index, len(stages), mp, tokens * d / mp,
                                                       mp_group)
        fwd[:0], bwd[:0] = gather_fwd, gather_bwd
        last = st.index == len(stages) - 1
        # the fp16 mask counted in elements of the run's dtype, which the collective samples count in
        mask = l * l * FP16_BYTES / dt if pipe_sends_mask else 0.0
        send_act = None if last else CommCall("p2p", "pp_p2p", "fwd", tokens * d / mp + mask,
                                              *p2p_placement(st.index, mp * dp, gpn), 1, "pipeline")
        send_grad = None if st.index == 0 else CommCall("p2p", "pp_p2p", "bwd", tokens * d / mp,
                                                        *p2p_placement(st.index - 1, mp * dp, gpn), 1,
                                                        "pipeline")
        grad_sync: Tuple[CommCall, ...] = ()
        gather: Tuple[CommCall, ...] = ()
        if dp > 1:
            bucket = tr.reduce_bucket_size if tr.zero_stage >= 1 else MEMORY_OPT_ALLREDUCE_SIZE
            per_iteration = tr.gradient_accumulation_steps if tr.zero_stage == 2 else 1
            grad_sync = tuple(
                CommCall("allreduce", "dp_allreduce", "step", e * grad_elems_factor, *dp_group,
                         n * per_iteration, "gradients")
                for e, n in _buckets(st.params_per_rank, bucket))
            if tr.zero_stage >= 1:
                calls = max(1, math.ceil(st.params_per_rank / max(tr.allgather_bucket_size, 1)))
                gather = (CommCall("allgather", "dp_allgather", "step",
                                   st.params_per_rank / dp / calls, *dp_group, calls, "parameters"),)
        tied_sync: Tuple[CommCall, ...] = ()
        if tied and (st.has_embedding or st.has_head):
            # first and last stage: ranks (stages - 1) * mp * dp apart, on one node when both fit
            tied_group = group_placement(2, (len(stages) - 1) * mp * dp, gpn, range(mp * dp))
            tied_sync = (CommCall("allreduce", "tied_allreduce", "step", vocab * d, *tied_group, 1,
                                  "tied embedding"),)
        opt_params = st.params_per_rank / dp if (tr.zero_stage >= 1 and dp > 1) else st.params_per_rank
        optimizer = _call("optimizer", "step", 1, "optimizer", dt, params=opt_params)
        out.append(StageWork(
            index=st.index, transformer_layers=st.transformer_layers,
            layer_forward=layer_fwd, layer_backward=layer_bwd, forward=tuple(fwd),
            backward=tuple(bwd), recompute_layers=st.transformer_layers if recompute else 0,
            send_activation=send_act, send_gradient=send_grad, grad_sync=grad_sync,
            tied_sync=tied_sync, optimizer=optimizer, param_allgather=gather,
            activation_elements=float(tokens * (d + mlp_widths(cfg)[0] // mp)),
            logits_elements=float(tokens * vocab) if st.has_head else 0.0,
            param_tensors=param_tensors(cfg, st), params_per_rank=st.params_per_rank))
    if mp > 1 and len(stages) > 1 and _partitioning_changed(cfg):
        notes.append("deepspeed_extra_args.pipeline changes pipe_partitioned/grad_partitioned: "
                     "the p2p is predicted as DeepSpeed's default (partitioned over the "
                     "tensor-parallel ranks, all-gathered on receipt)")
    if par.sequence_parallel and mp > 1:
        notes.append("sequence_parallel is predicted as plain tensor parallelism")
    if precision is None and tr.precision == "fp32":  # an explicit precision is the caller's word
        notes.append(FP32_FROM_FP16)
    return Decomposition(tuple(out), tr.gradient_accumulation_steps, dt, tuple(dict.fromkeys(notes)),
                         zero_stage=tr.zero_stage, precision=run_precision,
                         pipeline_engine=par.pipe_parallel_size >= 1, gpus_per_node=gpn)
