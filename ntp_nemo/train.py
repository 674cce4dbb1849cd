"""The training pipeline of `ntp-train` (`train`: resolve -> data -> supervisor -> report) and what it
reports: the summary, the exit code of how training ended (`stop_exit`), the checkpoint to resume from.
The command around it (argument checks, the Hydra job, Ctrl-C, exit codes) is `ntp_nemo/cli/train.py`;
`python -m ntp_nemo.train` runs that command.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ntp_nemo.cli.console import (
    invocation_stats,
    job_started_at,
    launcher_rank,
    logger_dirs,
    print_summary,
    process_start_time,
    quiet_libraries,
    say,
)
from ntp_nemo.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME, EXIT_STOPPED, ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from ntp_nemo.config.resolve import RunSpec

ABANDONED = "second Ctrl-C"  # summary.json's `stopped_early` when a second Ctrl-C killed the workers

# Module level imports stay light (the command imports this module before Hydra): heavy ones are made
# inside the functions, Lightning once the config is valid, before the workers are forked.


def train(cfg: DictConfig, start_t: float | None = None, console=None) -> dict:
    """resolve -> data -> supervisor (or this worker, under torchrun/SLURM) -> report; returns the run
    summary.  `start_t`: when the job started; `console`: the `ConsoleLog` copying this process's
    console to the run's train.log, if any."""
    from hydra.core.hydra_config import HydraConfig

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if cfg.trainer.get("dry_run"):  # validates by itself, reads no data, starts no worker
        from ntp_nemo.dry_run_report import run_dry

        # Under torchrun/SLURM every process gets here: global rank 0 alone runs it and writes the file.
        return run_dry(cfg, run_dir, say, _explicit()) if launcher_rank() == 0 else {}
    spec, ckpt_path = _resolve(cfg, run_dir)  # every check before anything starts: exit 2 on bad input
    if spec.model.init_from:
        say(f"model weights: initialised from {spec.model.init_from} (model.init_from)", flush=True)
    link = _cluster_link(spec)  # an srun task under ntp-coordinator: its place before anything else
    rejoining = link is not None and link.mode == "rejoin"
    if rejoining:  # a replacement (its own srun step's task 0): the run's log and record are rank 0's
        _leave_run_log(console)
    quiet_libraries()
    data = _data(spec)
    supervisor, first = _supervisor(spec, run_dir, data, link, rejoining)
    _describe(spec, data)
    done = _already_complete(spec, run_dir, ckpt_path)
    if done is not None:
        return done
    # "resuming from ..." is said by the strategy once the checkpoint's data has passed its check.
    if launcher_rank() == 0 and not rejoining:
        from ntp_nemo.goodput import GoodputRecorder

        GoodputRecorder(run_dir).record("job_start", layout=spec.layout.describe())
    t0 = time.time()
    result = _fit(supervisor, first, ckpt_path, run_dir / spec.checkpoint.dir if str(cfg.resume) == "auto"
                  else None)
    with _LateStops():  # training is over: a stop signal now changes nothing (the report finishes)
        summary, code = _finish(spec, run_dir, result, first[0], rejoining, t0,
                                process_start_time() if start_t is None else start_t)
    if code:
        sys.exit(code)
    return summary


def _supervisor(spec: RunSpec, run_dir: Path, data, link, rejoining: bool):  # noqa: ANN001
    """The run's `Supervisor` (it builds each attempt's trainer with `build_trainer`) and its first
    attempt's (trainer, module, strategy). Imports Lightning."""
    from ntp_nemo.lightning.factory import build_trainer
    from ntp_nemo.resilience.supervisor import Supervisor

    supervisor = Supervisor(
        spec.failover,
        spec.layout,
        run_dir,
        lambda lay, extra, devices, stop_at: build_trainer(
            spec, run_dir, data, lay, extra, devices, stop_at,
            job_started=launcher_rank() == 0 and not rejoining,  # recorded in `train`, before supervisor.run
        ),
        link=link,
    )
    return supervisor, supervisor.build_first()


def _already_complete(spec: RunSpec, run_dir: Path, ckpt_path: Path | None) -> dict | None:
    """The summary of a run whose checkpoint to resume from is at trainer.max_steps already (said on the
    console: nothing to do), else None."""
    done_step = _checkpoint_step(ckpt_path) if ckpt_path is not None else -1
    if done_step < spec.trainer.max_steps:
        return None
    say(
        f"run in {run_dir} is already complete: checkpoint {ckpt_path.name} is at step "
        f"{done_step} >= trainer.max_steps={spec.trainer.max_steps}; nothing to do. "
        "Raise trainer.max_steps to continue, or pass resume=never / a new hydra.run.dir to start "
        "over."
    )
    return {"already_complete": True, "checkpoint": str(ckpt_path)}


