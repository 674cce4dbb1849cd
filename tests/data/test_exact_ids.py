"""Token ids exactly as the tokenizer gives them (long texts in pieces only where that is exact), what
tokenizing lost reported (replaced bytes, empty documents, a broken tokenizer; `--strict`), and the
end-of-document token chosen by name (`--eos-token`, `data.eos_token`) as part of the identity.

`ntp-preprocess` runs in this process (its console entry point, `sys.argv` and exit code) so that the
piece size can be lowered: every document here spans many pieces, as a multi-megabyte one does."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from ntp_nemo.cli import preprocess
from ntp_nemo.data import readers
from ntp_nemo.data.prepare import build_data
from ntp_nemo.data.tokens import open_token_file, read_sidecar, sidecar_path
from ntp_nemo.errors import ConfigError
from tests.conftest import run_cli
from tests.data_helpers import corpus_documents, make_tokenizer_json, make_unigram_json, write_jsonl

PIECE = 4096  # lowered from readers.CHUNK_BYTES (4 MiB): the same cutting, many more cuts


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    """tokenizer.json files: SentencePiece-style (Metaspace, two prefix schemes), GPT-2-style byte-level
    BPE, one with a normalizer (cannot be cut) and a broken one (every document is one unknown token)."""
    from tokenizers import Tokenizer, models, normalizers

    root = tmp_path_factory.mktemp("toks")
    out = {
        "unigram": make_unigram_json(root / "unigram"),
        "unigram_first": make_unigram_json(root / "unigram_first", prepend_scheme="first"),
        "bpe": make_tokenizer_json(root / "bpe"),
    }
    normalized = Tokenizer.from_file(str(out["unigram"]))
    normalized.normalizer = normalizers.NFKC()
    (root / "normalized").mkdir()
    normalized.save(str(root / "normalized" / "tokenizer.json"))
    out["normalized"] = root / "normalized" / "tokenizer.json"
    broken = Tokenizer(models.WordLevel({"<unk>": 0, "<|endoftext|>": 1}, unk_token="<unk>"))
    (root / "broken").mkdir()
    broken.save(str(root / "broken" / "tokenizer.json"))
    out["broken"] = root / "broken" / "tokenizer.json"
    return out


@pytest.fixture(scope="module")
def long_text() -> str:
    """About 60 kB of text: lines, single and double spaces, indentation, blank lines."""
    return "\n".join(corpus_documents(60_000))


def _cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["ntp-preprocess", *map(str, args), "--no-progress"])
    with pytest.raises(SystemExit) as exc:
        preprocess.main()
    cap = capsys.readouterr()
    return exc.value.code, cap.out, cap.err


def _reference(tok_json, text: str, eos: str) -> list[int]:
    """What the `tokenizers` library itself gives for the whole document, then the end-of-document id."""
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(tok_json))
    return ref.encode(text, add_special_tokens=False).ids + [ref.token_to_id(eos)]


@pytest.mark.parametrize("kind,eos", [("unigram", "</s>"), ("unigram_first", "</s>"),
                                      ("bpe", "<|endoftext|>"), ("normalized", "</s>")])
def test_long_text_file_encodes_like_the_whole_document(tmp_path, monkeypatch, capsys, toks, long_text,
                                                        kind, eos):
    monkeypatch.setattr(readers, "CHUNK_BYTES", PIECE)
    (tmp_path / "doc.txt").write_text(long_text, encoding="utf-8")
    rc, out, err = _cli(monkeypatch, capsys, tmp_path / "doc.txt", "--out", tmp_path / "t.bin",
                        "--tokenizer", toks[kind].parent)
    assert rc == 0, err
    ids = np.asarray(open_token_file(tmp_path / "t.bin").tokens, dtype=np.int64).tolist()
    assert ids == _reference(toks[kind], long_text, eos)
    assert "warning" not in err
    # data.path=<the text file> goes through the same tokenizing: the same ids.
    data = build_data(str(tmp_path / "doc.txt"), str(toks[kind].parent), 32, 4, 0)
    assert np.asarray(open_token_file(data.sources[0]).tokens, dtype=np.int64).tolist() == ids


def test_cutting_at_line_breaks_would_change_sentencepiece_ids(tmp_path, toks, long_text):
    """Why the cut follows the tokenizer: the old cut (after line breaks) gives other ids under Metaspace."""
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(toks["unigram"]))
    (tmp_path / "doc.txt").write_text(long_text, encoding="utf-8")
    pieces = list(readers.text_pieces(tmp_path / "doc.txt", "line", PIECE))
    assert len(pieces) > 10
    by_piece = [i for p in pieces for i in ref.encode(p.decode(), add_special_tokens=False).ids]
    assert by_piece != ref.encode(long_text, add_special_tokens=False).ids


def test_text_too_large_to_encode_whole_is_refused(tmp_path, monkeypatch, capsys, toks, long_text):
    monkeypatch.setattr(readers, "MAX_WHOLE_TEXT_BYTES", 16_000)
    (tmp_path / "doc.txt").write_text(long_text, encoding="utf-8")
    rc, _, err = _cli(monkeypatch, capsys, tmp_path / "doc.txt", "--out", tmp_path / "t.bin",
                      "--tokenizer", toks["normalized"])
    assert rc == 2 and "INPUT:" in err and "doc.txt" in err and "Split it into several documents" in err
    assert not (tmp_path / "t.bin").exists()
    # A tokenizer that can be cut takes the same file.
    rc, _, err = _cli(monkeypatch, capsys, tmp_path / "doc.txt", "--out", tmp_path / "t.bin",
                      "--tokenizer", toks["unigram"])
    assert rc == 0, err
    with pytest.raises(ConfigError, match="data.path: .*Split it into several documents"):
        build_data(str(tmp_path / "doc.txt"), str(toks["normalized"]), 32, 4, 0)


def test_lossy_inputs_are_counted_reported_and_refused_under_strict(tmp_path, monkeypatch, capsys, toks):
    docs = corpus_documents(20_000)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_bytes(docs[0].encode() + b" bad \xff\xfe bytes " + docs[1].encode())
    (tmp_path / "in" / "b.txt").write_bytes(b"\xc3( and \x80 " + docs[2].encode())
    write_jsonl(tmp_path / "in" / "c.jsonl", [docs[3], "", docs[4], ""])
    args = [tmp_path / "in", "--out", tmp_path / "t.bin", "--tokenizer", toks["bpe"]]
    rc, out, err = _cli(monkeypatch, capsys, *args)
    assert rc == 0, err
    assert "2 document(s) held bytes that are not UTF-8" in err and "2 document(s) were empty" in err
    quality = read_sidecar(tmp_path / "t.bin")["quality"]
    assert quality["documents_with_replaced_bytes"] == 2 and quality["empty_documents"] == 2
    assert quality["implausibly_few_tokens"] is False and 0.1 < quality["tokens_per_byte"] < 1
    # The rerun (up to date) still says so, and --strict refuses it.
    rc, out, err = _cli(monkeypatch, capsys, *args)
    assert rc == 0 and "up to date" in out and "not UTF-8" in err
    rc, _, err = _cli(monkeypatch, capsys, *args, "--strict")
    assert rc == 2 and "--strict:" in err and "Traceback" not in err
    # --strict on a fresh output writes nothing; the byte tokenizer replaces no byte: no complaint.
    rc, _, err = _cli(monkeypatch, capsys, *args[:2], tmp_path / "s.bin", *args[3:], "--strict")
    assert rc == 2 and "2 document(s) were empty" in err and "not UTF-8" in err
    assert not (tmp_path / "s.bin").exists() and not sidecar_path(tmp_path / "s.bin").exists()
    rc, _, err = _cli(monkeypatch, capsys, tmp_path / "in" / "a.txt", "--out", tmp_path / "b.bin", "--strict")
    assert rc == 0, err
    assert read_sidecar(tmp_path / "b.bin")["quality"]["documents_with_replaced_bytes"] == 0


def test_a_tokenizer_giving_implausibly_few_tokens_is_reported(tmp_path, monkeypatch, capsys, toks):
    write_jsonl(tmp_path / "a.jsonl", corpus_documents(40_000))
    args = [tmp_path / "a.jsonl", "--out", tmp_path / "t.bin", "--tokenizer", toks["broken"]]
    rc, _, err = _cli(monkeypatch, capsys, *args, "--strict")
    assert rc == 2 and "--strict:" in err and "tokens per byte" in err and "broken" in err
    rc, _, err = _cli(monkeypatch, capsys, *args)
    assert rc == 0 and "warning:" in err and "tokens per byte" in err
    assert read_sidecar(tmp_path / "t.bin")["quality"]["implausibly_few_tokens"] is True


def test_eos_token_names_the_end_of_document_and_is_part_of_the_identity(tmp_path, monkeypatch, capsys,
                                                                         toks):
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(toks["unigram"]))
    docs = corpus_documents(10_000)[:5]
    write_jsonl(tmp_path / "a.jsonl", docs)
    tok_dir = toks["unigram"].parent
    args = [tmp_path / "a.jsonl", "--out", tmp_path / "t.bin", "--tokenizer", tok_dir]
    rc, _, err = _cli(monkeypatch, capsys, *args, "--eos-token", "<eod>")
    assert rc == 0, err
    ids = np.asarray(open_token_file(tmp_path / "t.bin").tokens, dtype=np.int64).tolist()
    eod = ref.token_to_id("<eod>")
    assert ids == [i for d in docs for i in ref.encode(d, add_special_tokens=False).ids + [eod]]
    assert read_sidecar(tmp_path / "t.bin")["tokenizer_identity"]["eos_id"] == eod != ref.token_to_id("</s>")
    # The same output with the tokenizer's own end of document (</s>) is another tokenizer: refused.
    rc, _, err = _cli(monkeypatch, capsys, *args)
    assert rc == 2 and "--out:" in err and f"end-of-document id {eod}" in err
    # Training: the file is refused without data.eos_token, taken with it.
    with pytest.raises(ConfigError, match="data.eos_token: .*ends its documents with id"):
        build_data(str(tmp_path / "t.bin"), str(tok_dir), 8, 2, 0)
    assert build_data(str(tmp_path / "t.bin"), str(tok_dir), 8, 2, 0, eos_token="<eod>").eos_id == eod
    # A token the vocabulary lacks, or a name for the byte tokenizer: exit 2, nothing written.
    for tokenizer, token in ((tok_dir, "<nope>"), ("byte", "</s>")):
        rc, _, err = _cli(monkeypatch, capsys, *args[:2], tmp_path / "x.bin", "--tokenizer", tokenizer,
                          "--eos-token", token)
        assert rc == 2 and "--eos-token:" in err and not (tmp_path / "x.bin").exists(), err


def test_train_refuses_an_unknown_data_eos_token_before_starting(tmp_path, toks):
    res = run_cli([f"data.tokenizer={toks['unigram'].parent}", "data.eos_token='<nope>'",
                   f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "data.eos_token:" in res.stderr and "'<nope>' is not a token" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()
