"""Model states per GPU: which optimizer wrapper DeepSpeed 0.19.8 builds for a NeoX config, and
the bytes per parameter of its weights, gradients, fp32 master copy and optimizer states.

Chosen like engine._do_optimizer_sanity_check (deepspeed/runtime/engine.py):
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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..config.specs import ParallelSpec, TrainingSpec
from .errors import DeriveError
from .options import DEFAULT_OPTIONS, DeriveOptions

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
    # True: the gradient bytes are buffers that live through the whole run (BF16_Optimizer's
    # accumulation buffer and its zeroed, never freed, param.grad); False: param.grad is made by
    # an iteration's first backward and dropped by the step's zero_grad(set_to_none)
    grads_persistent: bool = False
    # bytes of reduction buffers alive at the gradient reduction / optimizer step moment;
    # None: reduce_buffer (when not in backward) or nothing (when in backward)
    step_reduce: Optional[int] = None
    # True: by the optimizer step the reduction has moved param.grad into this rank's partition
    # (ZeRO with contiguous_gradients clears param.grad as it copies it)
    grads_leave_at_step: bool = False

    @property
    def reduce_at_step(self) -> int:
        if self.step_reduce is not None:
            return self.step_reduce
        return 0 if self.reduce_in_backward else self.reduce_buffer


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
            reduce_buffer=allreduce * accum + upcast, reduce_in_backward=False,
            grads_persistent=True)

    if zero == 0:
        # The non-ZeRO all-reduce (engine.buffered_allreduce_fallback) flattens gradients in
        # buckets of up to 5e8 elements, plus an fp32 copy of the bucket with fp32_allreduce.
        reduce = allreduce * wb + (allreduce * 4 if training.fp32_allreduce and wb != 4 else 0)
        if precision == "fp32":
            return OptimizerLayout("torch optimizer (fp32, no wrapper)", 4, 4, 0, states, 0,
                                   reduce, False)
        if precision == "bfloat16" and pipelined:
            return bf16_optimizer()
        # FP16_Optimizer.step flattens every fp16 grad into one fp32 tensor before the update,
        # from a list of per-parameter fp32 copies (p.grad.to(fp32)): both alive as it
        # flattens (8 bytes per parameter of the group; measured on CPU in bf16)
        return OptimizerLayout("FP16_Optimizer", 2, 2, master, states, 0 if on_host else 8,
                               reduce, False)
    if zero == 1 and precision == "bfloat16" and accum == 4 and not opts.cpu_offload:
        return bf16_optimizer()
    bucket = int(training.reduce_bucket_size)
    step_reduce = None
    if opts.contiguous_gradients:
        # The gradient hooks (registered whenever contiguous_gradients is on) allocate the
        # reduce bucket at the iteration's first backward (setup_buckets; two with overlap_comm)
        # and keep it to the end of the reduction; under the PipelineEngine,
        # reduce_gradients(pipeline_parallel=True) appends one more (measured on CPU).
        n_buckets = 2 if training.overlap_comm else 1
        reduce = n_buckets * bucket * wb
        in_backward = True
        step_reduce = reduce + (bucket * wb if pipelined else 0)
    else:
        reduce = min(bucket, stage_params) * wb  # buffered_reduce_fallback flattens a bucket
        in_backward = not pipelined
    # step(): the bit16 grad partition is flattened, then converted to an fp32 copy.
    step = 0 if on_host else (wb + 4) / dp
    if zero in (1, 2):
        if zero == 1:
            # full param.grad through backward; contiguous_gradients copies this rank's
            # partition into grads_in_partition when the gradients are reduced (step time)
            grad = accum
            step += wb / dp if opts.contiguous_gradients else 0
        else:
            grad = wb / dp
        return OptimizerLayout(f"DeepSpeedZeroOptimizer (ZeRO-{zero})", wb, grad, master / dp,
                               states / dp, step, reduce, in_backward, step_reduce=step_reduce,
                               grads_leave_at_step=opts.contiguous_gradients)
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
