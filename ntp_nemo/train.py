"""`ntp-train`: the Hydra entry point (also `python -m ntp_nemo.train`).

Composition errors (unknown key, bad override) and validation errors exit with code 2 and a
one-paragraph message before any worker starts; runtime failures exit 1.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from ntp_nemo.errors import EXIT_CONFIG, EXIT_RUNTIME, ConfigError, report_config_error

if TYPE_CHECKING:
    from omegaconf import DictConfig

# Module level imports stay light: `--help` and a misspelt key answer before Hydra is imported, a bad
# value before torch; Lightning is imported once the config is valid, before the workers are forked
# (they inherit it).

_job_started = False
_IMPORTED = time.time()  # when /proc does not say when this process started


def launcher_rank() -> int:
    """Global rank given by an external launcher (torchrun: RANK, srun: SLURM_PROCID); 0 when we launch."""
    for var in ("RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def process_start_time() -> float:
    """Wall-clock time this process started (from /proc on Linux: interpreter start-up and imports
    included); elsewhere when this module was imported."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks since boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        started = time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED
    return started if _IMPORTED - 600 < started <= _IMPORTED else _IMPORTED


def say(*args, **kwargs) -> None:
    """Print once per job: under torchrun/SLURM every rank runs this entry point."""
    if launcher_rank() == 0:
        print(*args, **kwargs)


