"""Exact ids, always: a long text cut into pieces for a GPT-2-style byte-level BPE encodes to the ids of
the whole document also where its whitespace is not ASCII (lines ending in U+00A0, paragraphs indented
with U+3000) or its lines end in CRLF; a document that would be encoded whole past the size limit is
refused, whatever the reason it cannot be cut."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from ntp_nemo.cli import preprocess
from ntp_nemo.data import readers
from ntp_nemo.data.tokens import open_token_file
from tests.data_helpers import corpus_documents, write_jsonl

CHUNK = 512  # lowered from readers.CHUNK_BYTES (4 MiB): the same cutting, many cuts in a small file


def _nbsp_lines() -> str:
    """English lines that end in a no-break space (as text pasted from a word processor)."""
    lines = [line for doc in corpus_documents(20_000) for line in doc.splitlines() if line.strip()]
    return "\n".join(f"{line}\u00a0" for line in lines[:400])


def _ideographic_paragraphs() -> str:
    """Chinese paragraphs indented with two ideographic spaces (U+3000), as Chinese prose is typeset."""
    sentences = ["天地玄黄，宇宙洪荒。", "日月盈昃，辰宿列张。", "寒来暑往，秋收冬藏。",
                 "闰余成岁，律吕调阳。", "云腾致雨，露结为霜。", "金生丽水，玉出昆冈。"]
    return "\n".join("\u3000\u3000" + "".join(sentences[(i + j) % 6] for j in range(1 + i % 4))
                     for i in range(300))


def _crlf_lines() -> str:
    return "\r\n".join(line for doc in corpus_documents(20_000) for line in doc.splitlines())[:30_000]


TEXTS = {"nbsp_line_ends": _nbsp_lines, "ideographic_indents": _ideographic_paragraphs, "crlf": _crlf_lines}


@pytest.fixture(scope="module")
def gpt2_style(tmp_path_factory):
    """A byte-level BPE like GPT-2's (ByteLevel pre-tokenizer with its regex, no prefix space, no
    normalizer) trained on the test texts themselves, so that it has merges across their whitespace."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([make() for make in TEXTS.values()], trainer)
    path = tmp_path_factory.mktemp("gpt2_style") / "tokenizer.json"
    tok.save(str(path))
    return path


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("kind", list(TEXTS))
def test_cut_pieces_encode_to_the_whole_documents_ids(tmp_path, gpt2_style, kind):
    from tokenizers import Tokenizer

    from ntp_nemo.data.tokenizer import load_tokenizer_json

    assert load_tokenizer_json(str(gpt2_style)).text_cut == "line"  # the rule under test applies
    tok = Tokenizer.from_file(str(gpt2_style))
    text = TEXTS[kind]()
    path = tmp_path / "doc.txt"
    path.write_bytes(text.encode("utf-8"))
    pieces = list(readers.text_pieces(path, "line", CHUNK))
    assert len(pieces) > 10 and b"".join(pieces) == path.read_bytes()
    by_piece = [i for p in pieces for i in _ids(tok, p.decode("utf-8"))]
    assert by_piece == _ids(tok, text)


def _cli(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["ntp-preprocess", *map(str, args), "--no-progress"])
    with pytest.raises(SystemExit) as exc:
        preprocess.main()
    cap = capsys.readouterr()
    return exc.value.code, cap.out, cap.err


def test_ntp_preprocess_writes_the_whole_documents_ids(tmp_path, monkeypatch, capsys, gpt2_style):
    from tokenizers import Tokenizer

    monkeypatch.setattr(readers, "CHUNK_BYTES", CHUNK)
    tok = Tokenizer.from_file(str(gpt2_style))
    (tmp_path / "in").mkdir()
    expected = []
    for kind, make in TEXTS.items():  # a directory's files in sorted order: crlf, ideographic, nbsp
        (tmp_path / "in" / f"{kind}.txt").write_bytes(make().encode("utf-8"))
    for name in sorted(p.name for p in (tmp_path / "in").iterdir()):
        text = (tmp_path / "in" / name).read_bytes().decode("utf-8")
        expected += _ids(tok, text) + [tok.token_to_id("<|endoftext|>")]
    rc, _, err = _cli(monkeypatch, capsys, tmp_path / "in", "--out", tmp_path / "t.bin", "--tokenizer",
                      gpt2_style)
    assert rc == 0, err
    assert np.asarray(open_token_file(tmp_path / "t.bin").tokens, dtype=np.int64).tolist() == expected


def test_text_without_a_place_to_cut_is_refused_past_the_limit(tmp_path, monkeypatch, capsys, gpt2_style):
    """No whitespace between non-spaces (one long token stream): it would be encoded whole; past the
    limit it is refused, not encoded silently, and no output is written."""
    monkeypatch.setattr(readers, "CHUNK_BYTES", CHUNK)
    monkeypatch.setattr(readers, "MAX_WHOLE_TEXT_BYTES", 16_000)
    (tmp_path / "blob.txt").write_text("QUJD" * 5_000)  # 20 kB of base64-like text
    rc, _, err = _cli(monkeypatch, capsys, tmp_path / "blob.txt", "--out", tmp_path / "t.bin",
                      "--tokenizer", gpt2_style)
    assert rc == 2, err
    assert "blob.txt" in err and "encoded whole" in err and "Split it into several documents" in err
    assert "Traceback" not in err and not (tmp_path / "t.bin").exists()
    # Under the limit the same kind of file is encoded whole, exactly.
    (tmp_path / "small.txt").write_text("QUJD" * 3_000)
    rc, _, err = _cli(monkeypatch, capsys, tmp_path / "small.txt", "--out", tmp_path / "s.bin",
                      "--tokenizer", gpt2_style)
    assert rc == 0, err


def test_a_json_document_past_the_limit_is_refused(tmp_path, monkeypatch, capsys, gpt2_style):
    monkeypatch.setattr(readers, "MAX_WHOLE_TEXT_BYTES", 16_000)
    write_jsonl(tmp_path / "docs.jsonl", ["a short one", "word " * 4_000])
    rc, _, err = _cli(monkeypatch, capsys, tmp_path / "docs.jsonl", "--out", tmp_path / "t.bin",
                      "--tokenizer", gpt2_style)
    assert rc == 2 and "docs.jsonl" in err and "Split it into several documents" in err, err
    assert not (tmp_path / "t.bin").exists()
