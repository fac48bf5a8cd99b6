"""Finding the job's NeoX config and rebuilding the prediction from what was recorded."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from neox_perf.hooks import neox_args
from neox_perf.hooks.session import config_dims
from neox_perf.runs import prediction
from neox_perf.hooks.settings import Settings

NEOX_SRC = Path(os.environ.get("NEOX_PERF_NEOX_SRC", "/tmp/neox"))


class _Args:
    """What NeoX hands deepspeed.initialize: attributes for every key, runtime vocab included."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _neox_like():
    return _Args(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                 max_position_embeddings=32, pipe_parallel_size=2, model_parallel_size=1,
                 train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2,
                 train_batch_size=4, attention_config=["global"] * 4, no_weight_tying=True,
                 padded_vocab_size=512, tokenizer=object(), precision="fp16",
                 fp16={"enabled": True}, optimizer={"type": "Adam", "params": {"lr": 1e-3}})


def test_neox_args_become_plain_config_values():
    rec = neox_args.from_neox_args(_neox_like())
    assert rec["vocab"] == 512 and rec["vocab_padded"]
    assert rec["values"]["attention_config"] == ["global"] * 4
    assert "tokenizer" not in rec["values"]  # objects are not config
    json.dumps(rec)  # goes into the rank summary as is


def test_discovery_order(tmp_path):
    cfg = tmp_path / "a.yml"
    cfg.write_text("num_layers: 2\nhidden_size: 32\nnum_attention_heads: 2\nseq_length: 16\n"
                   "max_position_embeddings: 16\n")
    with_files = Settings(run_dir="/x", config_files=[str(cfg)], vocab=1000)
    assert neox_args.discover((), with_files)["source"] == "PYTHON_NEOX_PERF_CONFIG files"
    assert neox_args.discover(_neox_like(), with_files)["source"].startswith("GPT-NeoX args")
    none = neox_args.discover(None, Settings(run_dir="/x"))
    assert none["source"] is None and "PYTHON_NEOX_PERF_CONFIG" in none["why"]


def test_prediction_uses_the_engine_layout_and_precision():
    rec = neox_args.from_neox_args(_neox_like())
    facts = {"world_size": 2, "local_world_size": 2, "dtype": "fp32", "parts": [0, 4, 9],
             "layer_names": ["EmbeddingPipe", "_pre_transformer_block"] +
                            ["ParallelTransformerLayerPipe"] * 4 +
                            ["_post_transformer_block", "NormPipe", "ParallelLinearPipe"]}
    cfg, derived, notes = prediction.rebuild(rec, facts)
    assert cfg.training.precision == "fp32" and any("engine ran fp32" in n for n in notes)
    assert list(derived.parts) == [0, 4, 9]
    assert [s.transformer_layers for s in prediction.stage_shapes(derived, facts)] == [2, 2]
    d = config_dims(cfg, derived)
    assert (d.hidden, d.qkv, d.ffn_out, d.vocab) == (64, 192, 256, 512)
    moved = dict(facts, parts=[0, 3, 9])
    assert any("partitioned the layers as [0, 3, 9]" in n for n in prediction.rebuild(rec, moved)[2])
    assert [s.transformer_layers for s in prediction.stage_shapes(derived, moved)] == [1, 3]


