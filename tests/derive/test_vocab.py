import pytest

from neox_perf.derive import DeriveError, padded_vocab_size


def neox_loop(orig, divisible_by, mp):
    # megatron/tokenizer/tokenizer.py:_vocab_size_with_padding, verbatim logic.
    after = orig
    multiple = divisible_by * mp
    while (after % multiple) != 0:
        after += 1
    return after


@pytest.mark.parametrize("raw,mp,expected", [
    (50277, 1, 50304), (50277, 2, 50432), (50277, 4, 50688),
    (50257, 1, 50304), (50257, 2, 50432), (50257, 4, 50688)])
def test_gpt2_and_20b_tokenizers(raw, mp, expected):
    assert padded_vocab_size(raw, 128, mp) == expected


def test_llama_divisible_by_one():
    assert padded_vocab_size(32000, 1, 1) == 32000
    assert padded_vocab_size(32001, 1, 2) == 32002


def test_matches_neox_loop():
    for raw in (1, 2, 127, 128, 129, 512, 32000, 50257, 50277, 65024, 100277, 151643):
        for d in (1, 2, 8, 64, 128, 256):
            for mp in (1, 2, 3, 4, 8):
                assert padded_vocab_size(raw, d, mp) == neox_loop(raw, d, mp)


def test_refuses_zero_divisor():
    with pytest.raises(DeriveError):
        padded_vocab_size(50277, 0, 1)
