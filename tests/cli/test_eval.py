"""`ntp-eval`: a checkpoint's loss on a token file is the loss training recorded for the same weights
and the same batch (within 1e-5), whatever layout wrote the checkpoint; bad input exits 2. The same run
carries a user callback, to show what the README says of callbacks: one runs in every process, and
`trainer.is_global_zero` / `rank_zero_only` act once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, TINY, read_metrics
from tests.data_helpers import corpus_documents

SEQ, BATCH = 32, 12  # TINY's data.seq_len and data.global_batch_size
VAL = 4 * 2  # the windows the logged validation loss covers: data.val_batches x TINY's micro_batch_size


def probe(out: str):
    """A user callback (`+callbacks.probe._target_=tests.cli.test_eval.probe`), written as the
    README shows: a line from every process, and lines from rank 0 only."""
    from lightning.pytorch import Callback
    from lightning.pytorch.utilities import rank_zero_only

    class Probe(Callback):
        def on_train_end(self, trainer, pl_module):
            with open(Path(out) / "every_process.txt", "a") as fh:
                fh.write(f"{trainer.global_rank}\n")
            if trainer.is_global_zero:
                with open(Path(out) / "global_zero.txt", "a") as fh:
                    fh.write(f"{trainer.global_rank}\n")
            self.once(trainer)

        @rank_zero_only
        def once(self, trainer):
            with open(Path(out) / "rank_zero_only.txt", "a") as fh:
                fh.write(f"{trainer.global_rank}\n")

    return Probe()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """2 steps of the default NTP layout ((2,1): 3 processes) on a token file whose training part holds
    exactly one global batch of windows, with a checkpoint after step 1."""
    root = tmp_path_factory.mktemp("eval")
    # 384 bytes + the end-of-document id = 385 tokens: (385 - 1) // 32 = 12 windows = the global batch,
    # so every step's batch is all of them. Validation reads its own file (data.val_path): 8 windows.
    text = " ".join(corpus_documents(5_000)).encode()
    (root / "doc.txt").write_bytes(text[:384])
    (root / "val.txt").write_bytes(text[1000:1000 + VAL * SEQ])
    from ntp_nemo.cli.preprocess import run as preprocess

    for text_file, out in (("doc.txt", "tokens.bin"), ("val.txt", "val.bin")):
        assert preprocess([str(root / text_file), "--out", str(root / out), "--tokenizer", "byte",
                           "--no-progress"]) == 0
    assert json.loads((root / "tokens.bin.json").read_text())["num_tokens"] == 385
    args = [*TINY, f"data.path={root / 'tokens.bin'}", f"data.val_path={root / 'val.bin'}",
            "trainer.max_steps=2",
            "checkpoint.every_n_steps=1", f"hydra.run.dir={root / 'run'}",
            "+callbacks.probe._target_=tests.cli.test_eval.probe", f"+callbacks.probe.out={root}"]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-m", "ntp_nemo.train", *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def test_a_callback_runs_in_every_process_and_rank_zero_guards_act_once(trained):
    assert sorted((trained / "every_process.txt").read_text().split()) == ["0", "1", "2"]  # 3 processes
    assert (trained / "global_zero.txt").read_text().split() == ["0"]
    assert (trained / "rank_zero_only.txt").read_text().split() == ["0"]


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


def test_eval_gives_the_logged_validation_loss(trained, monkeypatch, capsys):
    """README: `ntp-eval RUN VAL.bin --samples <data.val_batches x data.micro_batch_size>` is the run's
    logged validation loss (the final validation, after the last step) when it trained with
    data.val_path=VAL.bin."""
    summary = json.loads((trained / "run" / "summary.json").read_text())
    val = trained / "val.bin"
    rc, out, err = _eval(monkeypatch, capsys, trained / "run", val, "--samples", VAL, "--json")
    assert rc == 0, err
    assert json.loads(out)["loss"] == pytest.approx(summary["val_loss"], rel=1e-5, abs=1e-5)


def test_eval_bad_input_exits_2(trained, monkeypatch, capsys):
    run = trained / "run"
    rc, _, err = _eval(monkeypatch, capsys, run, trained / "doc.txt")
    assert rc == 2 and "TOKENS:" in err and "sidecar" in err and "ntp-preprocess" in err
    rc, _, err = _eval(monkeypatch, capsys, run, trained / "tokens.bin", "--samples", 99)
    assert rc == 2 and "--samples:" in err and "12 windows" in err
    rc, _, err = _eval(monkeypatch, capsys, trained / "nowhere", trained / "tokens.bin")
    assert rc == 2 and "RUN_DIR_OR_CHECKPOINT" in err and "Traceback" not in err