def _fit(supervisor, first, ckpt_path: Path | None, auto_dir: Path | None):  # noqa: ANN001
    """`supervisor.run`, its errors said as the user's: what could not be recovered (exit 1, its message),
    a checkpoint the workers found corrupt (exit 2, naming it), a checkpoint that could not be written
    (exit 1, the saver's line). `auto_dir`: the directory `resume=auto` chose the checkpoint from."""
    from ntp_nemo.resilience.supervisor import FailoverError

    supervisor.initial_resume = ckpt_path
    try:
        return supervisor.run(first, ckpt_path)
    except FailoverError as err:  # what could not be recovered, and why: its message, not a traceback
        _raise_if_found_corrupt(ckpt_path, auto_dir)
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(EXIT_RUNTIME)
    except ConfigError:  # bad data found on the way (no usable checkpoint at a relaunch): its own message
        raise
    except Exception as exc:
        _raise_if_found_corrupt(ckpt_path, auto_dir)
        _exit_if_save_failed(exc)
        raise


def _finish(spec: RunSpec, run_dir: Path, result, trainer, rejoining: bool, t0: float,  # noqa: ANN001
            start_t: float) -> tuple[dict, int]:
    """After training: (summary, exit code). Global rank 0 writes and prints summary.json (`_report`);
    another rank only takes the exit code of how training ended."""
    if launcher_rank() != 0:  # summary.json has one writer, global rank 0, which also reads and prints it
        # A cluster task whose coordinator died: the batch script sees why (76). Otherwise rank 0's
        # decision, from this rank's own trainer (the same stop flag, agreed by every rank).
        return {}, result.exit_code or stop_exit(trainer_stop(trainer), run_dir / spec.checkpoint.dir)[0]
    # A process 0 that rejoined a running job reports the whole job's steps, not its own share.
    since = (job_started_at(run_dir) or t0) if rejoining else t0
    summary, code, note = _report(spec, run_dir, since, result, start_t)
    if note is not None:
        print(note, file=sys.stderr if code != EXIT_STOPPED else sys.stdout, flush=True)
    return summary, code


class _LateStops:
    """From the end of training to the end of its report: SIGTERM/SIGUSR1 (a scheduler's stop arriving
    after the workers exited) are noted, not obeyed, so the summary is written and the exit code says how
    training ended (0 when it reached trainer.max_steps). The previous handlers come back at the end; in a
    sweep (`-m`) a noted signal is then delivered to them, as it would have been (the sweep stops)."""

    NAMES = ("SIGTERM", "SIGUSR1")

    def __init__(self) -> None:
        self.previous: dict[int, Any] = {}
        self.noted: list[int] = []

    def __enter__(self) -> _LateStops:
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():  # only the main thread has handlers
            return self
        for name in self.NAMES:
            self.previous[getattr(signal, name)] = signal.signal(getattr(signal, name), self._note)
        return self

    def _note(self, signum, frame) -> None:  # noqa: ANN001 - signal handler signature
        self.noted.append(signum)

    def __exit__(self, *exc: object) -> None:
        import os
        import signal

        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.noted and in_sweep():
            os.kill(os.getpid(), self.noted[0])


def in_sweep() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def trainer_stop(trainer) -> dict:
    """How this rank's training ended, as summary.json says it (`steps`, `max_steps`, `stopped_early`
    when a stop signal ended it before trainer.max_steps): for the ranks that write no summary.json."""
    from ntp_nemo.lightning.callbacks import PreemptionCheckpoint

    stop = next((cb for cb in trainer.callbacks if isinstance(cb, PreemptionCheckpoint)), None)
    out: dict = {"steps": int(trainer.global_step), "max_steps": int(trainer.max_steps)}
    if stop is not None and stop.stopped and out["steps"] < out["max_steps"]:
        out["stopped_early"] = stop.signal_name or "signal"
    return out


