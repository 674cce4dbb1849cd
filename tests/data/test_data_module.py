"""build_data end to end: built-in corpus, user text files and directories, token files, bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ntp_nemo.data.corpus import default_corpus_tokens
from ntp_nemo.data.prepare import build_data
from ntp_nemo.data.stdlib_text import stdlib_documents
from ntp_nemo.data.tokenizer import ByteTokenizer
from ntp_nemo.data.tokens import open_token_file, write_token_file
from ntp_nemo.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("NTP_NEMO_CACHE", str(path))
    return path


def _text(n: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "naïve", "ωmega"]
    return " ".join(words[i] for i in rng.integers(0, len(words), size=n)) + "\n"


def test_default_corpus(cache):
    data = build_data(None, "byte", seq_len=64, global_batch_size=8, seed=0)
    assert (data.tokenizer_name, data.vocab_size) == ("byte", 257)
    assert data.num_tokens > 1_000_000
    assert data.val.end == data.num_tokens
    ends = open_token_file(data.source).doc_ends
    assert len(ends) > 100
    # The last 5% of the documents are held out: validation starts where a document starts.
    assert data.val.start == data.train.end == ends[len(ends) - round(0.05 * len(ends)) - 1]
    assert data.sampler.num_samples == len(data.train)
    batch = data.train.batch(data.sampler.batch_ids(0))
    assert batch.shape == (8, 65) and batch.dtype == torch.int64
    first_doc = next(stdlib_documents())
    assert data.train[0].tolist() == list(first_doc.encode("utf-8")[:65])  # the stdlib text, in order
    assert Path(data.source).parent == cache / "corpus"
    # Cached: a second build reuses the same file and empty path means the same corpus.
    assert build_data("", "byte", 64, 8, 0).source == data.source


def test_user_text_file_is_tokenized_and_cached(tmp_path, cache):
    path = tmp_path / "notes.txt"
    text = _text(3000)
    path.write_text(text, encoding="utf-8")
    data = build_data(str(path), "byte", seq_len=32, global_batch_size=4, seed=1, val_fraction=0.1)
    raw = text.encode("utf-8")
    assert data.num_tokens == len(raw) + 1  # one document + end-of-document
    assert data.train[0].tolist() == list(raw[:33])
    assert data.val.start == data.train.end
    again = build_data(str(path), "byte", 32, 4, 1, 0.1)
    assert again.source == data.source  # cache hit
    path.write_text(text + "more text\n", encoding="utf-8")
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert build_data(str(path), "byte", 32, 4, 1, 0.1).source != data.source  # edited: retokenized


def test_directory_of_text_files(tmp_path):
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    (d / "b.txt").write_text("second " * 200)
    (d / "a.md").write_text("first " * 200)
    (d / "sub" / "c.txt").write_text("third " * 200)
    (d / ".hidden").write_text("never")
    (d / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    data = build_data(str(d), "byte", 16, 2, 0, 0.2)
    tok = ByteTokenizer()
    expected = np.concatenate([tok.encode(s * 200).tolist() + [256] for s in ("first ", "second ", "third ")])
    assert np.array_equal(np.asarray(open_token_file(data.source).tokens, dtype=np.int64), expected)


def test_preprocessed_token_file_is_memory_mapped(tmp_path):
    ids = np.random.default_rng(2).integers(0, 257, size=5000)
    path = write_token_file(ids, tmp_path / "corpus.bin", "byte", 257)
    data = build_data(str(path), "byte", seq_len=50, global_batch_size=4, seed=0, model_vocab_size=257)
    assert data.source == str(path)
    assert isinstance(data.train.tokens, np.memmap)
    assert data.train[1].tolist() == ids[50:101].tolist()
    foreign = write_token_file(ids % 100, tmp_path / "foreign.bin", "gpt2", 100)
    assert build_data(str(foreign), "gpt2", 50, 4, 0, model_vocab_size=128).vocab_size == 100


def test_bad_inputs(tmp_path):
    cases = []
    cases.append(("data.path", dict(path=str(tmp_path / "nope.txt"))))
    (tmp_path / "empty.txt").write_text("")
    cases.append(("data.path", dict(path=str(tmp_path / "empty.txt"))))
    (tmp_path / "orphan.bin").write_bytes(b"\x00\x01" * 50)
    cases.append(("data.path", dict(path=str(tmp_path / "orphan.bin"))))
    small = tmp_path / "small.txt"
    small.write_text("tiny text " * 10)
    cases.append(("data.seq_len", dict(path=str(small), seq_len=64)))
    big = tmp_path / "big.txt"
    big.write_text(_text(2000))
    cases.append(("model.vocab_size", dict(path=str(big), model_vocab_size=200)))
    cases.append(("data.tokenizer", dict(path=str(big), tokenizer="chars")))
    cases.append(("data.seq_len", dict(path=str(big), seq_len=0)))
    # Token files may carry any tokenizer name (e.g. from another toolchain); data.tokenizer must name it.
    wide = write_token_file(np.arange(3000) % 1000, tmp_path / "wide.bin", "gpt2", 1000)
    cases.append(("model.vocab_size", dict(path=str(wide), tokenizer="gpt2", model_vocab_size=512)))
    cases.append(("data.tokenizer", dict(path=str(wide))))
    for key, overrides in cases:
        kwargs = dict(path=None, tokenizer="byte", seq_len=16, global_batch_size=2, seed=0)
        kwargs.update(overrides)
        with pytest.raises(ConfigError) as err:
            build_data(**kwargs)
        assert err.value.key == key, (key, overrides, str(err.value))
        assert len(str(err.value)) > 60  # a sentence with the fix, not a bare key


def test_concurrent_first_use_builds_one_valid_corpus(cache):
    script = (
        "from ntp_nemo.data.corpus import default_corpus_tokens as f; "
        "print(f('byte', max_bytes=300_000))"
    )
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    procs = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(outs)) == 1
    tf = open_token_file(outs[0])
    assert 300_000 < tf.num_tokens < 300_000 + 1000
    assert not [p for p in (cache / "corpus").iterdir() if p.name.endswith(".tmp")]
    assert default_corpus_tokens("byte", max_bytes=300_000) == Path(outs[0])
