"""What GPT-NeoX or DeepSpeed refuses, or crashes on, that config.build does not already find.

Each rule names the line that raises, in GPT-NeoX at ea7aefd8 (megatron/...) or DeepSpeed 0.19.8
(deepspeed/...), so a rule can be checked against its source. All of them are "error" verdicts:
the job would stop before (or at) its first iteration, so `check` exits 1 and predicts nothing.
"""
from __future__ import annotations

from typing import List, Optional

from .config.specs import NeoxConfig
from .config.verdicts import Verdict

ARGS = "megatron/neox_arguments/arguments.py"


def config_refusals(cfg: NeoxConfig) -> List[Verdict]:
    """Refusals that depend on the config alone (the layout's GPUs aside)."""
    m, t, values, src = cfg.model, cfg.training, cfg.values, cfg.sources
    out: List[Verdict] = []

    def add(code: str, message: str, key: str, fix: str, where: str) -> None:
        out.append(Verdict(code, "error", f"{message} ({where})", key=key, file=src.get(key), fix=fix))

    from .derive.params import gated_width_mismatch
    mismatch = gated_width_mismatch(m)
    if mismatch:
        linear1, linear2_in = mismatch
        # ParallelMLP rounds linear1 to a multiple of 2 x mlp_multiple_of but linear2's input
        # to a multiple of mlp_multiple_of (megatron/model/transformer.py:134-143);
        # Gated_Activation chunks linear1's output in two (transformer.py:189), so linear2
        # receives linear1 / 2 features and its matmul fails at the first forward.
        width = "intermediate_size" if m.intermediate_size else "mlp_multiple_of"
        add("gated_mlp_width", f"gated MLP ({m.activation}): linear1 gives 2 x {linear1 // 2} "
            f"features but linear2 expects {linear2_in}: NeoX fails at the first forward",
            width, _gated_fix(m),
            "megatron/model/transformer.py:134-143,189")
    precision = values.get("precision")
    for name, want in (("fp16", "fp16"), ("bf16", "bfloat16")):
        block = values.get(name)
        if isinstance(block, dict) and block.get("enabled") and precision not in (None, want):
            add("precision_conflict", f"{name} is enabled but precision is {precision!r}", "precision",
                f"set precision: {want}, or disable {name}", f"{ARGS}:971-979")
    optimizer = values.get("optimizer")
    if isinstance(optimizer, dict) and not isinstance(optimizer.get("params"), dict):
        add("optimizer_params", "optimizer has no params mapping: NeoX reads "
            "optimizer['params']['lr'] and raises KeyError", "optimizer",
            "add params: {lr: ...} inside optimizer", f"{ARGS}:1058")
    lr = _lr(values)
    min_lr = values.get("min_lr") or 0.0
    if lr is not None and isinstance(min_lr, (int, float)) and min_lr > lr:
        add("min_lr_above_lr", f"min_lr {min_lr:g} is above lr {lr:g}", "min_lr",
            "set min_lr <= the optimizer's lr", f"{ARGS}:1268-1275")
    if values.get("save") is not None and values.get("checkpoint_factor") is None \
            and values.get("extra_save_iters") is None:
        add("save_without_checkpoint_factor", "save is set but neither checkpoint_factor nor "
            "extra_save_iters is", "save", "set checkpoint_factor (save every N iterations)",
            f"{ARGS}:1278-1289")
    unique = values.get("num_unique_layers")
    if isinstance(unique, int) and unique > 0 and (unique > m.num_layers or m.num_layers % unique):
        add("num_unique_layers", f"num_unique_layers {unique} must divide num_layers "
            f"{m.num_layers}", "num_unique_layers", "use a divisor of num_layers",
            f"{ARGS}:1293-1311")
    if values.get("fp16_lm_cross_entropy") and t.precision != "fp16":
        add("fp16_lm_cross_entropy", f"fp16_lm_cross_entropy needs fp16, the run is {t.precision}",
            "fp16_lm_cross_entropy", "drop fp16_lm_cross_entropy or train in fp16",
            f"{ARGS}:1314-1321")
    if t.optimizer_type == "onebitadam" and t.train_iters is None:
        add("onebitadam_train_iters", "OneBitAdam needs train_iters", "train_iters",
            "set train_iters", f"{ARGS}:1062-1065")
    kinds = set(m.attention_types)
    if kinds & {"gmlp", "amlp"} and t.partition_activations:
        add("gmlp_partition_activations", "gMLP blocks cannot run with partition_activations",
            "partition_activations", "drop partition_activations", f"{ARGS}:1105-1108")
    if "rwkv" in kinds and cfg.parallel.model_parallel_size > 1:
        add("rwkv_model_parallel", "RWKV blocks cannot run with model parallelism",
            "model_parallel_size", "set model_parallel_size: 1", f"{ARGS}:1115-1118")
    if kinds & {"rwkv", "mamba"} and t.zero_stage == 3:
        add("zero3_recurrent", "ZeRO stage 3 is not compatible with Mamba or RWKV blocks",
            "zero_optimization", "use ZeRO stage 0, 1 or 2", f"{ARGS}:1109-1120")
    accum = _grad_accum_dtype(values)
    model_dtype = {"fp16": "fp16", "bfloat16": "bf16"}.get(t.precision, "fp32")
    if t.zero_stage == 0 and accum is not None and accum != model_dtype:
        # DeepSpeed's _do_optimizer_sanity_check: without ZeRO, a grad_accum_dtype other than the
        # model's raises NotImplementedError("unsupported mix of model_dtype and grad_accum_dtype")
        add("grad_accum_dtype_zero0", f"data_types.grad_accum_dtype {accum} with a {model_dtype} "
            f"model and no ZeRO: DeepSpeed raises NotImplementedError", "data_types",
            "use ZeRO stage 1 (bf16 + fp32 accumulation runs there), or drop grad_accum_dtype",
            "deepspeed/runtime/engine.py:2313-2323")
    if isinstance(values.get("soft_prompt_tuning"), dict) and values["soft_prompt_tuning"].get("enabled"):
        add("soft_prompt_tuning", "soft_prompt_tuning: SoftEmbedding.__init__ calls "
            "initialize_embedding(wte), a method that takes no argument: TypeError at model build",
            "soft_prompt_tuning", "disable soft_prompt_tuning at this NeoX version",
            "megatron/model/word_embeddings.py:210,213")
    return out


