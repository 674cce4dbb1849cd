"""`ntp-eval`: a checkpoint's loss on a token file is the loss training recorded for the same weights
and the same batch (within 1e-5), whatever layout wrote the checkpoint; bad input exits 2."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import TINY, read_metrics, run_cli
from tests.data_helpers import corpus_documents

SEQ, BATCH = 32, 12  # TINY's data.seq_len and data.global_batch_size


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """2 steps of the default NTP layout ((2,1): 3 processes) on a token file whose training part holds
    exactly one global batch of windows, with a checkpoint after step 1."""
    root = tmp_path_factory.mktemp("eval")
    # 449 bytes + the end-of-document id = 450 tokens; val_fraction 0.1 keeps 405 for training:
    # (405 - 1) // 32 = 12 windows = the global batch, so every step's batch is all of them.
    (root / "doc.txt").write_bytes(" ".join(corpus_documents(5_000)).encode()[:449])
    proc = run_cli(["doc.txt", "--out", "tokens.bin", "--tokenizer", "byte", "--no-progress"], cwd=root,
                   module="ntp_nemo.data.preprocess")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((root / "tokens.bin.json").read_text())["num_tokens"] == 450
    proc = run_cli([*TINY, f"data.path={root / 'tokens.bin'}", "data.val_fraction=0.1", "trainer.max_steps=2",
                    "checkpoint.every_n_steps=1", f"hydra.run.dir={root / 'run'}"], cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def _eval(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    from ntp_nemo.cli import evaluate

    monkeypatch.setattr(sys, "argv", ["ntp-eval", *map(str, args)])
    with pytest.raises(SystemExit) as exc:
        evaluate.main()
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def test_eval_loss_equals_the_training_loss_of_the_same_weights_and_batch(trained, monkeypatch, capsys):
    recorded = read_metrics(trained / "run")
    assert recorded[1]["microbatches"] == [4, 2]  # trained sharded, over unequal replicas
    ckpt = trained / "run" / "checkpoints" / "step_000001"  # the weights step 2 trained from
    rc, out, err = _eval(monkeypatch, capsys, ckpt, trained / "tokens.bin", "--samples", BATCH, "--json")
    assert rc == 0, err
    got = json.loads(out)
    assert got["tokens"] == BATCH * SEQ == recorded[1]["tokens"] and got["seq_len"] == SEQ  # run's seq_len
    assert got["loss"] == pytest.approx(recorded[1]["loss"], rel=1e-5, abs=1e-5)
    assert got["perplexity"] == pytest.approx(2.718281828459045 ** recorded[1]["loss"], rel=1e-4)
    # The run directory means its latest valid checkpoint (step 2: other weights, a lower loss here).
    rc, out, err = _eval(monkeypatch, capsys, trained / "run", trained / "tokens.bin", "--samples", BATCH)
    assert rc == 0, err
    assert "step_000002" in out and "loss" in out and "perplexity" in out
    loss = float(next(line.split()[1] for line in out.splitlines() if line.startswith("loss")))
    assert loss < recorded[1]["loss"]


def test_eval_bad_input_exits_2(trained, monkeypatch, capsys):
    run = trained / "run"
    rc, _, err = _eval(monkeypatch, capsys, run, trained / "doc.txt")
    assert rc == 2 and "TOKENS:" in err and "sidecar" in err and "ntp-preprocess" in err
    rc, _, err = _eval(monkeypatch, capsys, run, trained / "tokens.bin", "--samples", 99)
    assert rc == 2 and "--samples:" in err and "14 windows" in err
    rc, _, err = _eval(monkeypatch, capsys, trained / "nowhere", trained / "tokens.bin")
    assert rc == 2 and "RUN_DIR_OR_CHECKPOINT" in err and "Traceback" not in err
