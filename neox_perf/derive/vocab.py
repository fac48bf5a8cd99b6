"""Vocabulary padding exactly as megatron/tokenizer/tokenizer.py:_vocab_size_with_padding."""
from __future__ import annotations

from .errors import DeriveError


def padded_vocab_size(raw: int, make_vocab_size_divisible_by: int, mp: int) -> int:
    """Smallest multiple of make_vocab_size_divisible_by * mp that is >= raw.

    NeoX increments until divisible; the ceiling below is the same number without the loop.
    mp < 1 is treated as 1 because NeoX's model_parallel_size 0 means "no TP".
    """
    if raw < 1:
        raise DeriveError(f"raw vocabulary size {raw} is not positive")
    if make_vocab_size_divisible_by < 1:
        # NeoX would loop on `after % 0` and crash with ZeroDivisionError.
        raise DeriveError(
            f"make_vocab_size_divisible_by {make_vocab_size_divisible_by} must be >= 1")
    multiple = make_vocab_size_divisible_by * max(mp, 1)
    return -(-raw // multiple) * multiple
