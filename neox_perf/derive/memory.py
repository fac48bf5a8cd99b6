"""GPU bytes per pipeline stage: model states (DeepSpeed 0.19.8's optimizer wrappers) + activations.

Model states follow what DeepSpeed really allocates, chosen like engine._do_optimizer_sanity_check:
  * fp32, no ZeRO: the plain torch optimizer (no master copy).
  * fp16 (or bf16 without a PipelineEngine), no ZeRO: FP16_Optimizer -- flat fp32 master of every
    parameter; step() builds a flat fp32 copy of all gradients.
  * bf16 with the PipelineEngine (or ZeRO-1 with fp32 grad accumulation): BF16_Optimizer -- a
    full gradient accumulation buffer in grad_accum_dtype, but the fp32 master and optimizer
    states already partitioned over data parallel ranks (it is ZeRO-1-like even at stage 0).
  * ZeRO 1/2: DeepSpeedZeroOptimizer -- fp32 master + states / dp; stage 1 keeps full param.grad,
    stage 2 only this rank's partition; contiguous_gradients adds a grads_in_partition buffer and a
    reduce bucket of reduce_bucket_size elements (allocated at full size whatever the model size).
    allgather_bucket_size allocates nothing: 0.19.8 all-gathers in place into the flat buffer.
  * ZeRO 3: approximate (see _zero3 below).
Activations: saved tensors of every layer per micro-batch in flight, under DeepSpeed's 1F1B
schedule (stage s holds min(pp - s, gas) micro-batches), with NeoX's checkpointing rules.
Not modelled: the CUDA context and NCCL workspaces, allocator fragmentation, per-op temporary
workspaces (cuBLAS, flash-attention), and gradient tensors of activations during backward
beyond one recomputed chunk.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from ..config.specs import ModelSpec, ParallelSpec, TrainingSpec
from .errors import DeriveError
from .layers import GMLP, MAMBA, RWKV, TRANSFORMER, checkpoint_chunks
from .options import DEFAULT_OPTIONS, DeriveOptions
from .params import mamba_inner, moe_expert_width, mlp_widths, rwkv_widths

ALLREDUCE_BUCKET = 500_000_000  # MEMORY_OPT_ALLREDUCE_SIZE / allreduce_bucket_size default (elements)
SIXTEEN_BIT = ("fp16", "bfloat16")


@dataclass(frozen=True)
class OptimizerLayout:
    """Bytes per parameter of the stage (sharded parts already divided by dp) + fixed buffers."""
    wrapper: str  # which DeepSpeed optimizer wrapper holds the states
    weight: float
    gradient: float
    master: float
    states: float
    step_transient: float  # per parameter, alive only inside optimizer.step()
    reduce_buffer: int  # bytes of gradient-reduction buffers
    reduce_in_backward: bool  # True: buffers coexist with activations; False: only at step time
    weight_working_set: int = 0  # ZeRO-3 gathered parameters, bytes


def _dtype_bytes(name: Optional[str], default: int) -> int:
    if name is None:
        return default
    if name in ("fp32", "float32", "float", "torch.float32"):
        return 4
    if name in ("fp16", "float16", "half", "bf16", "bfloat16", "torch.float16", "torch.bfloat16"):
        return 2
    raise DeriveError(f"data_types.grad_accum_dtype {name!r} is not fp32/fp16/bf16")


def optimizer_state_bytes(optimizer_type: str, opts: DeriveOptions = DEFAULT_OPTIONS) -> int:
    """Optimizer state bytes per parameter on the GPU (states are fp32 in every NeoX optimizer)."""
    kind = optimizer_type.lower()
    momentum = opts.optimizer_momentum
    if kind in ("cpu_adam", "cpu_torch_adam"):
        return 0  # DeepSpeedCPUAdam / torch Adam keep exp_avg, exp_avg_sq in host memory
    if kind == "adam":
        return 2 if opts.use_bnb_optimizer else 8  # bitsandbytes Adam8bit: two 1-byte states
    if kind == "onebitadam":
        return 8  # m, v; the compression error-feedback buffers are not modelled
    if kind == "lion":
        return 4  # exp_avg only
    if kind == "sgd":
        return 4 if (momentum or 0.0) > 0 else 0  # momentum_buffer
    if kind == "sm3":
        # momentum buffer; the per-dimension accumulators are rows + columns (negligible) for
        # matrices and a full copy for vectors (biases, norms) -- the vector part is ignored.
        return 4 if (momentum or 0.0) > 0 else 0
    if kind == "madgrad_wd":
        # grad_sum_sq, s, and x0 when momentum != 0 (the optimizer's default momentum is 0.9).
        return 8 + (4 if (0.9 if momentum is None else momentum) != 0 else 0)
    raise DeriveError(f"optimizer type {optimizer_type!r} is not one NeoX knows "
                      f"(adam, onebitadam, cpu_adam, cpu_torch_adam, sm3, madgrad_wd, sgd, lion)")


def optimizer_layout(training: TrainingSpec, parallel: ParallelSpec, stage_params: int,
                     largest_layer_params: int,
                     opts: DeriveOptions = DEFAULT_OPTIONS) -> OptimizerLayout:
    dp = max(parallel.data_parallel_size, 1)
    pipelined = parallel.pipe_parallel_size >= 1  # NeoX: pp >= 1 => PipelineModule + PipelineEngine
    precision = training.precision
    wb = 2 if precision in SIXTEEN_BIT else 4
    accum = _dtype_bytes(opts.grad_accum_dtype, wb)
    on_host = opts.cpu_offload or training.optimizer_type.lower() in ("cpu_adam", "cpu_torch_adam")
    states = 0 if on_host else optimizer_state_bytes(training.optimizer_type, opts)
    master = 0 if on_host else 4
    zero = training.zero_stage
    allreduce = min(ALLREDUCE_BUCKET, stage_params)

    def bf16_optimizer() -> OptimizerLayout:
        # Low-precision param.grad stays alive next to the accumulation buffer (clear_lp_grads only
        # runs on non-last stages after their hp update); step() upcasts the grad partition when
        # the accumulation dtype is not fp32. The reduction flattens up to 5e8 hp-grad elements.
        upcast = allreduce * 4 if training.fp32_allreduce and accum != 4 else 0
        return OptimizerLayout(
            "BF16_Optimizer", weight=2, gradient=2 + accum, master=master / dp,
            states=states / dp, step_transient=(0 if accum == 4 else 4) / dp,
            reduce_buffer=allreduce * accum + upcast, reduce_in_backward=False)

    if zero == 0:
        # The non-ZeRO all-reduce (engine.buffered_allreduce_fallback) flattens gradients in
        # buckets of up to 5e8 elements, plus an fp32 copy of the bucket with fp32_allreduce.
        reduce = allreduce * wb + (allreduce * 4 if training.fp32_allreduce and wb != 4 else 0)
        if precision == "fp32":
            return OptimizerLayout("torch optimizer (fp32, no wrapper)", 4, 4, 0, states, 0,
                                   reduce, False)
        if precision == "bfloat16" and pipelined:
            return bf16_optimizer()
        # FP16_Optimizer.step flattens every fp16 grad into one fp32 tensor before the update.
        return OptimizerLayout("FP16_Optimizer", 2, 2, master, states, 0 if on_host else 4,
                               reduce, False)
    if zero == 1 and precision == "bfloat16" and accum == 4 and not opts.cpu_offload:
        return bf16_optimizer()
    bucket = int(training.reduce_bucket_size)
    if opts.contiguous_gradients:
        # reduce_gradients(pipeline_parallel=True) allocates one bucket after backward; without
        # the PipelineEngine the hooks allocate it (two with overlap_comm) during backward.
        n_buckets = 1 if pipelined else (2 if training.overlap_comm else 1)
        reduce = n_buckets * bucket * wb
    else:
        reduce = min(bucket, stage_params) * wb  # buffered_reduce_fallback flattens a bucket
    in_backward = not pipelined
    # step(): the bit16 grad partition is flattened, then converted to an fp32 copy.
    step = 0 if on_host else (wb + 4) / dp
    if zero in (1, 2):
        if zero == 1:
            grad = accum + (wb / dp if opts.contiguous_gradients else 0)
        else:
            grad = wb / dp
        return OptimizerLayout(f"DeepSpeedZeroOptimizer (ZeRO-{zero})", wb, grad, master / dp,
                               states / dp, step, reduce, in_backward)
    if zero == 3:
        return _zero3(wb, master, states, dp, step, bucket, largest_layer_params, opts)
    raise DeriveError(f"ZeRO stage {zero} is not 0, 1, 2 or 3")


def _zero3(wb, master, states, dp, step, bucket, largest_layer_params, opts) -> OptimizerLayout:
    # Approximate: every state sharded over dp, plus the parameters gathered at any time taken as
    # the largest layer plus one prefetch bucket (DeepSpeed's max_live_parameters,
    # persistence_threshold and parameter reuse distance are not modelled).
    working = (largest_layer_params + opts.stage3_prefetch_bucket_size) * wb
    return OptimizerLayout("DeepSpeedZeroOptimizer_Stage3 (approximate)", wb / dp, wb / dp,
                           master / dp, states / dp, step, bucket * wb, True, working)


# ---------------------------------------------------------------------------------------------
# Activations


@dataclass(frozen=True)
class ActivationContext:
    model: ModelSpec
    micro_batch: int
    tp: int
    seq_div: int  # tp with sequence parallelism (layer inputs, norms, dropouts scattered), else 1
    act_bytes: int  # 2 for fp16/bf16, 4 for fp32
    opts: DeriveOptions
    partition_activations: bool
    pipelined: bool

    @property
    def tokens(self) -> int:
        return self.model.seq_length * self.micro_batch

    @property
    def norm_bytes(self) -> int:
        """Bytes per element a norm keeps for backward."""
        norm = self.model.norm
        if norm == "rmsnorm" and not self.opts.rmsnorm_fusion:
            # NeoX's Python RMSNorm upcasts to fp32 and keeps x (fp32) and x_normed (fp32).
            return 8
        return self.act_bytes

    def layer_input(self) -> float:
        """One [s, b, h] hidden-state tensor between layers."""
        return self.act_bytes * self.model.hidden_size * self.tokens / self.seq_div

    def checkpoint_input(self) -> float:
        """What a checkpointed chunk keeps: its input, split over TP with partition_activations."""
        if self.opts.checkpoint_in_cpu:
            return 0.0
        div = self.tp if self.partition_activations and self.tp > 1 else 1
        return self.layer_input() / div


def softmax_bytes(ctx: ActivationContext) -> int:
    """Bytes per attention-score element the softmax keeps (and the scores bmm reuses)."""
    e = ctx.act_bytes
    if e == 4:
        return 4
    m = ctx.model
    s = m.seq_length
    heads_r = m.num_attention_heads // ctx.tp
    fused = ((m.fused_softmax or ctx.opts.scaled_masked_softmax_fusion) and 16 < s <= 2048
             and s % 4 == 0 and (ctx.micro_batch * heads_r) % 4 == 0)
    # The CUDA kernel's batch_per_block divisibility check is not modelled.
    if fused:
        return e
    if ctx.opts.attention_softmax_in_fp32 or ctx.opts.apply_query_key_layer_scaling:
        return 4 + e  # torch softmax output in fp32, then the half copy used by the bmm
    return e


def transformer_activation(ctx: ActivationContext, layer) -> float:
    """Saved tensors of one ParallelTransformerLayer for one micro-batch (Korthikanti et al.
    style accounting, per NeoX op): 34 sbh + 5 a s^2 b for fp16, MHA, 4h GELU MLP, dropout on."""
    m, o = ctx.model, ctx.opts
    e, t, div, tok = ctx.act_bytes, ctx.tp, ctx.seq_div, ctx.tokens
    h, a = m.hidden_size, m.num_attention_heads
    drop_h = (h * tok / div) if o.hidden_dropout > 0 else 0  # 1-byte mask per dropout site
    # Norm inputs: with gpt_j_residual both norms read the same x; a norm that keeps its input
    # (LayerNorm) shares it, NeoX's Python RMSNorm makes its own fp32 copies.
    n_norms = 1 if (m.gpt_j_residual and (o.gpt_j_tied or ctx.norm_bytes == e)) else 2
    total = n_norms * ctx.norm_bytes * h * tok / div
    total += e * h * tok  # QKV input: even with sequence parallel the gathered input is saved
    if layer.attention_type == "flash":
        kvd = m.num_kv_heads * m.head_dim
        # flash-attn keeps q, k, v (GQA not repeated), its output and the fp32 logsumexp.
        total += e * (2 * h + 2 * kvd) / t * tok + 4 * (a / t) * tok
    else:
        # GQA repeats K/V to every head before the bmm, so q, k, v are all full width.
        total += e * 3 * h / t * tok
        probs = softmax_bytes(ctx) + ((1 + e) if o.attention_dropout > 0 else 0)
        # Sparse/local attention types are counted as dense attention (not modelled separately).
        total += (a / t) * m.seq_length * m.seq_length * ctx.micro_batch * probs
    total += e * h / t * tok  # dense (output projection) input
    total += 2 * drop_h  # after attention and after the MLP
    if not (m.gpt_j_residual and o.gpt_j_tied):
        total += e * h * tok  # linear1 input (post-attention norm output)
    if layer.moe:
        # Approximate: router input, then each token's copies to top_k experts with their
        # activation input and linear2 input; megablocks' permutation buffers are not modelled.
        total += e * h * tok + o.moe_top_k * e * (h + 2 * moe_expert_width(m)) / t * tok
    else:
        out, inp = mlp_widths(m)
        total += e * out / t * tok  # activation input
        if m.is_gated:
            total += e * inp / t * tok  # act(gate), kept for the product's backward
        total += e * inp / t * tok  # linear2 input
    return total


def block_activation(ctx: ActivationContext, layer) -> float:
    m, e, t, tok = ctx.model, ctx.act_bytes, ctx.tp, ctx.tokens
    h = m.hidden_size
    if layer.name == TRANSFORMER:
        return transformer_activation(ctx, layer)
    norm_in = ctx.norm_bytes * h * tok / ctx.seq_div
    if layer.name == GMLP:
        # Approximate: norm, input_linear, 2ff activation, SGU norm/projection/product, output.
        ff = 4 * h
        tiny_attention = layer.attention_type == "amlp"
        extra = e * m.seq_length * m.seq_length * ctx.micro_batch if tiny_attention else 0
        return norm_in + e * h * tok + e * 7 * ff / t * tok + extra
    if layer.name == MAMBA:
        # Approximate: in_proj output, conv, x_proj/dt, selective-scan inputs and out_proj input.
        return norm_in + e * h * tok + e * 10 * mamba_inner(m) / t * tok
    if layer.name == RWKV:
        # Approximate and not TP-split: time-mix r/k/v/g/w streams and channel-mix key/value.
        att, ffn = rwkv_widths(m, ctx.opts)
        return 2 * norm_in + e * (12 * h + 8 * att + 2 * ffn) * tok
    raise DeriveError(f"unknown block {layer.name}")


def embedding_activation(ctx: ActivationContext) -> float:
    """EmbeddingPipe's saved tensors: token ids (int64), the TP-masked ids, the dropout mask.

    Its output is not kept here: _pre_transformer_block's transposed copy of it is the first
    layer's saved input (or checkpoint), counted with the layers.
    """
    tok = ctx.tokens
    total = 8 * tok * (2 if ctx.model.pos_emb == "learned" else 1)
    if ctx.tp > 1:
        total += 9 * tok  # masked int64 ids + bool mask in VocabParallelEmbedding
    if ctx.opts.hidden_dropout > 0:
        total += ctx.model.hidden_size * tok  # embedding dropout runs before the SP scatter
    return total


def head_activation(ctx: ActivationContext, padded_vocab: int) -> Tuple[float, float]:
    """(saved per micro-batch, backward transient) of the output head and the loss.

    The head keeps its (sequence-gathered) input; the logits [b, s, V/tp] stay in the pipe output
    buffer; cross_entropy upcasts them to fp32 (unless fp16_lm_cross_entropy) and the vocab-parallel
    loss works in place on that copy. Backward casts the fp32 gradient back: one more logits-size
    tensor in the activation dtype.
    """
    m, e, tok = ctx.model, ctx.act_bytes, ctx.tokens
    if ctx.opts.train_impl == "rm":
        return e * m.hidden_size * tok, 0.0
    v_r = padded_vocab / ctx.tp
    fp32_copy = 0 if (ctx.opts.fp16_lm_cross_entropy or e == 4) else 4
    saved = e * m.hidden_size * tok + (e + fp32_copy) * v_r * tok
    return saved, e * v_r * tok


def full_activation(ctx: ActivationContext, layer, padded_vocab: int) -> float:
    if layer.kind == "function":
        return 0.0
    if layer.kind == "embedding":
        return embedding_activation(ctx)
    if layer.kind == "norm":
        return ctx.norm_bytes * ctx.model.hidden_size * ctx.tokens / ctx.seq_div
    if layer.kind == "head":
        return head_activation(ctx, padded_vocab)[0]
    return block_activation(ctx, layer)


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one GPU of a pipeline stage (every TP rank of a stage holds the same amount)."""
    stage: int
    micro_batches_in_flight: int
    optimizer_wrapper: str
    weights: int
    gradients: int  # param.grad plus accumulation / partition buffers
    master_weights: int  # fp32 master copy (sharded where the wrapper shards it)
    optimizer_states: int
    activations: int  # saved tensors of the stage's layers, all micro-batches in flight
    recompute: int  # one checkpointed chunk's full activations, rebuilt during backward
    embedding: int  # EmbeddingPipe's saved tensors (first stage)
    logits: int  # logits, fp32 loss copy and its gradient (last stage)
    pipe_buffers: int  # received inputs / kept outputs of in-flight micro-batches
    zero_buffers: int  # gradient reduction buckets
    step_transient: int  # extra bytes inside optimizer.step()
    persistent: int  # weights + gradients + master + states
    backward_peak: int  # persistent + everything alive during forward/backward
    step_peak: int  # persistent + what optimizer.step() adds
    total: int  # max(backward_peak, step_peak)
    capacity: Optional[int]  # GPU memory given by the caller
    headroom: Optional[int]  # capacity - total (negative: does not fit)