def stop_exit(summary: dict, checkpoint_dir: Path) -> tuple[int, str | None]:
    """The exit code of a run whose training ended without an error, and the line that explains a
    non-zero one, from what its summary says (`stopped_early`, `steps`, `max_steps`):

    - EXIT_OK: it trained to trainer.max_steps (a signal after the last step changes nothing), or a
      Ctrl-C stopped it (SIGINT: the user at the terminal asked for the stop and sees the summary);
    - EXIT_STOPPED (78): a preemption or time-limit signal (SIGTERM, SIGUSR1) stopped it before, and the
      checkpoint of the step it stopped at is valid (the same command continues from it);
    - EXIT_RUNTIME (1): such a stop saved no checkpoint of that step (checkpointing off, or the job's
      store gone): a rerun would not continue from where it stopped, so it is not reported as 78."""
    why = summary.get("stopped_early")
    step, end = summary.get("steps"), summary.get("max_steps")
    if not why or why == "SIGINT" or (isinstance(step, int) and isinstance(end, int) and step >= end):
        return EXIT_OK, None
    from ntp_nemo.checkpoint.manifest import checkpoint_name, checkpoint_problem, readable_checkpoints

    checkpoint_dir = Path(checkpoint_dir)
    if isinstance(step, int):
        name = checkpoint_name(step)
        problem = checkpoint_problem(checkpoint_dir / name)
        if problem is None:
            return EXIT_STOPPED, (f"stopped by {why} at step {step} of trainer.max_steps={end} with "
                                  f"checkpoint {name} saved: exit {EXIT_STOPPED} (not trained yet; the same "
                                  "command continues from it)")
        what = f"{name}: {problem}"
    else:
        what = "the step it stopped at is not known"
    kept = readable_checkpoints(checkpoint_dir) if checkpoint_dir.is_dir() else []
    rerun = (f"a rerun with resume=auto continues from {kept[0].name}" if kept
             else "a rerun starts over")
    return EXIT_RUNTIME, (f"error: stopped by {why} at step {step} of trainer.max_steps={end}, and no "
                          f"checkpoint was saved ({what}); {rerun}")


def _leave_run_log(console) -> None:
    import logging

    if console is not None:
        console.close()
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
        root.removeHandler(handler)
        handler.close()


def _cluster_link(spec: RunSpec):
    """The link to ntp-coordinator of an srun task started with `NTP_COORDINATOR` set (None otherwise):
    the coordinator hosts the job's store and gives this task its place (resilience/cluster_task.py)."""
    from ntp_nemo.resilience.cluster_protocol import COORDINATOR_ENV, coordinator_address

    if coordinator_address() is None:
        return None
    from ntp_nemo.launch.node_layout import launcher_layout
    from ntp_nemo.resilience.fault_config import recovery_mode

    proc = launcher_layout()
    if proc is None or proc.launcher != "slurm":
        raise ConfigError(COORDINATOR_ENV, "is set, but this process is not an srun task: a job with "
                          "ntp-coordinator starts its ranks as `srun --kill-on-bad-exit=0 python -m "
                          "ntp_nemo.train ...` (one task per GPU); unset it otherwise.")
    mode, why = recovery_mode(spec.failover, proc.launcher, coordinator=True)
    if mode != "live":
        raise ConfigError(COORDINATOR_ENV, f"is set, but recovery resolves to {mode} ({why}): the "
                          "coordinator serves live recovery only. Start the tasks without NTP_COORDINATOR "
                          "(and without ntp-coordinator: rank 0 hosts the store at MASTER_PORT), or make "
                          "live recovery possible.")
    from ntp_nemo.resilience.cluster_task import LinkCut, LinkRefused, open_link
    from ntp_nemo.resilience.coordinator import FALLBACK_EXIT

    try:
        link = open_link(proc.global_rank, proc.world_size, float(spec.failover.fault.heartbeat_timeout_s),
                         warm=lambda: _warm_spare(spec))
    except LinkRefused as err:
        raise ConfigError(COORDINATOR_ENV, f"{err}.") from None
    except LinkCut as err:  # load on the coordinator's link, not a mistake in the config: requeued
        print(f"error: {err}; exit {FALLBACK_EXIT} (the batch script requeues the job)", file=sys.stderr,
              flush=True)
        sys.exit(FALLBACK_EXIT)
    what = "rejoins as" if link.mode == "rejoin" else "trains as"
    print(f"coordinator {link.where}: this task ({proc.launcher} task {proc.global_rank}) {what} process "
          f"{link.place} of {link.world}", flush=True)
    return link


def _warm_spare(spec: RunSpec) -> None:
    """A cluster spare's warm-up while it waits for a place: torch as a CPU rank and the model on meta
    (no CUDA call before the task has its place)."""
    from ntp_nemo.resilience.spares import warm_torch_and_model

    world = spec.layout.world_size if spec.failover.accelerator == "cpu" else 1
    warm_torch_and_model(spec.model, "cpu", world)