# NeoX imports tokenizer libraries (and pkg_resources) at module level; NeoXArgs itself does
# not use them. A subprocess stubs them out so this process's modules stay clean.
_REAL = """
import importlib.abc, importlib.machinery, json, sys, types
from unittest import mock
import packaging.version
sys.modules["pkg_resources"] = types.SimpleNamespace(packaging=sys.modules["packaging"])
class Stub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    names = ("tokenizers", "transformers", "sentencepiece", "tiktoken", "wandb", "ftfy",
             "lm_dataformat", "mpi4py", "best_download", "comet_ml")
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec):
        m = mock.MagicMock(); m.__path__, m.__spec__, m.__name__ = [], spec, spec.name
        return m
    def exec_module(self, module):
        pass
sys.meta_path.insert(0, Stub())
src = sys.argv[1]
sys.path.insert(0, src)
from megatron.neox_arguments import NeoXArgs
from neox_perf.hooks import neox_args
from neox_perf.runs import prediction
args = NeoXArgs.from_ymls([src + "/configs/125M.yml", src + "/configs/local_setup.yml"],
                          overwrite_values={"global_num_gpus": 4})
args.padded_vocab_size = 50304  # set by build_tokenizer at runtime
rec = neox_args.from_neox_args(args)
cfg, derived, notes = prediction.rebuild(rec, {"world_size": 4, "local_world_size": 4, "dtype": "fp16"})
print("RESULT " + json.dumps([cfg.model.num_layers, cfg.model.hidden_size, derived.padded_vocab,
                              cfg.parallel.data_parallel_size, notes]))
"""


@pytest.mark.skipif(not (NEOX_SRC / "megatron" / "neox_arguments").is_dir(),
                    reason="no GPT-NeoX checkout (set NEOX_PERF_NEOX_SRC)")
def test_real_neox_args_object(tmp_path):
    pytest.importorskip("deepspeed")
    # cwd: NeoXArgs tees stdout into <log_dir>/<host>_stdout.txt (local_setup.yml: "logs")
    proc = subprocess.run([sys.executable, "-c", _REAL, str(NEOX_SRC)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if not lines and "ModuleNotFoundError" in proc.stderr:
        # The checkout is there but NeoX's own dependencies are not installed here.
        pytest.skip("GPT-NeoX checkout present but not importable: " + proc.stderr.strip().splitlines()[-1])
    assert lines, proc.stderr[-3000:]
    assert json.loads(lines[0][7:]) == [12, 768, 50304, 4, []]


def _deepy_encoded(values):
    import base64
    return base64.urlsafe_b64encode(json.dumps(values).encode()).decode()


def test_megatron_config_that_deepy_hands_every_rank():
    # what NeoX's get_deepspeed_main_args serialises: merged keys plus its derived ones
    values = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
              "max_position_embeddings": 32, "pipe_parallel_size": 2, "global_num_gpus": 2,
              "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
              "train_batch_size": 8, "tokenizer_type": "CharLevelTokenizer",
              "user_script": "train.py", "config_files": {"tiny.yml": "..."}}
    argv = ["train.py", "--local_rank=0", "--deepspeed_config", "e30=",
            "--megatron_config", _deepy_encoded(values)]
    assert neox_args.megatron_config_arg(argv) == argv[-1]
    assert neox_args.megatron_config_arg(["x", "--megatron_config=abc"]) == "abc"
    rec = neox_args.from_megatron_config(argv[-1])
    assert rec["values"]["gradient_accumulation_steps"] == 4
    assert rec["files"] == ["tiny.yml"] and rec["vocab"] == 512 and not rec["vocab_padded"]
    cfg, derived, _ = prediction.rebuild(rec, {"world_size": 2})
    assert derived.padded_vocab == 512 and len(derived.stages) == 2
    # garbage is no config, not an exception
    assert neox_args.from_megatron_config("not base64 json") is None
    assert neox_args.from_megatron_config(_deepy_encoded({"hidden_size": 8})) is None


def test_discovery_reads_megatron_config_from_argv(monkeypatch):
    values = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "seq_length": 16,
              "max_position_embeddings": 16}
    monkeypatch.setattr(sys, "argv", ["train.py", "--megatron_config", _deepy_encoded(values)])
    rec = neox_args.discover(None, Settings(run_dir="/x"))
    assert rec["source"].startswith("GPT-NeoX --megatron_config")
    # the NeoXArgs object itself still wins: it carries the runtime padded vocabulary
    assert neox_args.discover(_neox_like(), Settings(run_dir="/x"))["vocab"] == 512
