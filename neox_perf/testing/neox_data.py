"""The tiny offline training set, written by NeoX's own indexed_dataset builder.

    python -m neox_perf.testing.neox_data --neox-src NEOX --out PREFIX

Text: the checkout's tests/data/enwik8_first100.txt, one document per line, tokenised as
NeoX's CharLevelTokenizer does (UTF-8 bytes, end-of-document id 0). Written as the mmap
format (PREFIX_text_document.bin/.idx) that `data_path: PREFIX_text_document` reads.
Runs inside the Python that runs NeoX (it imports NeoX's module, hence numpy < 2).
"""
from __future__ import annotations

import argparse
import os
import sys

TEXT = os.path.join("tests", "data", "enwik8_first100.txt")
VOCAB = 512  # CharLevelTokenizer's vocab_size in NeoX's tokenizer builder


def build(neox_src: str, prefix: str, repeat: int = 4) -> str:
    sys.path.insert(0, os.path.abspath(neox_src))
    import numpy as np
    from megatron.data import indexed_dataset
    with open(os.path.join(neox_src, TEXT), encoding="utf-8") as fh:
        lines = [ln for ln in fh.read().splitlines() if ln.strip()]
    out = prefix + "_text_document"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    builder = indexed_dataset.make_builder(out + ".bin", impl="mmap", vocab_size=VOCAB)
    for _ in range(repeat):
        for line in lines:
            ids = list(line.encode("utf-8")) + [0]
            builder.add_item(np.array(ids, dtype=builder.dtype))
            builder.end_document()
    builder.finalize(out + ".idx")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m neox_perf.testing.neox_data")
    p.add_argument("--neox-src", required=True)
    p.add_argument("--out", required=True, help="path prefix of the dataset files")
    p.add_argument("--repeat", type=int, default=4)
    args = p.parse_args(argv)
    print(build(args.neox_src, args.out, args.repeat))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