def check_config(cfg: DictConfig, explicit: set[str]) -> RunSpec:
    """Every check of a composed config that needs no run directory (a sweep runs it for each job
    before the first starts); `explicit`: the keys set on the command line. Returns the run's `RunSpec`
    (`resolve`: `cfg` itself is not changed); raises ConfigError."""
    from ntp_nemo.config.resolve import resolve
    from ntp_nemo.config.targets import check_targets
    from ntp_nemo.config.validate import check_environment
    from ntp_nemo.resilience.fault_config import validate_fault_config

    spec = resolve(cfg, explicit)  # before any heavy import: a bad value answers in well under a second
    validate_fault_config(spec.failover)  # the `fault` group too (no torch, no Lightning)
    check_environment(cfg)
    check_targets(cfg)  # imports the callbacks' and loggers' modules: last, before any data is read
    return spec


def _explicit() -> set[str]:
    """The keys this command set on its command line (a sweep job's own)."""
    from hydra.core.hydra_config import HydraConfig

    from ntp_nemo.config.data_keys import explicit_keys

    return explicit_keys(HydraConfig.get().overrides.task if HydraConfig.initialized() else [])


def _resolve(cfg: DictConfig, run_dir: Path) -> tuple[RunSpec, Path | None]:
    """Check the config, resolve it into the run's RunSpec (once) and find the checkpoint to resume
    from; records the config in the run directory once it is valid."""
    from ntp_nemo.config import checks

    spec = check_config(cfg, _explicit())
    from ntp_nemo.launch.node_layout import slurm_batch_without_srun

    if slurm_batch_without_srun():
        say(f"note: a SLURM batch script without srun (SLURM_NTASKS={os.environ['SLURM_NTASKS']} is the "
            "allocation's, not a launch): ntp-train launches the layout's ranks on this node", flush=True)
    checks.check_outputs(cfg, run_dir)
    ckpt_path = resolve_resume(cfg, run_dir)
    if ckpt_path is None and str(cfg.resume) == "auto":
        from ntp_nemo.config.run_dir import nothing_saved_note

        note = nothing_saved_note(run_dir, run_dir / str(cfg.checkpoint.dir))
        if note:
            say(note, flush=True)
    if ckpt_path is not None:
        checks.check_resume_model(spec.model, ckpt_path)
    run_dir.mkdir(parents=True, exist_ok=True)
    if launcher_rank() == 0:
        from ntp_nemo.config.run_dir import save_record

        note = save_record(spec, run_dir)  # only now: a command that fails validation keeps the old record
        if note:
            say(note, flush=True)
    return spec, ckpt_path


def _data(spec: RunSpec):
    """The run's data (tokenised once, in the launching process; the workers inherit it)."""
    from ntp_nemo.data.prepare import build_data

    d = spec.data
    data = build_data(d.path, d.tokenizer, d.seq_len, d.global_batch_size, spec.seed, d.val_fraction,
                      spec.model.vocab_size, blend=d.blend, val_path=d.val_path, eos_token=d.eos_token)
    if spec.quant.format != "none":
        from ntp_nemo.quant.modules import register_tp_layers

        register_tp_layers()  # import modelopt once, before the workers are forked
    return data


def _describe(spec: RunSpec, data) -> None:
    """The run's opening lines: model, data, the rank table and the batch split."""
    from ntp_nemo.models import flops_per_token, param_count
    from ntp_nemo.models.families import family_of

    m, layout = spec.model, spec.layout
    say(
        f"ntp_nemo | recipe {spec.recipe} | model {m.name} ({family_of(m).name}) "
        f"{param_count(m) / 1e6:.2f}M params, "
        f"{flops_per_token(m, spec.data.seq_len) / 1e6:.1f} MFLOP/token | data "
        f"{spec.data.path or 'embedded corpus (Python standard library)'} "
        f"[tokenizer {data.tokenizer_name}, {data.vocab_size} ids -> {m.vocab_size} vocabulary rows] "
        f"({data.num_tokens} tokens: {len(data.train)} train / {len(data.val)} val samples)",
        flush=True,
    )
    say(layout.table(m.num_heads, m.ffn_hidden_size, m.vocab_size), flush=True)
    say(
        f"layer degrees (embedding, layers..., head): {list(layout.layer_tp)}; micro-batches per replica per "
        f"step: {list(layout.microbatches)}",
        flush=True,
    )
    if spec.trainer.compile:
        say("trainer.compile=true: the first step compiles each transformer block (torch.compile) and takes "
            "much longer than the others (minutes on a CPU; fault.startup_timeout_s bounds it)", flush=True)


