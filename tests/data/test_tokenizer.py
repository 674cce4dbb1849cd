"""Tokenizers: lossless round-trips, ids in range, unknown names rejected."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from ntp_nemo.data.tokenizer import ByteTokenizer, build_tokenizer
from ntp_nemo.errors import ConfigError

TEXTS = ["", "hello world\n", "naïve café — 日本語 🙂\r\n\ttabs", "def f(x):\n    return x ** 2\n"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NTP_NEMO_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert np.issubdtype(ids.dtype, np.integer)
    assert len(ids) == len(text.encode("utf-8"))
    assert ids.size == 0 or (ids.min() >= 0 and ids.max() < 256)
    assert tok.decode(ids) == text
    assert tok.decode(list(ids)) == text


def test_byte_eos_and_vocab():
    tok = build_tokenizer("byte")
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    ids = np.concatenate([tok.encode("ab"), [tok.eos_id], tok.encode("c")])
    assert tok.decode(ids) == "abc"
    with pytest.raises(ValueError):
        tok.decode([257])


def test_unknown_tokenizer_is_config_error():
    with pytest.raises(ConfigError) as err:
        build_tokenizer("wordpiece")
    assert err.value.key == "data.tokenizer"
    assert "wordpiece" in str(err.value)


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="tokenizers not installed")
def test_bpe_round_trip_and_cache(tmp_path):
    tok = build_tokenizer("bpe")
    assert tok.vocab_size > 257
    assert 0 <= tok.eos_id < tok.vocab_size
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert ids.size == 0 or ids.max() < tok.vocab_size
    code = "import os\n\ndef main():\n    return os.path.join('a', 'b')\n"
    assert len(tok.encode(code)) < len(code) / 2  # merges learned from Python sources compress code
    cached = list((tmp_path / "cache" / "tokenizers").glob("bpe-*.json"))
    assert len(cached) == 1
    again = build_tokenizer("bpe")
    assert np.array_equal(again.encode(code), tok.encode(code))


def test_tokenizer_json_bos_prefix_and_declared_eos(tmp_path):
    tk = pytest.importorskip("tokenizers")
    from ntp_nemo.data.readers import collect_inputs
    from ntp_nemo.data.text_files import tokenize_to_file
    from ntp_nemo.data.tokens import open_token_file

    vocab = {"<s>": 0, "</s>": 1, "<eot>": 2, "a": 3, "b": 4}
    backend = tk.Tokenizer(tk.models.WordLevel(vocab, unk_token="</s>"))
    backend.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<s>", "</s>", "<eot>"])
    backend.post_processor = tk.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    model = tmp_path / "model"
    model.mkdir()
    backend.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text('{"eos_token": "<eot>"}')  # declared: wins over </s>
    tok = build_tokenizer(str(model))
    assert tok.name == "hf:model" and tok.eos_id == 2 and tok.prefix.tolist() == [0]
    (tmp_path / "d.jsonl").write_text('{"text": "a b"}\n{"text": "b"}\n')
    files, _ = collect_inputs([tmp_path / "d.jsonl"])
    tokenize_to_file(files, str(model), tmp_path / "t.bin")
    tf = open_token_file(tmp_path / "t.bin")
    assert tf.tokens.tolist() == [0, 3, 4, 2, 0, 4, 2]  # <s> a b <eot> <s> b <eot>
    assert tf.doc_ends.tolist() == [4, 7]
