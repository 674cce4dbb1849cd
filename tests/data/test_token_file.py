"""Token files: round-trip through memmap and sidecar, atomic writes, clear errors for bad files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ntp_nemo.data.tokens import TokenFileWriter, open_token_file, sidecar_path, write_token_file
from ntp_nemo.errors import ConfigError


@pytest.mark.parametrize("vocab,dtype", [(257, "uint16"), (65536, "uint16"), (70000, "uint32")])
def test_round_trip(tmp_path, vocab, dtype):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, size=1000)
    ids[7] = vocab - 1
    path = write_token_file(ids, tmp_path / "toks.bin", "byte", vocab)
    meta = json.loads(sidecar_path(path).read_text())
    assert meta["dtype"] == dtype and meta["num_tokens"] == 1000 and meta["vocab_size"] == vocab
    assert meta["max_token_id"] == vocab - 1 and meta["tokenizer"] == "byte"
    tf = open_token_file(path)
    assert isinstance(tf.tokens, np.memmap)
    assert tf.dtype == dtype and tf.num_tokens == 1000 and tf.tokenizer == "byte"
    assert np.array_equal(np.asarray(tf.tokens, dtype=np.int64), ids)
    # no temporary file left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["toks.bin", "toks.bin.idx", "toks.bin.json"]


def test_streaming_writer_and_abort(tmp_path):
    with TokenFileWriter(tmp_path / "a.bin", "byte", 257) as w:
        w.append([1, 2, 3])
        w.append(np.array([256]))
    assert open_token_file(tmp_path / "a.bin").tokens.tolist() == [1, 2, 3, 256]
    with pytest.raises(RuntimeError):
        with TokenFileWriter(tmp_path / "b.bin", "byte", 257) as w:
            w.append([1, 2])
            raise RuntimeError("interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "a.bin.idx", "a.bin.json"]


def test_out_of_range_ids_rejected(tmp_path):
    with pytest.raises(ValueError):
        write_token_file([0, 257], tmp_path / "x.bin", "byte", 257)
    with pytest.raises(ValueError):
        write_token_file([-1], tmp_path / "x.bin", "byte", 257)
    assert not (tmp_path / "x.bin").exists()


def _corrupt(path, how):
    meta_path = sidecar_path(path)
    meta = json.loads(meta_path.read_text())
    if how == "json":
        meta_path.write_text("{not json")
    elif how == "dtype":
        meta["dtype"] = "float16"
        meta_path.write_text(json.dumps(meta))
    elif how == "count":
        meta["num_tokens"] += 1
        meta_path.write_text(json.dumps(meta))
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:-1])
    elif how == "missing_key":
        del meta["dtype"]
        meta_path.write_text(json.dumps(meta))
    elif how == "no_sidecar":
        meta_path.unlink()
    elif how == "no_file":
        path.unlink()


BREAKAGES = ["json", "dtype", "count", "truncated", "missing_key", "no_sidecar", "no_file"]


@pytest.mark.parametrize("how", BREAKAGES)
def test_bad_files_are_config_errors(tmp_path, how):
    path = write_token_file(np.arange(100), tmp_path / "t.bin", "byte", 257)
    _corrupt(path, how)
    with pytest.raises(ConfigError) as err:
        open_token_file(path)
    assert err.value.key == "data.path"
    assert "t.bin" in str(err.value) and "ntp-preprocess" in str(err.value)