def _report(spec: RunSpec, run_dir: Path, t0: float, result, start_t: float) -> tuple[dict, int, str | None]:
    """summary.json completed with this command's numbers (every attempt) and the code the command
    exits with (`exit_code`), printed as the summary; returns (summary, exit code, the line that
    explains it, if any)."""
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if result.abandoned:  # the workers were killed before writing theirs: this command's own numbers
        summary = _abandoned_summary(summary_path, t0, spec)
    summary["wall_s"] = time.time() - t0
    summary["processes"] = spec.layout.world_size  # the processes the run was launched with
    summary.update(invocation_stats(run_dir, t0))  # every attempt of this command, not the last one's
    last_end = summary.pop("last_step_end", None)
    if summary.get("first_step_start") is not None:
        # From the first step to the last, whichever processes trained them: the rank 0 that wrote
        # train_wall_s may have joined late (process 0 lost and repaired) and timed its share only.
        summary["train_wall_s"] = max(float(summary.get("train_wall_s") or 0.0),
                                      last_end - summary["first_step_start"])
        startup = summary.pop("first_step_start") - start_t
        if startup >= 0:  # not for a process that joined after the first step
            summary["startup_s"] = startup
    if (run_dir / "goodput.jsonl").exists():
        from ntp_nemo.goodput.report import analyse

        report, _ = analyse(run_dir, plot=False)  # the numbers `ntp-goodput RUN_DIR` prints
        summary["goodput"], summary["capacity_fraction"] = report.goodput, report.capacity_fraction
        recoveries = report.failure_recoveries  # each failure's mode (live | restart) and downtime
    else:
        recoveries = []
    short = int(summary.get("steps") or 0) < int(spec.trainer.max_steps)
    if result.stopped and short and not summary.get("stopped_early"):
        # The stop signal reached the workers after their last step of an attempt on a degraded layout
        # (its repair stop, checkpointed): the run stops there, short of trainer.max_steps.
        summary["stopped_early"] = "stop signal"
    # The code the command exits with: a cluster task's (its coordinator died), else how training ended.
    code, note = ((result.exit_code, None) if result.exit_code
                  else (EXIT_INTERRUPTED, None) if result.abandoned
                  else stop_exit(summary, run_dir / spec.checkpoint.dir))
    summary["exit_code"] = code
    tmp = summary_path.with_name(summary_path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, summary_path)
    if result.failures or recoveries:
        attempts = result.summary()
        summary["failover"] = {**attempts, "failures": max(result.failures, len(recoveries)),
                               "layouts": summary.get("layouts") or attempts["layouts"],
                               "recoveries": recoveries}
    print_summary(summary, run_dir, logger_dirs(spec.loggers), run_dir / spec.checkpoint.dir)
    return summary, code, note


def _abandoned_summary(summary_path: Path, t0: float, spec: RunSpec) -> dict:
    """The summary of a run a second Ctrl-C ended: its workers were killed mid-step, so the summary.json
    of their rank 0 is missing (or one this command did not write: left out). `steps`: the last step
    metrics.jsonl holds (the step in progress is abandoned); `stopped_early`: ABANDONED."""
    try:
        summary = json.loads(summary_path.read_text()) if summary_path.stat().st_mtime >= t0 else {}
    except (OSError, ValueError):
        summary = {}
    steps = summary.get("steps")
    metrics = summary_path.with_name("metrics.jsonl")
    if not isinstance(steps, int) and metrics.exists():
        for line in reversed(metrics.read_text(errors="replace").splitlines()):
            try:
                steps = int(json.loads(line)["step"])
                break
            except (ValueError, KeyError, TypeError):
                continue
    return {"layout": spec.layout.describe(), **summary, "steps": steps if isinstance(steps, int) else 0,
            "max_steps": int(spec.trainer.max_steps), "stopped_early": ABANDONED}