def _quiet_libraries() -> None:
    """Lightning logs through its own handler; stop Hydra's root handler from printing it twice."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).propagate = False
    # "Terminating process N via signal SIGTERM": torch stopping the other workers after one failed;
    # the supervisor reports the failure and what it does about it.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    # modelopt checks the installed transformers version on import; ntp_nemo uses none of its HF paths.
    warnings.filterwarnings("ignore", message=r"transformers .* is not tested with current version of model")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    warnings.filterwarnings("ignore", message=".*sync_dist=True.*")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*exists and is not empty.*")
    # Batches are a function of (seed, step): the step restored from the checkpoint resumes the data exactly.
    warnings.filterwarnings("ignore", message=".*dataloader is not resumable.*")
    warnings.filterwarnings("ignore", message=".*no pre-optimization state was saved.*")


def train(cfg: DictConfig) -> dict:
    """Validate, prepare data, launch the workers and train; returns the run summary."""
    from hydra.core.hydra_config import HydraConfig

    if cfg.trainer.get("dry_run"):  # validates by itself, reads no data, starts no worker
        from ntp_nemo.dry_run import run_dry

        # Under torchrun/SLURM every process gets here: global rank 0 alone runs it and writes the file.
        return run_dry(cfg, Path(HydraConfig.get().runtime.output_dir), say) if launcher_rank() == 0 else {}
    from ntp_nemo.config import checks
    from ntp_nemo.config.layout import resolve_layout
    from ntp_nemo.config.validate import check_environment, validate

    checks.require_mandatory(cfg)
    checks.adjust(cfg)
    from ntp_nemo.data.validate import explicit_keys, resolve_data_config

    # The tokenizer sizes model.vocab_size (unless it is given on the command line).
    overrides = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
    resolve_data_config(cfg, explicit_keys(overrides))
    validate(cfg)  # before any heavy import: a bad value answers in well under a second
    from ntp_nemo.resilience.fault_config import validate_fault_config

    validate_fault_config(cfg)  # the `fault` group too (no torch, no Lightning)
    check_environment(cfg)
    from ntp_nemo.parallel.cluster import slurm_batch_without_srun

    if slurm_batch_without_srun():
        say(f"note: a SLURM batch script without srun (SLURM_NTASKS={os.environ['SLURM_NTASKS']} is the "
            "allocation's, not a launch): ntp-train launches the layout's ranks on this node", flush=True)
    checks.check_batch_split(cfg)
    checks.warn_no_ops(cfg)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    checks.check_outputs(cfg, run_dir)
    ckpt_path = resolve_resume(cfg, run_dir)
    if ckpt_path is None and str(cfg.resume) == "auto":
        from ntp_nemo.config.run_dir import nothing_saved_note

        note = nothing_saved_note(run_dir, run_dir / str(cfg.checkpoint.dir))
        if note:
            say(note, flush=True)
    if ckpt_path is not None:
        checks.check_resume_model(cfg, ckpt_path)
    from ntp_nemo.resilience.supervisor import Supervisor  # imports Lightning
    layout = resolve_layout(cfg)  # once, before launch: the strategy and runtime take this value
    layer_tp = list(layout.layer_tp)
    run_dir.mkdir(parents=True, exist_ok=True)
    if launcher_rank() == 0:
        from ntp_nemo.config.run_dir import save_record

        note = save_record(cfg, run_dir)  # only now: a command that fails validation keeps the old record
        if note:
            say(note, flush=True)
    if cfg.model.get("init_from"):
        say(f"model weights: initialised from {cfg.model.init_from} (model.init_from)", flush=True)
    _quiet_libraries()
    from ntp_nemo.data.module import build_data

    data = build_data(
        cfg.data.path,
        cfg.data.tokenizer,
        int(cfg.data.seq_len),
        int(cfg.data.global_batch_size),
        int(cfg.seed),
        float(cfg.data.val_fraction),
        int(cfg.model.vocab_size),
        blend=cfg.data.blend,
        val_path=cfg.data.val_path,
        eos_token=cfg.data.get("eos_token"),
    )
    if cfg.quant.format != "none":
        from ntp_nemo.quant.modules import register_tp_layers

        register_tp_layers()  # import modelopt once, before the workers are forked
    from ntp_nemo.lightning.factory import build_trainer, model_config
    from ntp_nemo.models import flops_per_token, param_count

    mcfg = model_config(cfg)
    supervisor = Supervisor(
        cfg,
        run_dir,
        lambda c, extra, devices: build_trainer(
            c, run_dir, data, layout if c is cfg else resolve_layout(c), extra, devices,
            job_started=launcher_rank() == 0,  # recorded below, before supervisor.run
        ),
    )
    trainer, module, strategy = supervisor.build_first()
    topo = strategy.topology
    say(
        f"ntp_nemo | recipe {cfg.recipe} | model {mcfg.name} ({mcfg.arch}) "
        f"{param_count(mcfg) / 1e6:.2f}M params, "
        f"{flops_per_token(mcfg, int(cfg.data.seq_len)) / 1e6:.1f} MFLOP/token | data "
        f"{cfg.data.path or 'embedded corpus (Python standard library)'} "
        f"[tokenizer {data.tokenizer_name}, {data.vocab_size} ids -> {mcfg.vocab_size} vocabulary rows] "
        f"({len(data.train)} train / {len(data.val)} val samples)",
        flush=True,
    )
    say(topo.table(mcfg.num_heads, mcfg.ffn_hidden_size, mcfg.vocab_size), flush=True)
    say(
        f"layer degrees (embedding, layers..., head): {layer_tp}; micro-batches per replica per step: "
        f"{module_counts(strategy, cfg)}",
        flush=True,
    )
    from ntp_nemo.goodput import GoodputRecorder

    done_step = _checkpoint_step(ckpt_path) if ckpt_path is not None else -1
    if done_step >= int(cfg.trainer.max_steps):
        say(
            f"run in {run_dir} is already complete: checkpoint {ckpt_path.name} is at step "
            f"{done_step} >= trainer.max_steps={cfg.trainer.max_steps}; nothing to do. "
            "Raise trainer.max_steps to continue, or pass resume=never / a new hydra.run.dir to start "
            "over."
        )
        return {"already_complete": True, "checkpoint": str(ckpt_path)}
    if ckpt_path is not None:
        say(f"resuming from {ckpt_path} (step {done_step}; resume={cfg.resume})", flush=True)
    if launcher_rank() == 0:
        GoodputRecorder(run_dir).record("job_start", layout=topo.describe())
    t0 = time.time()
    supervisor.initial_resume = ckpt_path
    try:
        result = supervisor.run((trainer, module, strategy), ckpt_path)
    except Exception:
        _raise_if_found_corrupt(ckpt_path)
        raise
    if launcher_rank() != 0:
        return {}  # summary.json has one writer, global rank 0, which also reads and prints it
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    summary["wall_s"] = time.time() - t0
    summary.update(invocation_stats(run_dir, t0))  # every attempt of this command, not the last one's
    if summary.get("first_step_start") is not None:
        summary["startup_s"] = summary.pop("first_step_start") - process_start_time()
    if (run_dir / "goodput.jsonl").exists():
        from ntp_nemo.goodput.report import analyse

        report, _ = analyse(run_dir, plot=False)  # the numbers `ntp-goodput RUN_DIR` prints
        summary["goodput"], summary["capacity_fraction"] = report.goodput, report.capacity_fraction
        recoveries = report.failure_recoveries  # each failure's mode (live | restart) and downtime
    else:
        recoveries = []
    tmp = summary_path.with_name(summary_path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, summary_path)
    if result.failures or recoveries:
        attempts = result.summary()
        summary["failover"] = {**attempts, "failures": max(result.failures, len(recoveries)),
                               "layouts": summary.get("layouts") or attempts["layouts"],
                               "recoveries": recoveries}
    print_summary(summary, run_dir, logger_dirs(cfg))
    return summary


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
        return found
    return require_valid_checkpoint(Path(mode).expanduser(), key="resume")


def invocation_stats(run_dir: Path, since: float) -> dict:
    """Steps, losses and tokens/s of this command's steps in metrics.jsonl (all its attempts)."""
    path = run_dir / "metrics.jsonl"
    recs = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("time", 0) >= since:
                recs.append(rec)
    if not recs:
        return {}
    steady = recs[1:] or recs  # the first step carries one-time warm-up work
    secs = sum(r["step_time_s"] for r in steady)
    layouts: list[str] = []  # the layouts trained on, in order (consecutive repeats merged)
    for r in recs:
        if r.get("layout") and (not layouts or layouts[-1] != r["layout"]):
            layouts.append(r["layout"])
    return {
        "steps_this_run": len(recs),
        "layouts": layouts,
        "first_step_start": recs[0]["time"] - recs[0]["step_time_s"],
        "first_loss": recs[0]["loss"],
        "final_loss": recs[-1]["loss"],
        "tokens_per_s": sum(r["tokens"] for r in steady) / secs if secs > 0 else None,
    }


