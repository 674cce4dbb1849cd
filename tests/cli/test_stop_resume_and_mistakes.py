"""A new user's first hour, through the real `ntp-train` CLI: stopping and resuming, config mistakes,
and the run directory left behind. Tiny models (TINY), one process unless the item needs more."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import ROOT, SINGLE, TINY, read_metrics, run_cli
from tests.waits import wait_until

CKPT_ON_END = ["checkpoint.save_on_end=true"]


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    """Like a terminal: the job in its own process group, so a Ctrl-C reaches every process of it."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "ntp_nemo.train", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _wait_for_steps(proc: subprocess.Popen, run: Path, n: int, timeout: float = 240) -> None:
    metrics = run / "metrics.jsonl"
    wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= n, timeout, f"{n} steps",
               poll_s=0.1, alive=lambda: proc.poll() is None, detail=lambda: proc.communicate()[0])


def test_ctrl_c_checkpoints_then_resume_has_no_duplicate_steps(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    args = [*TINY, *SINGLE, *CKPT_ON_END, f"hydra.run.dir={run}"]
    proc = _start([*args, "trainer.max_steps=400"], tmp_path)
    _wait_for_steps(proc, run, 2)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode == 0, out
    assert "interrupted (Ctrl-C): checkpointing at step" in out
    assert "| data embedded corpus (Python standard library)" in out  # what the user chose, not a cache file
    stopped = json.loads((run / "summary.json").read_text())
    step = stopped["steps"]
    assert stopped["stopped_early"] == "SIGINT" and 2 <= step < 400
    assert f"stopped early at step {step} of 400 (Ctrl-C); checkpoint saved" in out
    assert f"hydra.run.dir={run}" in out.split("to resume", 1)[1].splitlines()[0]
    assert (run / "checkpoints" / f"step_{step:06d}" / "manifest.json").is_file()
    record = (run / ".hydra" / "config.yaml").read_text()

    # Resuming with another model: refused before launch, the run's record kept.
    bad = run_cli([*args, "trainer.max_steps=400", "model.hidden_size=32"], tmp_path)
    assert bad.returncode == 2, bad.stderr
    assert "model.hidden_size=64 in the checkpoint vs 32 configured" in bad.stderr
    assert "Traceback" not in bad.stderr
    assert (run / ".hydra" / "config.yaml").read_text() == record

    # The rerun resumes at the checkpoint: one line per step, none twice.
    res = run_cli([*args, f"trainer.max_steps={step + 2}", "trainer.progress_bar=true"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert f"resuming from {run / 'checkpoints' / f'step_{step:06d}'}" in res.stdout
    assert [m["step"] for m in read_metrics(run)] == list(range(1, step + 3))
    assert "stopped early" not in res.stdout
    # Progress off a terminal: plain lines in steps of the run's total, never epochs.
    final = f"step {step + 2}/{step + 2} | loss "
    assert final in res.stdout and "tokens/s | ETA" in res.stdout
    assert "Epoch" not in res.stdout + res.stderr and "v_num" not in res.stdout + res.stderr
    # Goodput events as the real run writes them: every step's tokens (global batch x sequence).
    events = [json.loads(line) for line in (run / "goodput.jsonl").read_text().splitlines()]
    ends = [e for e in events if e["event"] == "step_end"]
    assert ends and all(e["tokens"] == 12 * 32 for e in ends)
    # The console, summary.json and ntp-goodput agree on the goodput (ntp-goodput and ntp-plan are
    # called in this process, as their console scripts call them).
    from ntp_nemo.cli import goodput as report
    from ntp_nemo.cli import plan

    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["ntp-goodput", str(run), "--json", "--no-plot"])
    with pytest.raises(SystemExit) as exc:
        report.main()
    out, err = capsys.readouterr()
    assert exc.value.code == 0, err
    goodput = json.loads(out)["goodput"]
    assert json.loads((run / "summary.json").read_text())["goodput"] == goodput
    assert f" goodput       {100 * goodput:.1f}%" in res.stdout
    # ntp-plan takes the run's own model, mesh and data shape.
    monkeypatch.setattr(sys, "argv", ["ntp-plan", f"run={run}", "hardware=h100"])
    with pytest.raises(SystemExit) as exc:
        plan.main()
    out, err = capsys.readouterr()
    assert exc.value.code == 0, err
    assert out.startswith("gpt_tiny: 2 layers, hidden 64, seq 32, micro-batch 2;"), out
    assert "replica_tp=[1]" in out and "\"layout.layer_tp='1,1*2,1'\"" in out
    # train.log holds what the console showed, for both invocations.
    log = (run / "train.log").read_text()
    assert final in log and "interrupted (Ctrl-C)" in log and log.count("ntp_nemo run summary") == 2


def test_metrics_file_restarts_with_the_run(tmp_path):
    """A start from scratch rewrites metrics.jsonl; a resume keeps the steps up to its checkpoint
    (lines as MetricsJSONL writes them, including a last one cut short by a crash)."""
    from ntp_nemo.lightning.callbacks import MetricsJSONL

    lines = [json.dumps({"step": s, "loss": 5.0 - s}) for s in (1, 2, 3, 4)] + ['{"step": 5, "lo']
    path = tmp_path / "metrics.jsonl"
    cb = MetricsJSONL(tmp_path)
    path.write_text("\n".join(lines))
    cb.on_train_start(SimpleNamespace(global_step=2, is_global_zero=True, callbacks=[cb]), None)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
    cb.on_train_start(SimpleNamespace(global_step=0, is_global_zero=True, callbacks=[cb]), None)
    assert path.read_text() == ""


def test_second_ctrl_c_stops_at_once(tmp_path):
    """A second Ctrl-C kills the workers mid-step: one line says what is abandoned, and the command still
    writes summary.json (where it stopped, why) and exits 130."""
    run = tmp_path / "run"
    # Step 3 takes 5 s longer (a straggler fault), so both Ctrl-Cs land inside it, each handled on its
    # own: the half second between them is a user's pace, the point of the test (two signals in quick
    # succession can coalesce into one).
    proc = _start([*TINY, *SINGLE, *CKPT_ON_END, "trainer.max_steps=400", "fault=slow", "fault.rank=0",
                   "fault.step=3", "fault.steps=1", "fault.seconds=5", f"hydra.run.dir={run}"], tmp_path)
    _wait_for_steps(proc, run, 2)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, out
    assert out.count("second Ctrl-C: the workers are stopped now; the step in progress and its checkpoint "
                     "are abandoned") == 1, out
    assert "Traceback" not in out and "stopped early at step 2 of 400 (second Ctrl-C)" in out, out
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["stopped_early"], summary["steps"], summary["exit_code"]) == ("second Ctrl-C", 2, 130)
    assert not list(run.glob("checkpoints/step_*"))  # step 3 and the stop's checkpoint are abandoned


def test_config_mistakes_exit_2_with_the_fix_and_leave_nothing_behind(tmp_path):
    run = tmp_path / "fresh"
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cases = {
        "+trainer.max_step=5": "Did you mean trainer.max_steps?",
        "trainer.max_stpes=5": "Did you mean trainer.max_steps?",
        "recipe=llama_tiny_from_hf": "recipe=llama_tiny_from_hf needs model.init_from",
        f"checkpoint.dir={blocker}/ckpt": f"checkpoint.dir: cannot write the run's files to {blocker}/ckpt",
        f"hydra.run.dir={blocker}/run": f"{blocker} is a file, not a directory",
        "data.global_batch_size=2": "The smallest global batch that gives every replica one is 4",
        "recipe=gpt_tiny_qat": "quantisation-aware training starts at step 100 but the run ends",
    }
    for override, message in cases.items():
        args = [*TINY, "mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,1]", "trainer.max_steps=5"]
        res = run_cli([*args, f"hydra.run.dir={run}", override], tmp_path)
        assert res.returncode == 2, (override, res.stderr)
        assert message in res.stderr, (override, res.stderr)
        assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert not run.exists(), override  # no empty run directory left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_recipe_checks_through_the_public_api(capsys):
    """Warnings that keep a short smoke run going (composed configs, the same checks ntp-train runs)."""
    from ntp_nemo.config import checks
    from ntp_nemo.config.resolve_layout import resolve_layout
    from tests.conftest import compose

    cfg = compose(["trainer.max_steps=4", "optim.warmup_steps=10"])
    assert checks.adjust(cfg) == {"optim.warmup_steps": 4}
    assert cfg.optim.warmup_steps == 10  # what is derived is returned; the composed config is not changed
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "warning: optim.warmup_steps=10 is longer than the run (trainer.max_steps=4); using warmup_steps=4."
    ]
    cfg = compose(["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=null", "ntp.power_boost=1.3"])
    checks.warn_no_ops(cfg, resolve_layout(cfg))
    assert "ntp.power_boost=1.3 has no effect" in capsys.readouterr().err
    assert ROOT.is_dir()


