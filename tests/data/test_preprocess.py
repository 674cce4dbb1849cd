"""`ntp-preprocess` in a real subprocess and its tokenizing core: formats, workers, reruns,
interruptions and bad input (exit 2, the field named, no traceback)."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from ntp_nemo.data import text_files, tokens
from ntp_nemo.data.prepare import build_data
from ntp_nemo.data.readers import collect_inputs
from ntp_nemo.data.text_files import tokenize_to_file
from ntp_nemo.data.tokenizer import build_tokenizer
from ntp_nemo.data.tokens import index_path, open_token_file, sidecar_path
from ntp_nemo.errors import ConfigError
from tests.data_helpers import corpus_documents, make_tokenizer_json, run_preprocess, write_jsonl


@pytest.fixture(scope="module")
def tok_json(tmp_path_factory):
    return make_tokenizer_json(tmp_path_factory.mktemp("tok") / "tok")


@pytest.fixture(scope="module")
def docs():
    return corpus_documents(60_000)


def _ids(path) -> np.ndarray:
    return np.asarray(open_token_file(path).tokens, dtype=np.int64)


def test_preprocess_writes_a_usable_token_file(tmp_path):
    (tmp_path / "a.txt").write_text("first document\n" * 40, encoding="utf-8")
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "b.txt").write_text("second — document\n" * 40, encoding="utf-8")
    res = run_preprocess("a.txt", "more", "--out", "out/tokens.bin", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    tf = open_token_file(tmp_path / "out" / "tokens.bin")
    expected = len(("first document\n" * 40).encode()) + len(("second — document\n" * 40).encode()) + 2
    assert tf.num_tokens == expected and tf.tokenizer == "byte" and tf.dtype == "uint16"
    assert f"wrote {expected} tokens in 2 documents" in res.stdout and "docs/s" in res.stdout
    assert int(np.count_nonzero(np.asarray(tf.tokens) == 256)) == 2  # one end-of-document per file
    assert tf.doc_ends.tolist() == [len(("first document\n" * 40).encode()) + 1, expected]
    data = build_data(str(tmp_path / "out" / "tokens.bin"), "byte", 32, 2, 0, 0.2, model_vocab_size=257)
    assert data.source == str(tmp_path / "out" / "tokens.bin")


def test_byte_tokenizer_round_trips_invalid_utf8_exactly(tmp_path):
    raw = b"valid \xc3\xa9 then invalid: \xff\xfe \xc3( \xed\xa0\x80 lone \x80\n\x00nul and more\r\n" * 50
    (tmp_path / "odd.txt").write_bytes(raw)
    res = run_preprocess("odd.txt", "--out", "odd.bin", "--tokenizer", "byte", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    ids = _ids(tmp_path / "odd.bin")
    assert ids[-1] == 256 and len(ids) == len(raw) + 1
    assert build_tokenizer("byte").decode_bytes(ids) == raw  # not a single byte replaced


def test_jsonl_gz_zst_parquet_give_the_same_tokens_as_text(tmp_path, tok_json, docs):
    zstd = pytest.importorskip("zstandard")
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    docs = docs[:40]
    txt = tmp_path / "txt"
    txt.mkdir()
    for i, doc in enumerate(docs):  # one document per text file, in sorted name order
        (txt / f"doc{i:03d}.txt").write_text(doc, encoding="utf-8")
    jsonl = write_jsonl(tmp_path / "d.jsonl", docs, field="body")
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(jsonl.read_bytes()))
    (tmp_path / "d.jsonl.zst").write_bytes(zstd.ZstdCompressor().compress(jsonl.read_bytes()))
    pq.write_table(pa.table({"body": docs, "n": list(range(len(docs)))}), tmp_path / "d.parquet",
                   row_group_size=7)
    outs = {}
    for name in ("txt", "d.jsonl", "d.jsonl.gz", "d.jsonl.zst", "d.parquet"):
        res = run_preprocess(name, "--out", f"{name}.bin", "--tokenizer", str(tok_json), "--field", "body",
                             cwd=tmp_path)
        assert res.returncode == 0, (name, res.stderr)
        outs[name] = open_token_file(tmp_path / f"{name}.bin")
    tok = build_tokenizer(str(tok_json))
    expected = np.concatenate([np.append(tok.encode(d), tok.eos_id) for d in docs])
    for name, tf in outs.items():
        assert np.array_equal(np.asarray(tf.tokens, dtype=np.int64), expected), name
        assert np.array_equal(tf.doc_ends, np.cumsum([len(tok.encode(d)) + 1 for d in docs])), name
        assert tf.meta["tokenizer_identity"]["hash"] == tok.identity["hash"]


def test_two_workers_give_the_same_output_as_one(tmp_path, tok_json, docs):
    for i in range(3):
        write_jsonl(tmp_path / "in" / f"part{i}.jsonl", docs[i::3])
    (tmp_path / "in" / "notes.txt").write_text(docs[0], encoding="utf-8")
    outs = []
    for workers in ("1", "2"):
        res = run_preprocess("in", "--out", f"w{workers}.bin", "--tokenizer", str(tok_json),
                             "--workers", workers, cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        outs.append(tmp_path / f"w{workers}.bin")
    for suffix in ("", ".idx"):
        assert (outs[0].parent / (outs[0].name + suffix)).read_bytes() == (
            outs[1].parent / (outs[1].name + suffix)).read_bytes()
    # Byte ranges of one .jsonl cut at arbitrary offsets, tokenized by two processes: the same again.
    files, _ = collect_inputs([tmp_path / "in"])
    tokenize_to_file(files, str(tok_json), tmp_path / "ranges.bin", workers=2, unit_bytes=1000)
    assert (tmp_path / "ranges.bin").read_bytes() == outs[0].read_bytes()
    assert index_path(tmp_path / "ranges.bin").read_bytes() == index_path(outs[0]).read_bytes()


def test_rerun_is_a_no_op_and_another_tokenizer_is_refused(tmp_path, tok_json, docs):
    write_jsonl(tmp_path / "a.jsonl", docs[:20])
    first = run_preprocess("a.jsonl", "--out", "t.bin", "--tokenizer", str(tok_json), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    stamp = (tmp_path / "t.bin").stat().st_mtime_ns
    again = run_preprocess("a.jsonl", "--out", "t.bin", "--tokenizer", str(tok_json), cwd=tmp_path)
    assert again.returncode == 0 and "up to date" in again.stdout
    assert (tmp_path / "t.bin").stat().st_mtime_ns == stamp
    other = run_preprocess("a.jsonl", "--out", "t.bin", "--tokenizer", "byte", cwd=tmp_path)
    assert other.returncode == 2 and "--out" in other.stderr and "Traceback" not in other.stderr
    assert "hf:tok" in other.stderr and "byte" in other.stderr
    assert (tmp_path / "t.bin").stat().st_mtime_ns == stamp  # left as it was


def _unloadable(path) -> None:
    with pytest.raises(ConfigError):
        open_token_file(path)
    with pytest.raises(ConfigError):
        build_data(str(path), None, 16, 2, 0)


def test_interrupted_preprocess_leaves_nothing_loadable(tmp_path, tok_json, docs, monkeypatch):
    good = write_jsonl(tmp_path / "in" / "a.jsonl", docs[:30])
    files, _ = collect_inputs([good])
    out = tmp_path / "t.bin"
    # 1) interrupted while tokenizing (the second unit): no output file at all, no temporary left.
    real = text_files._encode_unit
    calls = []

    def interrupted(unit, *args):
        calls.append(unit)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(unit, *args)

    monkeypatch.setattr(text_files, "_encode_unit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tokenize_to_file(files, str(tok_json), out, unit_bytes=2000)
    monkeypatch.setattr(text_files, "_encode_unit", real)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]
    # 2) a finished output, then a rerun on changed inputs interrupted while committing (after the
    # token file was replaced, before the new sidecar): the old sidecar is gone, nothing loads.
    tokenize_to_file(files, str(tok_json), out)
    assert open_token_file(out).num_tokens > 0
    write_jsonl(good, docs[:10])
    files, _ = collect_inputs([good])

    def crash(path, text):
        raise KeyboardInterrupt

    monkeypatch.setattr(tokens, "atomic_write_text", crash)
    with pytest.raises(KeyboardInterrupt):
        tokenize_to_file(files, str(tok_json), out)
    assert not sidecar_path(out).exists()
    _unloadable(out)


def _expect_exit_2(res, key: str, *fragments: str) -> None:
    assert res.returncode == 2, (key, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    assert f"{key}:" in res.stderr, (key, res.stderr)
    for fragment in fragments:
        assert fragment in res.stderr, (fragment, res.stderr)


def test_bad_inputs_exit_2_naming_the_field(tmp_path, tok_json, docs):
    write_jsonl(tmp_path / "ok.jsonl", docs[:5])
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{"text": unquoted}\n')
    (tmp_path / "damaged.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00not really gzip at all" * 10)
    (tmp_path / "fake.parquet").write_bytes(b"PAR1 not a parquet file PAR1")
    (tmp_path / "numbers.jsonl").write_text(json.dumps({"text": 12}) + "\n")
    cases = [
        (["empty.jsonl"], "INPUT", "empty"),
        (["blank.jsonl"], "INPUT", "no documents"),
        (["nothing*.jsonl"], "INPUT", "matches no file"),
        (["missing.txt"], "INPUT", "does not exist"),
        (["ok.jsonl", "--field", "body"], "--field", "no field 'body'"),
        (["numbers.jsonl"], "--field", "not text"),
        (["broken.jsonl"], "INPUT", "not valid JSON"),
        (["damaged.jsonl.gz"], "INPUT", "damaged"),
        (["fake.parquet"], "INPUT", "Parquet"),
        (["ok.jsonl", "--tokenizer", "no/such/tokenizer.json"], "--tokenizer", "does not exist"),
        (["ok.jsonl", "--tokenizer", "chars"], "--tokenizer", "unknown tokenizer"),
        (["ok.jsonl", "--workers", "0"], "--workers", ">= 1"),
    ]
    for args, key, fragment in cases:
        res = run_preprocess(*args, "--out", "t.bin", cwd=tmp_path)
        _expect_exit_2(res, key, fragment)
        assert not (tmp_path / "t.bin").exists() and not sidecar_path(tmp_path / "t.bin").exists()
    for args in ([], ["ok.jsonl"]):  # argparse usage errors
        res = run_preprocess(*args, cwd=tmp_path)
        assert res.returncode == 2 and "usage: ntp-preprocess" in res.stderr