def derived_refusals(cfg: NeoxConfig, derived) -> List[Verdict]:
    """Refusals only the derived pipeline shows."""
    out = []
    for st in derived.stages:
        if st.params_per_rank == 0:
            # DeepSpeed builds each stage's optimizer over its own parameters; torch's
            # Optimizer.__init__ raises "optimizer got an empty parameter list"
            # (torch/optim/optimizer.py:400 in torch 2.13).
            out.append(Verdict(
                "stage_without_parameters", "error",
                f"pipeline stage {st.index} holds no parameters ({', '.join(st.layer_names)}): "
                f"building its optimizer raises (empty parameter list)", key="pipe_parallel_size",
                file=cfg.sources.get("pipe_parallel_size"),
                fix="use fewer pipeline stages or another pipe_partition_method"))
    return out


def _lr(values) -> Optional[float]:
    optimizer = values.get("optimizer")
    if optimizer is None:
        return 0.001  # OPT_PARAMS_DEFAULTS (arguments.py:84-85)
    params = optimizer.get("params") if isinstance(optimizer, dict) else None
    lr = params.get("lr", 0.001) if isinstance(params, dict) else None
    return float(lr) if isinstance(lr, (int, float)) else None


def _grad_accum_dtype(values) -> Optional[str]:
    data_types = values.get("data_types")
    name = data_types.get("grad_accum_dtype") if isinstance(data_types, dict) else None
    if name is None:
        return None
    name = str(name).lower()
    return {"fp32": "fp32", "float32": "fp32", "float": "fp32", "fp16": "fp16", "float16": "fp16",
            "half": "fp16", "bf16": "bf16", "bfloat16": "bf16"}.get(name, name)


def _gated_fix(m) -> str:
    """NeoX gives a gated MLP int(intermediate_size x 2/3) / 2 features (transformer.py:134-135):
    a width from a Hugging Face config is the gated width itself, so NeoX wants 3 x it; else the
    nearest intermediate_size above whose widths agree."""
    from dataclasses import replace
    from .derive.params import gated_width_mismatch
    start = m.intermediate_size or int((m.expansion_factor or 4) * m.hidden_size)
    near = next((size for size in range(start, start + 6 * max(m.mlp_multiple_of, 1) + 6)
                 if not gated_width_mismatch(replace(m, intermediate_size=size, expansion_factor=None))),
                None)
    hf = 3 * start
    options = []
    if not gated_width_mismatch(replace(m, intermediate_size=hf, expansion_factor=None)):
        options.append(f"intermediate_size: {hf} if {start} is the gated width (Hugging Face's "
                       f"convention; NeoX takes 2/3 of intermediate_size, then half)")
    if near is not None:
        options.append(f"intermediate_size: {near}, the nearest that agrees")
    return "; or ".join(options) or "an intermediate_size whose 2/3 rounds to 2 x the linear2 width"
