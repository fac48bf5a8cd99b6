"""The DeepSpeed config dict for a NeoX config, as NeoX's deepy would pass it, adapted to
what the device can run. Every adaptation is returned as a note for the result file."""
from __future__ import annotations

from typing import List, Tuple

from neox_perf.config.neox_keys import KEYS, ZERO_DEFAULTS

_FP16_KEYS = ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
              "min_loss_scale", "auto_cast")
_BF16_KEYS = ("enabled", "immediate_grad_update")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")


def _value(cfg, key):
    v = cfg.values.get(key)
    return KEYS[key][1] if v is None else v


def optimizer_params(cfg) -> dict:
    opt = cfg.values.get("optimizer") or {}
    params = dict(opt.get("params") or {}) if isinstance(opt, dict) else {}
    out = {k: params[k] for k in ADAM_KEYS if k in params}
    out.setdefault("lr", 0.001)  # NeoX's OPT_PARAMS_DEFAULTS
    # NeoX builds its optimizer with the top-level weight_decay, not params.weight_decay.
    out["weight_decay"] = float(_value(cfg, "weight_decay"))
    return out


def build_ds_config(cfg, device_type: str) -> Tuple[dict, List[str]]:
    t, notes = cfg.training, []
    zero = cfg.values.get("zero_optimization")
    # NeoX replaces the defaults with the user's dict, it does not merge them.
    zero = dict(zero) if isinstance(zero, dict) else dict(ZERO_DEFAULTS)
    params = optimizer_params(cfg)
    if t.optimizer_type not in ("adam", "adamw"):
        notes.append(f"optimizer {t.optimizer_type!r} replaced by Adam")
    # No torch_adam: DeepSpeed builds its FusedAdam (AdamW mode), which is what NeoX builds
    # without apex (megatron/training.py get_optimizer) -- on a GPU its multi-tensor kernel, on
    # a CPU the fused_adam op DeepSpeed JIT-compiles for its CPU accelerator. Calibrating with
    # torch's AdamW instead timed a different optimizer: on this box NeoX's CPU step took
    # about half the engine term's prediction.
    config = {
        "train_batch_size": t.train_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "optimizer": {"type": "Adam", "params": params},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": float(_value(cfg, "gradient_clipping")),
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    if t.precision != "fp32":
        if device_type == "cpu":
            notes.append(f"precision {t.precision} requested; ran fp32 on CPU")
        elif t.precision == "fp16":
            src = cfg.values.get("fp16") or {}
            config["fp16"] = {k: src[k] for k in _FP16_KEYS if k in src}
            config["fp16"]["enabled"] = True
        else:
            src = cfg.values.get("bf16") or {}
            config["bf16"] = {k: src[k] for k in _BF16_KEYS if k in src}
            config["bf16"]["enabled"] = True
    return config, notes


def run_precision(cfg, device_type: str) -> str:
    return "fp32" if device_type == "cpu" else cfg.training.precision