def _raise_if_found_corrupt(ckpt_path: Path | None) -> None:
    """The workers verify the data while loading (the check before launch reads only metadata); when
    they found a bad file in the checkpoint to resume from and had nothing to fall back to, they marked
    it corrupt: answer like any bad resume path (exit 2, naming the file), not with their traceback."""
    from ntp_nemo.checkpoint.manifest import CORRUPT_MARKER, checkpoint_problem, invalid_checkpoint_error

    if ckpt_path is not None and (Path(ckpt_path) / CORRUPT_MARKER).is_file():
        raise invalid_checkpoint_error(ckpt_path, checkpoint_problem(ckpt_path), "resume") from None


def _checkpoint_step(path: Path) -> int:
    from ntp_nemo.checkpoint.manifest import read_manifest

    return int(read_manifest(path).get("step", -1))


def module_counts(strategy, cfg: DictConfig) -> list[int]:
    from ntp_nemo.data.rebalance import assign_microbatches

    n = int(cfg.data.global_batch_size) // int(cfg.data.micro_batch_size)
    return assign_microbatches(n, strategy.layout.capacities())


def _percent(x: float | None) -> float | None:
    return None if x is None else 100 * x


def logger_dirs(cfg: DictConfig) -> list[str]:
    """The run-directory folders the configured loggers write (`logs/` for CSV, `tb/` for TensorBoard)."""
    return [f"{lg.name}/" for lg in (cfg.get("logger") or {}).values() if lg is not None and lg.get("name")]


def print_summary(summary: dict, run_dir: Path, log_dirs: list[str] | None = None) -> None:
    outputs = ", ".join(["metrics.jsonl", "goodput.jsonl", "checkpoints/", *(log_dirs or [])])

    def fmt(v, spec=".4f"):
        return "n/a" if v is None else format(v, spec)

    lines = [
        "",
        "──────────────── ntp_nemo run summary ────────────────",
        f" layout        {summary.get('layout')}",
        f" steps         {summary.get('steps')} ({summary.get('steps_this_run')} in this run)",
        f" loss          first {fmt(summary.get('first_loss'))} → final {fmt(summary.get('final_loss'))}",
        f" val loss      {fmt(summary.get('val_loss'))}",
        f" tokens/s      {fmt(summary.get('tokens_per_s'), '.0f')}",
        f" goodput       {fmt(_percent(summary.get('goodput')), '.1f')}%",
        f" wall time     {fmt(summary.get('wall_s'), '.1f')} s",
        *(
            [f" startup       {summary['startup_s']:.1f} s from the command to the first step"]
            if summary.get("startup_s") is not None
            else []
        ),
        *(
            [
                f" failover      {summary['failover']['failures']} failure(s)"
                + "".join(f"; recovered {r['mode']} in {r['recovery_s']:.2f} s"
                          for r in summary["failover"].get("recoveries", []))
                + "; layouts " + " -> ".join(summary["failover"]["layouts"])
            ]
            if summary.get("failover")
            else []
        ),
        *(
            [
                f" stopped early at step {summary.get('steps')} of {summary.get('max_steps')} "
                f"({'Ctrl-C' if summary['stopped_early'] == 'SIGINT' else summary['stopped_early']}); "
                "checkpoint saved",
                f" to resume     {resume_command(run_dir)}",
            ]
            if summary.get("stopped_early")
            else []
        ),
        f" outputs       {run_dir} ({outputs})",
        "──────────────────────────────────────────────────────",
    ]
    say("\n".join(lines), flush=True)


