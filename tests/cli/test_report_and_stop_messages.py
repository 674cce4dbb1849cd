"""Small truths: `ntp-goodput` without matplotlib still prints the numbers; `ntp-plan` breaks ties on J
with memory; a run that stopped without a checkpoint does not say "checkpoint saved"."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ntp_nemo.goodput import GOODPUT_FILENAME
from ntp_nemo.goodput import events as ev
from ntp_nemo.goodput.report import TIMELINE_PNG


def _goodput_run(tmp_path: Path) -> Path:
    lines = [{"t": 1.7e9, "event": ev.JOB_START}, {"t": 1.7e9 + 1, "event": ev.INIT_DONE}]
    for step in (1, 2):
        lines += [{"t": 1.7e9 + step, "event": ev.STEP_START, "step": step},
                  {"t": 1.7e9 + step + 1, "event": ev.STEP_END, "step": step, "layout": "tp2",
                   "capacity": 1.0, "tokens": 64}]
    lines.append({"t": 1.7e9 + 4, "event": ev.JOB_END, "status": "ok"})
    (tmp_path / GOODPUT_FILENAME).write_text("".join(json.dumps({"pid": 1, **e}) + "\n" for e in lines))
    return tmp_path


def test_ntp_goodput_without_matplotlib_prints_the_table_and_notes_the_png(tmp_path, monkeypatch, capsys):
    from ntp_nemo.cli import goodput as report

    run = _goodput_run(tmp_path)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setattr(sys, "argv", ["ntp-goodput", str(run)])
    with pytest.raises(SystemExit) as exc:
        report.main()
    out, err = capsys.readouterr()
    assert exc.value.code == 0, err
    assert "goodput" in out and "50.0" in out  # 2 productive seconds of 4
    assert f"{TIMELINE_PNG} not written" in err and "matplotlib" in err and "--no-plot" in err
    assert not (run / TIMELINE_PNG).exists()


def test_ntp_plan_ties_go_to_the_layout_with_less_memory(capsys):
    """Llama 3 8B over two stages: the second stage sets the step time whatever the embedding's degree,
    so the embedding is sharded (8) rather than kept whole (1) for the same modelled step."""
    from ntp_nemo.cli.plan import run

    assert run(["model=llama3_8b", "hardware=h100", "mesh.tp=8", "mesh.pp=2", "ntp.replica_tp=[8,8]",
                "format=json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layer_tp"][0] == 8


def test_ranking_orders_equal_step_times_by_memory():
    from ntp_nemo.planner import rank_layouts
    from ntp_nemo.planner.shapes import LinkModel, ModelShape

    llama = ModelShape(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                       ffn_hidden_size=14336, tie_embeddings=False)
    plans = rank_layouts(llama, 8, [8, 8], 8192, 1, LinkModel(), pp=2).plans
    tied = [p for p in plans if p.time_per_microbatch_s == plans[0].time_per_microbatch_s]
    assert len(tied) >= 2 and [p.layer_tp[0] for p in tied[:2]] == [8, 4]
    assert [max(p.memory_gb) for p in tied] == sorted(max(p.memory_gb) for p in tied)


def test_stop_without_a_checkpoint_does_not_say_saved(tmp_path, capsys):
    from ntp_nemo.cli.console import print_summary

    summary = {"steps": 5, "max_steps": 10, "stopped_early": "coordinator lost", "layout": "(2,1)"}
    print_summary(summary, tmp_path, checkpoint_dir=tmp_path / "checkpoints")
    out = capsys.readouterr().out
    assert "stopped early at step 5 of 10 (coordinator lost)" in out
    assert "checkpoint saved" not in out and "without a checkpoint (none was saved" in out
    (tmp_path / "checkpoints" / "step_000003").mkdir(parents=True)
    print_summary(summary, tmp_path, checkpoint_dir=tmp_path / "checkpoints")
    out = capsys.readouterr().out
    assert "checkpoint saved" not in out and "resumes from the latest, step_000003" in out
    (tmp_path / "checkpoints" / "step_000005").mkdir()
    print_summary({**summary, "stopped_early": "SIGINT"}, tmp_path, checkpoint_dir=tmp_path / "checkpoints")
    assert "(Ctrl-C); checkpoint saved (step_000005)" in capsys.readouterr().out


def test_a_recovery_of_unknown_mode_reads_recovered_in(tmp_path, capsys):
    """After a relaunch whose launcher died, the goodput record has no mode (`-`) for the recovery."""
    from ntp_nemo.cli.console import print_summary

    recoveries = [{"mode": "-", "recovery_s": 11.36}, {"mode": "live", "recovery_s": 2.5}]
    print_summary({"steps": 8, "max_steps": 8, "failover": {"failures": 2, "layouts": ["(2,1)"],
                                                            "recoveries": recoveries}}, tmp_path)
    out = capsys.readouterr().out
    assert "2 failure(s); recovered in 11.36 s; recovered live in 2.50 s; layouts (2,1)" in out


def test_ctrl_c_while_the_workers_fork_reaches_them_as_ctrl_c():
    """A Ctrl-C that reaches the launcher is passed on to its workers as SIGUSR2, the forwarded interrupt,
    whether they exist yet or not (pending until they do): they report an interrupt (exit 0), not the
    SIGTERM of a preemption (exit 78), also for `kill -INT` of the launcher alone; a worker that got the
    terminal's SIGINT itself does not count the forwarded one as a second Ctrl-C."""
    import os
    import signal

    from ntp_nemo.lightning.adapter import ForkLauncher
    from ntp_nemo.lightning.callbacks import PreemptionCheckpoint

    launcher = ForkLauncher.__new__(ForkLauncher)  # only its signal forwarding is exercised
    with launcher.forwarding_signals():
        os.kill(os.getpid(), signal.SIGINT)  # no worker forked yet
    assert launcher._pending_signal == signal.SIGUSR2 and launcher.stop_requested is not None

    class Worker:
        pid = os.getpid()

        @staticmethod
        def is_alive():
            return True

    got = []
    launcher = ForkLauncher.__new__(ForkLauncher)
    launcher._procs = [Worker()]
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: got.append(signum))
    try:
        with launcher.forwarding_signals():
            signal.signal(signal.SIGUSR2, lambda signum, frame: got.append(signum))  # the "worker"
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert got == [signal.SIGUSR2] and launcher._pending_signal is None

    for order in ([signal.SIGINT, signal.SIGUSR2], [signal.SIGUSR2, signal.SIGINT], [signal.SIGUSR2]):
        worker = PreemptionCheckpoint()  # its handler, called as the signals arrive (none kills it)
        for signum in order:
            worker._request(signum, None)
        assert worker.requested and worker.signal_name == "SIGINT", order
    worker = PreemptionCheckpoint()
    worker._request(signal.SIGTERM, None)
    assert worker.signal_name == "SIGTERM"  # a preemption stays one
