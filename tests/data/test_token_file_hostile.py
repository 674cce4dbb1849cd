"""Token files and tokenizer files from elsewhere: ids outside the vocabulary, lying sidecars, deeply
nested JSON, FIFOs.  Each is refused when the data is opened (before any worker starts) with a
message naming the file, never an IndexError in a worker, a RecursionError or a blocked read."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

from ntp_nemo.data.bounded_json import JSONBoundError, parse_json, read_json
from ntp_nemo.data.prepare import build_data
from ntp_nemo.data.tokenizer import load_tokenizer_json
from ntp_nemo.data.tokens import open_token_file, read_sidecar, sidecar_path, write_token_file
from ntp_nemo.errors import ConfigError
from tests.conftest import SINGLE, TINY, run_cli
from tests.data_helpers import make_tokenizer_json

DEEP = "[" * 100_000 + "]" * 100_000


def _token_file(directory, n=20_000, vocab=257):
    ids = np.random.default_rng(0).integers(0, vocab, n)
    return write_token_file(ids, directory / "tokens.bin", "byte", vocab)


def _poke(path, position, token_id):
    """Overwrite one uint16 id in place (the sidecar, and its largest-id claim, stay as written)."""
    raw = bytearray(path.read_bytes())
    raw[2 * position : 2 * position + 2] = int(token_id).to_bytes(2, "little")
    path.write_bytes(bytes(raw))


def test_out_of_range_id_is_refused_at_open_naming_the_file(tmp_path):
    path = _token_file(tmp_path)
    assert open_token_file(path).max_token_id == 256
    _poke(path, 12_345, 65_000)
    assert read_sidecar(path)["max_token_id"] == 256  # the sidecar still claims the old largest id
    with pytest.raises(ConfigError) as err:
        open_token_file(path)
    msg = str(err.value)
    assert err.value.key == "data.path" and str(path) in msg and "65000" in msg and "257-id vocabulary" in msg
    with pytest.raises(ConfigError, match="65000"):  # the whole data setup, as the launcher runs it
        build_data(str(path), None, 32, 12, 0, model_vocab_size=257)


def test_a_sidecar_that_underclaims_the_largest_id_is_not_trusted(tmp_path):
    path = _token_file(tmp_path, vocab=300)
    _poke(path, 7, 299)
    meta = json.loads(sidecar_path(path).read_text())
    meta["max_token_id"] = 10  # a lie that would let a too-small model.vocab_size through
    sidecar_path(path).write_text(json.dumps(meta))
    assert open_token_file(path).max_token_id == 299
    with pytest.raises(ConfigError) as err:
        build_data(str(path), None, 32, 12, 0, model_vocab_size=100)
    assert err.value.key == "model.vocab_size" and "299" in str(err.value)


def test_deeply_nested_sidecar_is_a_clear_error(tmp_path):
    path = _token_file(tmp_path)
    sidecar_path(path).write_text(DEEP)
    assert read_sidecar(path) is None
    with pytest.raises(ConfigError) as err:
        open_token_file(path)
    msg = str(err.value)
    assert str(path) in msg and "levels deep" in msg and len(msg) < 600 and "\n" not in msg


def _within(seconds, fn):
    out = {}

    def run():
        try:
            out["v"] = fn()
        except Exception as err:  # noqa: BLE001 - handed to the test thread
            out["err"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"blocked for more than {seconds} s"
    return out


def test_fifos_are_never_opened_for_reading(tmp_path):
    path = _token_file(tmp_path)
    sidecar_path(path).unlink()
    os.mkfifo(sidecar_path(path))
    out = _within(20, lambda: open_token_file(path))
    assert isinstance(out.get("err"), ConfigError) and "not a regular file" in str(out["err"])
    fifo = tmp_path / "fifo.bin"
    os.mkfifo(fifo)
    out = _within(20, lambda: open_token_file(fifo))
    assert isinstance(out.get("err"), ConfigError) and "not a regular file" in str(out["err"])
    out = _within(20, lambda: read_json(fifo))
    assert isinstance(out.get("err"), JSONBoundError)


def test_deeply_nested_tokenizer_files_are_config_errors(tmp_path):
    tok = make_tokenizer_json(tmp_path / "tok")
    (tok.parent / "tokenizer_config.json").write_text('{"eos_token": ' + DEEP + "}")
    with pytest.raises(ConfigError) as err:
        load_tokenizer_json(str(tok))
    assert err.value.key == "data.tokenizer" and "tokenizer_config.json" in str(err.value)
    assert "levels deep" in str(err.value)
    deep_tok = tmp_path / "deep" / "tokenizer.json"
    deep_tok.parent.mkdir()
    deep_tok.write_text('{"model": ' + DEEP + "}")
    with pytest.raises(ConfigError) as err:
        load_tokenizer_json(str(deep_tok))
    assert err.value.key == "data.tokenizer" and "levels deep" in str(err.value)


def test_bounded_parse_keeps_ordinary_json_and_strings_with_brackets():
    assert parse_json('{"a": "[[[[", "b": [[1], {"c": "]]"}]}') == {"a": "[[[[", "b": [[1], {"c": "]]"}]}
    assert parse_json("[" * 64 + "]" * 64) is not None
    with pytest.raises(JSONBoundError, match="65 levels"):
        parse_json("[" * 65 + "]" * 65)


def test_hf_index_naming_a_file_outside_the_directory_is_refused(tmp_path):
    from ntp_nemo.hf.safetensors_files import HFWeightsReader

    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "../../etc/passwd"}}))
    reader = HFWeightsReader(tmp_path)
    with pytest.raises(ConfigError, match="not a file of that directory"):
        reader._open(reader.weight_map["lm_head.weight"])
    (tmp_path / "model.safetensors.index.json").write_text(DEEP)
    with pytest.raises(ConfigError, match="levels deep"):
        HFWeightsReader(tmp_path)


@pytest.mark.slow
def test_cli_out_of_range_ids_exit_2_before_any_worker(tmp_path):
    path = _token_file(tmp_path)
    _poke(path, 5_000, 60_000)
    proc = run_cli([*TINY, *SINGLE, f"data.path={path}", "trainer.max_steps=2",
                    f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out and "IndexError" not in out
    assert str(path) in proc.stderr and "60000" in proc.stderr


def test_export_refuses_a_tokenizer_config_that_is_not_a_json_object(tmp_path):
    """`ntp-export` adds the end-of-document token to the copied `tokenizer_config.json`: a file that the
    tokenizer's loader accepts but that is not an object (a list) is a config error naming it, not an
    AttributeError; a bounded object is exported with the token added."""
    from ntp_nemo.hf.export import RunTokenizer, write_tokenizer_files

    tok = make_tokenizer_json(tmp_path / "tok")
    (tok.parent / "tokenizer_config.json").write_text("[1, 2]")
    (tmp_path / "out").mkdir()
    with pytest.raises(ConfigError) as err:
        write_tokenizer_files(RunTokenizer(str(tok), eos_token="<|endoftext|>"), tmp_path / "out")
    assert err.value.key == "RUN_DIR_OR_CHECKPOINT"
    assert str(tok.parent / "tokenizer_config.json") in str(err.value)
    assert "not a JSON object" in str(err.value) and "--no-tokenizer" in str(err.value)
    (tok.parent / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    (tmp_path / "ok").mkdir()
    names, _ = write_tokenizer_files(RunTokenizer(str(tok), eos_token="<|endoftext|>"), tmp_path / "ok")
    written = json.loads((tmp_path / "ok" / "tokenizer_config.json").read_text())
    assert "tokenizer_config.json" in names
    assert written == {"model_max_length": 64, "eos_token": "<|endoftext|>"}, written


@pytest.mark.parametrize("key", ["num_tokens", "vocab_size", "num_documents"])
@pytest.mark.parametrize("literal", ["1e999", "-1e999", "Infinity", "NaN", "12.5"])
def test_a_sidecar_count_beyond_range_or_not_whole_is_a_clear_error(tmp_path, key, literal):
    """`1e999` in a sidecar's count raised an uncaught OverflowError (exit 1 with a traceback); every
    count that is not a whole number is now the token file's one-paragraph error, at open and where the
    launcher chooses the vocabulary from the sidecars."""
    from ntp_nemo.data.vocabulary import choose_vocabulary

    path = _token_file(tmp_path)
    meta = sidecar_path(path).read_text()
    doc = json.loads(meta)
    sidecar_path(path).write_text(meta.replace(f'"{key}":{json.dumps(doc[key])}', f'"{key}":{literal}')
                                  .replace(f'"{key}": {json.dumps(doc[key])}', f'"{key}": {literal}'))
    assert sidecar_path(path).read_text() != meta
    if literal != "12.5" or key != "num_documents":  # a fractional document count is caught below
        with pytest.raises(ConfigError) as err:
            open_token_file(path)
        msg = str(err.value)
        assert err.value.key == "data.path" and str(path) in msg and "\n" not in msg
        assert "ntp-preprocess" in msg  # the fix
    vocab = choose_vocabulary(None, [str(path)], None, 1, 1)  # no traceback; the open names the file
    assert vocab.tokenizer_vocab in (257, 256)
