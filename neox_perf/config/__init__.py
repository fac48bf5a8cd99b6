"""GPT-NeoX configuration: reading, merging, defaults, effective specs."""
from .build import WorldRequest, build
from .loader import RawConfig, load_files
from .specs import ModelSpec, NeoxConfig, ParallelSpec, TrainingSpec
from .tokenizer import RawVocab, raw_vocab
from .verdicts import Verdict

__all__ = ["WorldRequest", "build", "RawConfig", "load_files", "ModelSpec", "NeoxConfig",
           "ParallelSpec", "TrainingSpec", "RawVocab", "raw_vocab", "Verdict"]