def resolve_resume(cfg: DictConfig, run_dir: Path) -> Path | None:
    """`resume=auto`: latest valid checkpoint of this run (partial/corrupt ones skipped with a warning);
    `never`: none; a path: that checkpoint, checked before any worker starts."""
    from ntp_nemo.checkpoint.manifest import latest_valid_checkpoint, require_valid_checkpoint

    mode = str(cfg.resume)
    if mode == "never":
        return None
    if mode == "auto":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = latest_valid_checkpoint(run_dir / cfg.checkpoint.dir)
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr, flush=True)
        gone = vanished_checkpoint(run_dir, run_dir / cfg.checkpoint.dir, found)
        if gone is not None:
            print(f"warning: {gone}", file=sys.stderr, flush=True)
        return found
    return require_valid_checkpoint(Path(mode).expanduser(), key="resume")


def vanished_checkpoint(run_dir: Path, checkpoint_dir: Path, found: Path | None) -> str | None:
    """A line when the newest checkpoint this run committed (its goodput.jsonl says so) is no longer on
    disk and resume=auto takes an older one (or none): steps are trained again, say which."""
    from ntp_nemo.checkpoint.manifest import checkpoint_name
    from ntp_nemo.goodput import GOODPUT_FILENAME

    saved, commits = set(), {}
    try:
        with open(run_dir / GOODPUT_FILENAME, encoding="utf-8") as fh:
            for line in fh:
                if '"ckpt_' not in line:
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("event") == "ckpt_save_end" and isinstance(event.get("step"), int):
                    saved.add(event["step"])
                elif event.get("event") == "ckpt_commit" and isinstance(event.get("step"), int):
                    commits[event["step"]] = bool(event.get("ok"))
    except OSError:
        return None
    # Asynchronous saves commit in the background (`ckpt_commit`); synchronous ones are done at save_end.
    committed = {s for s, ok in commits.items() if ok} if commits else saved
    newest = max(committed, default=None)
    name = found.name if found is not None else ""
    have = int(name.removeprefix("step_")) if name.startswith("step_") else 0
    if newest is None or newest <= have or (checkpoint_dir / checkpoint_name(newest)).exists():
        return None
    instead = f"resuming from {found.name}" if found is not None else "no checkpoint is left: starting over"
    return (f"checkpoint {checkpoint_name(newest)}, which this run saved ({GOODPUT_FILENAME}), is no longer "
            f"in {checkpoint_dir}; {instead}, so steps {have + 1} to {newest} are trained again")


def _raise_if_found_corrupt(ckpt_path: Path | None, auto_dir: Path | None = None) -> None:
    """The workers verify the data while loading (the check before launch reads only metadata); when
    they found a bad file in the checkpoint to resume from and had nothing to fall back to, they marked
    it corrupt: answer like any bad resume path (exit 2, naming the file), not with their traceback.
    `auto_dir`: the checkpoint directory `resume=auto` chose from; then every checkpoint in it is
    unusable, and the answer says so of each, as `resume=auto` does when the launcher's check finds it."""
    from ntp_nemo.checkpoint.manifest import (
        CORRUPT_MARKER,
        NoUsableCheckpointError,
        checkpoint_problem,
        invalid_checkpoint_error,
        latest_valid_checkpoint,
    )

    if ckpt_path is None or not (Path(ckpt_path) / CORRUPT_MARKER).is_file():
        return
    if auto_dir is not None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                latest_valid_checkpoint(auto_dir)
        except NoUsableCheckpointError as err:
            raise NoUsableCheckpointError(
                "resume", auto_dir, err.damaged,
                stopped=f"The workers found the damage in {Path(ckpt_path).name} while loading it, before "
                        "training a step") from None
    raise invalid_checkpoint_error(ckpt_path, checkpoint_problem(ckpt_path), "resume") from None


def _exit_if_save_failed(exc: BaseException) -> None:
    """A checkpoint that could not be written (a full disk, a quota): the saver's one line (what failed,
    which complete checkpoints survive) and exit 1, not a worker's traceback."""
    import re

    from ntp_nemo.checkpoint import CheckpointWriteError

    for _ in range(8):  # the error itself, a worker's (its text), or one it was raised from
        if exc is None:
            return
        found = re.search(r"CheckpointWriteError: (.+)", str(exc))
        if isinstance(exc, CheckpointWriteError) or found is not None:
            print(f"error: {exc if found is None else found.group(1)}", file=sys.stderr, flush=True)
            sys.exit(EXIT_RUNTIME)
        exc = exc.__cause__ or exc.__context__


def _checkpoint_step(path: Path) -> int:
    from ntp_nemo.checkpoint.manifest import read_manifest

    return int(read_manifest(path).get("step", -1))


if __name__ == "__main__":  # `python -m ntp_nemo.train`: the command (as the module __main__, no circle)
    from ntp_nemo.cli.train import main

    main()