def resume_command(run_dir: Path) -> str:
    """The command that continues this run: its own overrides, in its run directory (resume=auto)."""
    import shlex

    from hydra.core.hydra_config import HydraConfig

    try:
        overrides = list(HydraConfig.get().overrides.task)
    except ValueError:  # no Hydra job (called from Python)
        overrides = []
    keep = [o for o in overrides if not o.startswith(("hydra.run.dir=", "resume=", "trainer.stop_at_step="))]
    return " ".join(["ntp-train", *map(shlex.quote, keep), shlex.quote(f"hydra.run.dir={run_dir}")])


def _hydra_entry(cfg: DictConfig) -> float | None:
    """The Hydra job (`main` wraps it in `hydra.main`)."""
    global _job_started
    _job_started = True
    from hydra.core.hydra_config import HydraConfig

    from ntp_nemo.config.run_dir import ConsoleLog, log_path

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    with ConsoleLog(log_path(run_dir), enabled=launcher_rank() == 0):  # train.log = what the console shows
        try:
            summary = train(cfg)
        except ConfigError as err:
            report_config_error(err)
            _drop_empty_run_dir()
            sys.exit(EXIT_CONFIG)
        except BaseException:
            _drop_empty_run_dir()
            raise
    return summary.get("final_loss")


def _drop_empty_run_dir() -> None:
    """A command that failed before writing anything leaves no run directory behind."""
    from hydra.core.hydra_config import HydraConfig

    from ntp_nemo.config.run_dir import remove_if_empty

    if launcher_rank() == 0:
        remove_if_empty(Path(HydraConfig.get().runtime.output_dir))


def _interrupted(signum, frame) -> None:  # noqa: ANN001 - signal handler signature
    """Ctrl-C in this process while no worker trains (imports, composition, data, checks, the summary):
    nothing to save, so stop at once. Exiting from the handler (rather than raising KeyboardInterrupt
    inside Hydra's or OmegaConf's code, which turns it into a bogus config error) keeps it clean."""
    print("interrupted (Ctrl-C) while no training step runs: nothing to save; stopped", file=sys.stderr,
          flush=True)
    try:
        _drop_empty_run_dir()
    except Exception:  # noqa: BLE001 - no Hydra job yet: no run directory to tidy
        pass
    os._exit(0)


def main() -> None:
    import signal

    # The launcher replaces this handler while workers run (they checkpoint); forked workers hold the
    # signal until training starts (`hold_stop_signals`).
    signal.signal(signal.SIGINT, _interrupted)
    try:
        _main()
    except KeyboardInterrupt:  # a Ctrl-C that reached Python code before the handler above
        print("interrupted (Ctrl-C) before training started: nothing to save; stopped", file=sys.stderr,
              flush=True)
        sys.exit(0)


def _main() -> None:
    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
        from ntp_nemo.config.help import help_text

        print(help_text())
        return
    from ntp_nemo.config.keys import check_override_keys
    from ntp_nemo.config.run_dir import check_run_dir_overrides

    try:
        check_override_keys(sys.argv[1:])  # a misspelt or `+`-added typed key: "did you mean"
        check_run_dir_overrides(sys.argv[1:])  # e.g. a read-only place: said here, not in Hydra's traceback
    except ConfigError as err:
        report_config_error(err)
        sys.exit(EXIT_CONFIG)
    import hydra

    from ntp_nemo.config.paths import conf_dir
    from ntp_nemo.config.register import register_configs

    register_configs()
    # The .hydra/ record is written by the job once the config is valid (ntp_nemo.config.run_dir).
    if not any(a.startswith("hydra.output_subdir=") for a in sys.argv):
        sys.argv += ["hydra.output_subdir=null"]
    if launcher_rank() != 0:
        # Only global rank 0 keeps the run's .hydra/ record and log file.
        sys.argv += ["hydra/job_logging=disabled"]
    try:
        hydra.main(version_base=None, config_path=str(conf_dir()), config_name="config")(_hydra_entry)()
    except SystemExit as exc:
        # Hydra exits 1 on composition errors (unknown key, bad override) before the job starts.
        if exc.code == 1 and not _job_started:
            sys.exit(EXIT_CONFIG)
        raise
    except Exception as exc:  # noqa: BLE001 - last resort: a runtime failure
        print(f"error: training failed: {exc}", file=sys.stderr)
        sys.exit(EXIT_RUNTIME)


if __name__ == "__main__":
    main()
