"""`ntp-export` of a run trained with a Hugging Face tokenizer writes that tokenizer, so that
`transformers.AutoTokenizer.from_pretrained(OUT)` encodes as the run did (its chosen end-of-document
token included); a run whose tokenizer is gone is refused; files get the user's umask."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.conftest import SINGLE, TINY, run_cli
from tests.data_helpers import corpus_documents, make_unigram_json

TEXT = "Hello world. The quick brown fox jumps over the lazy dog; def main(argv): return 0\n  indented"


def _export_in_process(monkeypatch, capsys, args: list[str]) -> str:
    """`ntp-export ARGS` called in this process; returns what it printed (it must exit 0)."""
    from ntp_nemo.cli.export import main

    monkeypatch.setattr(sys, "argv", ["ntp-export", *args])
    with pytest.raises(SystemExit) as done:
        main()
    out, err = capsys.readouterr()
    assert done.value.code == 0, err
    return out


@pytest.mark.slow
def test_export_writes_the_runs_tokenizer(tmp_path, monkeypatch, capsys):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    tok_dir = make_unigram_json(tmp_path / "tok").parent
    (tmp_path / "corpus.txt").write_text("\n\n".join(corpus_documents(40_000)), encoding="utf-8")
    run = tmp_path / "run"
    res = run_cli([*TINY, *SINGLE, "trainer.max_steps=2", f"data.path={tmp_path / 'corpus.txt'}",
                   f"data.tokenizer={tok_dir}", "data.eos_token='<eod>'", f"hydra.run.dir={run}"],
                  cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    # ntp-export in this process, as its console script calls it; the refusal below in a process of its
    # own (its exit code).
    capsys.readouterr()
    out = _export_in_process(monkeypatch, capsys, [str(run), str(tmp_path / "hf")])
    assert "tokenizer.json" in out and "tokenizer_config.json" in out
    ref = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert theirs.encode(TEXT, add_special_tokens=False) == ref.encode(TEXT, add_special_tokens=False).ids
    eod = ref.token_to_id("<eod>")
    assert theirs.eos_token == "<eod>" and theirs.eos_token_id == eod != ref.token_to_id("</s>")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == eod
    mask = os.umask(0o022)
    os.umask(mask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~mask}, modes
    # The tokenizer deleted after training: refused (exit 2, the fix named), or weights alone if asked.
    (tok_dir / "tokenizer.json").rename(tmp_path / "moved.json")
    res = run_cli([str(run), str(tmp_path / "hf2")], cwd=tmp_path, module="ntp_nemo.cli.export")
    assert res.returncode == 2 and "no longer exists" in res.stderr and "--no-tokenizer" in res.stderr
    assert "Traceback" not in res.stderr
    _export_in_process(monkeypatch, capsys, [str(run), str(tmp_path / "hf3"), "--no-tokenizer"])
    assert (tmp_path / "hf3" / "model.safetensors").is_file()
    assert not (tmp_path / "hf3" / "tokenizer.json").exists()


def test_byte_tokenizer_runs_export_no_tokenizer_and_say_why(tmp_path):
    from ntp_nemo.hf.export import RunTokenizer, write_tokenizer_files

    names, note = write_tokenizer_files(RunTokenizer("byte"), tmp_path)
    assert names == [] and list(tmp_path.iterdir()) == [] and "byte tokenizer" in note
