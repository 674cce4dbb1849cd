"""A newcomer's path through the real commands: a folder of .jsonl files and a tokenizer.json,
`ntp-preprocess`, then `ntp-train recipe=gpt_tiny data.path=... data.tokenizer=...` with no vocabulary
flags; and the data errors `ntp-train` must answer with exit 2 before any worker starts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ntp_nemo.data.tokens import TokenFileWriter
from ntp_nemo.goodput.calculator import compute_goodput, load_events
from tests.conftest import SINGLE, TINY, read_metrics, run_cli
from tests.data_helpers import corpus_documents, make_tokenizer_json, run_preprocess, write_jsonl

STEPS = 10


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    work = tmp_path_factory.mktemp("newcomer")
    tok = make_tokenizer_json(work / "my_tokenizer", 320)
    docs = corpus_documents(120_000)
    for i in range(3):
        write_jsonl(work / "corpus" / f"part{i}.jsonl", docs[i::3])
    res = run_preprocess("corpus", "--tokenizer", str(tok), "--out", "data/tokens.bin", "--workers", "2",
                         cwd=work)
    assert res.returncode == 0, res.stderr
    return work, tok, work / "data" / "tokens.bin"


@pytest.mark.slow
def test_preprocess_then_train_with_falling_loss(prepared):
    work, tok, tokens = prepared
    run_dir = work / "run"
    res = run_cli(["recipe=gpt_tiny", f"data.path={tokens}", f"data.tokenizer={tok}", *TINY, *SINGLE,
                   f"trainer.max_steps={STEPS}", "optim.lr=3e-3", f"hydra.run.dir={run_dir}"], cwd=work)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "320 ids -> 320 vocabulary rows" in res.stdout  # sized from the tokenizer, no flag given
    losses = [m["loss"] for m in read_metrics(run_dir) if "loss" in m]
    assert len(losses) == STEPS
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3, losses
    assert losses[0] == pytest.approx(np.log(320), abs=0.3)  # a uniform guess over the tokenizer's ids
    events = [json.loads(line) for line in (run_dir / "goodput.jsonl").read_text().splitlines()]
    waits = [e for e in events if e["event"] == "data_wait"]
    assert waits and all(e["seconds"] > 0 for e in waits)
    report = compute_goodput(load_events(run_dir / "goodput.jsonl"))
    assert report.badput_s["data_loading"] > 0


def _expect_exit_2(res, key: str, *fragments: str) -> None:
    assert res.returncode == 2, (key, res.stdout[-2000:], res.stderr[-3000:])
    assert "Traceback" not in res.stderr, res.stderr
    assert f"{key}:" in res.stderr, res.stderr
    for fragment in fragments:
        assert fragment in res.stderr, (fragment, res.stderr)


def test_data_errors_exit_2_before_any_worker(prepared):
    work, tok, tokens = prepared
    small = work / "small.bin"
    with TokenFileWriter(small, "byte", 257) as w:
        for _ in range(3):
            w.append(np.arange(60) % 256)
            w.end_document()
    base = ["recipe=gpt_tiny", *TINY, *SINGLE, "trainer.max_steps=2", f"hydra.run.dir={work / 'bad'}"]
    # One check before validation (the vocabulary) and one after the data is opened (too small); the
    # other data errors raise the same ConfigError in-process (test_data_vocab, test_data_blend).
    cases = [
        ([f"data.path={tokens}", "model.vocab_size=300"], "model.vocab_size", "320"),
        ([f"data.path={small}"], "data.global_batch_size", "fewer than one global batch"),
    ]
    for overrides, key, fragment in cases:
        res = run_cli([*base, *overrides], cwd=work, timeout=120)
        _expect_exit_2(res, key, fragment)
        assert not (work / "bad" / "metrics.jsonl").exists()