def stage_memory(*, stage: int, num_stages: int, layers: Sequence, model: ModelSpec,
                 parallel: ParallelSpec, training: TrainingSpec, padded_vocab: int,
                 stage_params: int, largest_layer_params: int,
                 gpu_memory_bytes: Optional[int] = None,
                 opts: DeriveOptions = DEFAULT_OPTIONS) -> StageMemory:
    """Memory of stage `stage` holding `layers` (its slice of the PipeLayer list)."""
    tp = max(parallel.model_parallel_size, 1)
    pipelined = parallel.pipe_parallel_size >= 1
    gas = max(training.gradient_accumulation_steps, 1)
    # 1F1B: stage s runs (pp - s) warm-up forwards before its first backward; without a pipeline
    # each micro-batch's backward frees its activations before the next forward.
    in_flight = min(num_stages - stage, gas) if pipelined else 1
    ctx = ActivationContext(
        model=model, micro_batch=training.micro_batch_size, tp=tp,
        seq_div=tp if (parallel.sequence_parallel and tp > 1) else 1,
        act_bytes=2 if training.precision in SIXTEEN_BIT else 4, opts=opts,
        partition_activations=training.partition_activations, pipelined=pipelined)

    layout = optimizer_layout(training, parallel, stage_params, largest_layer_params, opts)
    weights = layout.weight * stage_params + layout.weight_working_set
    gradients = layout.gradient * stage_params
    master = layout.master * stage_params
    states = layout.states * stage_params

    interval = training.checkpoint_num_layers if training.checkpoint_activations else 0
    saved = 0.0
    recompute = 0.0
    embedding = 0.0
    chunks = checkpoint_chunks([layer.name for layer in layers], interval, pipelined)
    for start, stop, ckpt in chunks:
        chunk = layers[start:stop]
        if ckpt:
            saved += ctx.checkpoint_input()
            recompute = max(recompute, sum(full_activation(ctx, l, padded_vocab) for l in chunk))
            continue
        for layer in chunk:
            if layer.kind == "embedding":
                embedding += embedding_activation(ctx)
            elif layer.kind != "head":
                saved += full_activation(ctx, layer, padded_vocab)

    logits = 0.0
    if layers and layers[-1].kind == "head" and stage == num_stages - 1:
        head_saved, head_grad = head_activation(ctx, padded_vocab)
        logits = in_flight * head_saved + head_grad

    pipe = 0.0
    if pipelined and num_stages > 1:
        if stage > 0:
            received = ctx.layer_input()
            pipe += received
            # The received tensor is the first layer's saved input (or checkpoint) unless the
            # checkpoint stores a partitioned/CPU/contiguous copy or the norm keeps fp32 copies.
            first_ckpt = chunks[0][2]
            copies = (ctx.partition_activations and tp > 1) or opts.checkpoint_in_cpu \
                or opts.contiguous_checkpointing
            if (first_ckpt and not copies) or (not first_ckpt and layers
                                               and layers[0].kind == "block"
                                               and ctx.norm_bytes == ctx.act_bytes):
                saved -= min(received, ctx.checkpoint_input() if first_ckpt else received)
        if stage < num_stages - 1:
            # The stage output stays in pipe_buffers until its backward; DeepSpeed's default
            # pipe_partitioned keeps only this rank's 1/tp slice of it when tp > 1.
            pipe += ctx.layer_input() / tp
        # The attention mask [1, 1, s, s] (bool) travels with every micro-batch.
        if stage > 0:
            pipe += model.seq_length * model.seq_length

    activations = in_flight * saved
    embedding *= in_flight
    pipe *= in_flight
    during = activations + recompute + embedding + logits + pipe
    reduce = layout.reduce_buffer
    step = layout.step_transient * stage_params
    persistent = weights + gradients + master + states
    backward_peak = persistent + during + (reduce if layout.reduce_in_backward else 0)
    step_peak = persistent + step + (0 if layout.reduce_in_backward else reduce)
    total = max(backward_peak, step_peak)
    r = lambda x: int(round(x))
    return StageMemory(
        stage=stage, micro_batches_in_flight=in_flight, optimizer_wrapper=layout.wrapper,
        weights=r(weights), gradients=r(gradients), master_weights=r(master),
        optimizer_states=r(states), activations=r(activations), recompute=r(recompute),
        embedding=r(embedding), logits=r(logits), pipe_buffers=r(pipe), zero_buffers=r(reduce),
        step_transient=r(step), persistent=r(persistent), backward_peak=r(backward_peak),
        step_peak=r(step_peak), total=r(total), capacity=gpu_memory_bytes,
        headroom=None if gpu_memory_bytes is None else gpu_memory_bytes - r(total))