def test_power_boost_warning_compares_the_split_that_runs(capsys):
    """The default recipe's 6 micro-batches split [4, 2] with or without a 1.3 boost: the warning says
    so; at 12 micro-batches the boost moves one ([8, 4] -> [7, 5]) and nothing is said."""
    from ntp_nemo.config import checks
    from ntp_nemo.config.resolve_layout import resolve_layout
    from tests.conftest import compose

    cfg = compose(["ntp.power_boost=1.3"])
    checks.warn_no_ops(cfg, resolve_layout(cfg))
    err = capsys.readouterr().err
    assert "ntp.power_boost=1.3 has no effect" in err and "[4, 2] with or without it" in err
    assert resolve_layout(cfg).microbatches == resolve_layout(compose([])).microbatches == (4, 2)
    cfg = compose(["ntp.power_boost=1.3", "data.global_batch_size=24"])
    checks.warn_no_ops(cfg, resolve_layout(cfg))
    assert capsys.readouterr().err == ""
    assert resolve_layout(cfg).microbatches == (7, 5)
    assert resolve_layout(compose(["data.global_batch_size=24"])).microbatches == (8, 4)


def test_readme_power_boost_example_changes_the_split():
    """The README's NTP-PW command runs another split than the same command without the boost."""
    from ntp_nemo.config.resolve_layout import resolve_layout
    from tests.conftest import compose

    line = next(x for x in (ROOT / "README.md").read_text().splitlines() if "ntp-train ntp.power_boost" in x)
    args = line.split("#")[0].split()[1:]
    plain = [a for a in args if not a.startswith("ntp.power_boost=")]
    assert resolve_layout(compose(args)).microbatches != resolve_layout(compose(plain)).microbatches


