"""`ntp-preprocess` in a real subprocess: writes a usable token file; bad input exits 2, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from ntp_nemo.data.module import build_data
from ntp_nemo.data.tokens import open_token_file

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["NTP_NEMO_CACHE"] = str(cwd / "cache")
    return subprocess.run(
        [sys.executable, "-m", "ntp_nemo.data.preprocess", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )


def test_preprocess_writes_a_usable_token_file(tmp_path):
    (tmp_path / "a.txt").write_text("first document\n" * 40, encoding="utf-8")
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "b.txt").write_text("second — document\n" * 40, encoding="utf-8")
    res = _run("a.txt", "more", "--out", "out/tokens.bin", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    tf = open_token_file(tmp_path / "out" / "tokens.bin")
    expected = len(("first document\n" * 40).encode()) + len(("second — document\n" * 40).encode()) + 2
    assert tf.num_tokens == expected and tf.tokenizer == "byte" and tf.dtype == "uint16"
    assert f"wrote {expected} tokens" in res.stdout
    assert int(np.count_nonzero(np.asarray(tf.tokens) == 256)) == 2  # one end-of-document per file
    data = build_data(str(tmp_path / "out" / "tokens.bin"), "byte", 32, 2, 0, 0.2, model_vocab_size=257)
    assert data.source == str(tmp_path / "out" / "tokens.bin")


def test_missing_input_exits_2_without_traceback(tmp_path):
    res = _run("does-not-exist.txt", "--out", "t.bin", cwd=tmp_path)
    assert res.returncode == 2
    assert "does-not-exist.txt" in res.stderr and "INPUT" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "t.bin").exists()


def test_usage_errors_exit_2(tmp_path):
    (tmp_path / "a.txt").write_text("x" * 100)
    for args in ([], ["a.txt"], ["a.txt", "--out", "t.bin", "--tokenizer", "chars"]):
        res = _run(*args, cwd=tmp_path)
        assert res.returncode == 2, (args, res.stderr)
        assert "usage: ntp-preprocess" in res.stderr
