import json

from neox_perf.config.tokenizer import raw_vocab


def test_hf_tokenizer_json_counts_added_tokens(tmp_path):
    vocab = {f"t{i}": i for i in range(100)}
    data = {"model": {"type": "BPE", "vocab": vocab},
            "added_tokens": [{"id": 99, "content": "t99"}, {"id": 100, "content": "<|pad|>"},
                             {"id": 101, "content": "<|x|>"}]}
    path = tmp_path / "tok.json"
    path.write_text(json.dumps(data))
    rv = raw_vocab("HFTokenizer", str(path), None, [])
    assert rv.size == 102 and "read from" in rv.source


def test_gpt2_vocab_json(tmp_path):
    path = tmp_path / "gpt2-vocab.json"
    path.write_text(json.dumps({f"t{i}": i for i in range(300)}))
    assert raw_vocab("GPT2BPETokenizer", str(path), None, []).size == 300


def test_sentencepiece_model_pieces(tmp_path):
    def piece(text):
        body = b"\x0a" + bytes([len(text)]) + text.encode() + b"\x15\x00\x00\x80\x3f"
        return b"\x0a" + bytes([len(body)]) + body
    blob = b"".join(piece(f"p{i}") for i in range(37)) + b"\x12\x02\x08\x01"
    path = tmp_path / "tokenizer.model"
    path.write_bytes(blob)
    assert raw_vocab("SPMTokenizer", str(path), None, []).size == 37


def test_relative_to_config_dir(tmp_path):
    (tmp_path / "v.json").write_text(json.dumps({"a": 0, "b": 1}))
    assert raw_vocab("GPT2BPETokenizer", "v.json", None, [str(tmp_path)]).size == 2


def test_fallbacks_say_what_they_used():
    rv = raw_vocab("HFTokenizer", "./20B_checkpoints/20B_tokenizer.json", None, [])
    assert rv.size == 50277 and "known size" in rv.source
    assert raw_vocab("GPT2BPETokenizer", None, None, []).size == 50257
    assert raw_vocab("HFTokenizer", "x.json", 1234, []).source == "--vocab-size"
    assert raw_vocab("CharLevelTokenizer", None, None, []).size == 512
    guessed = raw_vocab("HFTokenizer", "nope.json", None, [])
    assert "GPT-2's 50,257 assumed" in guessed.source and guessed.assumed
    assert not rv.assumed and not raw_vocab("GPT2BPETokenizer", None, None, []).assumed
    # a SentencePiece model's size by its generic name is an assumption too
    spm = raw_vocab("SPMTokenizer", "codellama/tokenizer.model", None, [])
    assert spm.size == 32000 and spm.assumed
    assert raw_vocab("SPMTokenizer", None, None, []).assumed


def test_corrupt_file_falls_back(tmp_path):
    path = tmp_path / "20B_tokenizer.json"
    path.write_text("{not json")
    rv = raw_vocab("HFTokenizer", str(path), None, [])
    assert rv.size == 50277
