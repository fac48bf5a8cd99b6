"""The raw vocabulary size NeoX's tokenizer will report, before padding.

NeoX pads `tokenizer.vocab_size` (megatron/tokenizer/tokenizer.py), so the right raw size is
what each tokenizer class returns: GPT2BPETokenizer len(encoder), HFTokenizer
get_vocab_size() (model vocab plus added tokens), SPMTokenizer get_piece_size(),
CharLevelTokenizer 512. We read the file when we can, else trust --vocab-size, else a
known size; the report says which.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterable, Optional

# Sizes of tokenizers NeoX configs commonly name, for when the file is not on this machine.
KNOWN_FILES = {
    "20B_tokenizer.json": 50277,  # GPT-NeoX-20B / Pythia HF tokenizer
    "gpt2-vocab.json": 50257,
    "vocab.json": 50257,
    "tokenizer.model": 32000,  # LLaMA / LLaMA-2 SentencePiece
}
KNOWN_TYPES = {
    "GPT2BPETokenizer": 50257,
    "HFGPT2Tokenizer": 50257,
    "CharLevelTokenizer": 512,
    "TiktokenTokenizer": 100277,  # cl100k_base n_vocab
}


# File names too generic to tell the vocabulary by (a SentencePiece model, a GPT-2 style
# vocab.json): a size taken from them is an assumption unless the tokenizer type fixes it.
GENERIC_FILES = ("tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class RawVocab:
    size: int
    source: str  # human-readable: which file / flag / assumption gave the size
    assumed: bool = False  # True: not read nor given, nor fixed by the tokenizer type or file name


def _hf_size(data: dict) -> int:
    model = data.get("model") or {}
    vocab = model.get("vocab")
    ids = set()
    if isinstance(vocab, dict):
        ids.update(int(i) for i in vocab.values())
    elif isinstance(vocab, list):  # Unigram models: a list of [piece, score]
        ids.update(range(len(vocab)))
    for tok in data.get("added_tokens") or []:
        ids.add(int(tok["id"]))
    if not ids:
        raise ValueError("no vocabulary in tokenizer.json")
    return len(ids)


def _varint(buf: bytes, pos: int):
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _spm_piece_count(buf: bytes) -> int:
    # ModelProto field 1 is `repeated SentencePiece pieces`; counting its records gives
    # get_piece_size() without needing sentencepiece or protobuf installed.
    pos = count = 0
    while pos < len(buf):
        tag, pos = _varint(buf, pos)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            _, pos = _varint(buf, pos)
        elif wire == 1:
            pos += 8
        elif wire == 2:
            length, pos = _varint(buf, pos)
            pos += length
            if field == 1:
                count += 1
        elif wire == 5:
            pos += 4
        else:
            raise ValueError("not a SentencePiece model")
    if pos != len(buf) or count == 0:
        raise ValueError("not a SentencePiece model")
    return count


def read_vocab_file(path: str) -> int:
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        if isinstance(data, dict) and "model" in data:
            return _hf_size(data)
        if isinstance(data, dict) and data:
            return len(data)  # GPT-2 encoder.json / vocab.json
        raise ValueError("unrecognised vocabulary JSON")
    with open(path, "rb") as fh:
        return _spm_piece_count(fh.read())


def raw_vocab(tokenizer_type: str, vocab_file: Optional[str], override: Optional[int],
              search_dirs: Iterable[str]) -> RawVocab:
    if override is not None:
        return RawVocab(override, "--vocab-size")
    if tokenizer_type == "CharLevelTokenizer":
        return RawVocab(512, "CharLevelTokenizer (fixed 512)")
    if vocab_file:
        candidates = [vocab_file] + [os.path.join(d, vocab_file) for d in search_dirs]
        for cand in candidates:
            if os.path.isfile(cand):
                try:
                    return RawVocab(read_vocab_file(cand), f"read from {cand}")
                except (ValueError, KeyError, TypeError, OSError, UnicodeDecodeError,
                        IndexError, json.JSONDecodeError):
                    break
        base = os.path.basename(vocab_file)
        if base in KNOWN_FILES:
            generic = base in GENERIC_FILES and tokenizer_type not in ("GPT2BPETokenizer",
                                                                       "HFGPT2Tokenizer")
            return RawVocab(KNOWN_FILES[base], f"{vocab_file} not readable here; "
                                               f"{KNOWN_FILES[base]:,} assumed from its name"
                            if generic else f"known size of {base} (file not readable here)",
                            assumed=generic)
    if tokenizer_type in KNOWN_TYPES:
        return RawVocab(KNOWN_TYPES[tokenizer_type], f"default size of {tokenizer_type}")
    what = f"vocab_file {vocab_file} not readable here" if vocab_file else "no vocab_file"
    return RawVocab(50257, f"{tokenizer_type}, {what}: GPT-2's 50,257 assumed", assumed=True)
