"""Tiny workload configs shared by the tests (imported by basename, like tests/derive)."""
import json

# Tiny enough for 2 CPU cores: 4 layers, hidden 64, seq 32, vocab 500 (padded to 512).
BASE = {
    "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
    "seq_length": 32, "max_position_embeddings": 32,
    "pos_emb": "rotary", "rotary_pct": 0.25, "no_weight_tying": True,
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 0.003}},
}
VOCAB = 500


def config(**overrides):
    return {**BASE, **overrides}


def write_config(path, **overrides):
    path.write_text(json.dumps(config(**overrides)))  # JSON is YAML
    return str(path)