def test_coarse_batch_split_is_reported(capsys):
    """2 micro-batches over capacities [1, 0.5] run as [1, 1]: a warning names the split and a global
    batch that follows the capacities; a split that follows them says nothing."""
    from ntp_nemo.config import checks
    from ntp_nemo.config.resolve_layout import resolve_layout
    from tests.conftest import compose

    def split(overrides):
        cfg = compose(overrides)
        return checks.check_batch_split(resolve_layout(cfg), int(cfg.data.micro_batch_size))

    assert split(["data.global_batch_size=4"]) == [1, 1]
    err = capsys.readouterr().err
    assert "data.global_batch_size=4 is 2 micro-batches of 2" in err and "the split is [1, 1]" in err
    assert "data.global_batch_size=6" in err and "([2, 1])" in err
    assert split(["data.global_batch_size=6"]) == [2, 1]
    assert split([]) == [4, 2]
    assert capsys.readouterr().err == ""


def test_help_lists_recipes_groups_and_examples(tmp_path):
    res = run_cli(["--help"], tmp_path)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    recipes = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
    listed = out.split("recipes", 1)[1].split("main config groups", 1)[0]
    assert [line.split()[0] for line in listed.strip().splitlines()[1:]] == recipes
    for group in ("model", "mesh", "ntp", "data", "optim", "trainer", "checkpoint"):
        assert f"\n  {group} " in out
    assert out.split("examples:", 1)[1].count("ntp-train ") == 3
    assert "hardware" not in out and "Config groups" not in out  # not Hydra's list of every group
