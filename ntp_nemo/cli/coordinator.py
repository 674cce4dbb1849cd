"""ntp-coordinator: the process of a cluster job that outlives every rank (live failover under SLURM).

Usage: ntp-coordinator [OVERRIDES...]

Start it once per job, before the tasks, on the first node, in the background, with the same overrides
as the tasks (`srun --kill-on-bad-exit=0 python -m ntp_nemo.train OVERRIDES...`).  It reads from the
environment:

  MASTER_PORT      the port of the job's store (the tasks reach it through NTP_COORDINATOR)
  MASTER_ADDR      the host name it reports (default: this host's name)
  NTP_JOB_SECRET   the job's secret (required: the store listens on every interface)

It prints `coordinator ready on HOST:PORT` once it listens, then one line per event (a task lost, a
published failure, a rejoin), and exits when the job ends: 0 when training finished, 75 when it stopped
the job (the survivors could not recover live; a task was lost while the job formed; its own store did not
answer for fault.collective_timeout_s: resubmit with resume=auto), 78 when the tasks stopped on a preemption
or time-limit signal (SIGTERM, SIGUSR1) before trainer.max_steps after saving a checkpoint (resubmit with
resume=auto; 1, saying so, when that stop saved none), 2 on bad input.  It reads how the tasks stopped
from the run directory the overrides name (`hydra.run.dir=`, on storage every node sees: the run's
summary.json and checkpoints); without one it exits 0 when the tasks finished.  There it also writes what it
knows of the places, at most once a second (failover/coordinator.json: `ntp-dashboard RUN_DIR` shows
them).  See the README's
"Live failover on a cluster" and docs/failover.md.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ntp_nemo.errors import EXIT_CONFIG, EXIT_OK, EXIT_STOPPED, ConfigError, report_config_error

if TYPE_CHECKING:
    from ntp_nemo.resilience.fault_config import Timeouts

USAGE = __doc__


def _settings(overrides: list[str]) -> tuple[int, Timeouts, int, str]:
    """(world size, timeouts, last step, checkpoint directory relative to the run directory) of the run the
    tasks start with `overrides`."""
    from ntp_nemo.cli.plan import _compose_training
    from ntp_nemo.config import checks
    from ntp_nemo.config.data_keys import explicit_keys
    from ntp_nemo.config.keys import check_override_keys
    from ntp_nemo.config.resolve import resolve
    from ntp_nemo.resilience.fault_config import Timeouts

    check_override_keys(overrides)
    cfg = _compose_training([o for o in overrides if not o.lstrip("+~").startswith("hydra")])
    checks.require_mandatory(cfg)  # the data keys too: the tasks need them
    # As the tasks resolve it (the same world size), without reading the data: a bad value stops the
    # coordinator as it stops the tasks (exit 2).
    spec = resolve(cfg, explicit_keys(overrides), reads_data=False)
    timeouts = Timeouts.from_config(spec.failover.fault)
    return spec.layout.world_size, timeouts, spec.trainer.max_steps, spec.checkpoint.dir


def _run_dir(overrides: list[str]) -> Path | None:
    """The run directory the tasks write, when the overrides name one (`hydra.run.dir=PATH`, no
    interpolation: Hydra's default names a directory by each process's own start time)."""
    for override in reversed(overrides):
        key, sep, value = override.lstrip("+~").partition("=")
        if key == "hydra.run.dir" and sep and value and "${" not in value:
            return Path(value).expanduser()
    return None


def tasks_stop_code(run_dir: Path | None, checkpoint_dir: str, since: float) -> tuple[int, str | None]:
    """How a job whose tasks finished (the coordinator's code 0) ends: the code `ntp-train` gives the
    same stop (`ntp_nemo.train.stop_exit`: 78 when a preemption or time-limit signal stopped the tasks
    before trainer.max_steps with the checkpoint of that step saved), read from the run's summary.json
    written since `since` (this coordinator's start: an older one is another job's), and the line that
    says why. EXIT_OK when there is no run directory or no summary of this job to read."""
    if run_dir is None:
        return EXIT_OK, None
    from ntp_nemo.data.bounded_json import JSONInputError, read_json

    path = run_dir / "summary.json"
    try:
        if path.stat().st_mtime < since:
            return EXIT_OK, None
        summary = read_json(path, 1 << 20)
    except (OSError, JSONInputError):
        return EXIT_OK, None
    if not isinstance(summary, dict):
        return EXIT_OK, None
    from ntp_nemo.train import stop_exit

    return stop_exit(summary, run_dir / checkpoint_dir)


def _raise_open_files() -> None:
    """The soft limit of open files up to the hard one: one link connection per task, and room for
    connections that never prove the job's secret."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20,
                                                        hard))
        except (ValueError, OSError):
            pass


def run(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(USAGE)
        return 0
    port_text = os.environ.get("MASTER_PORT", "")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError("MASTER_PORT", f"{port_text or 'unset'}: ntp-coordinator serves the job's store on "
                          "MASTER_PORT; export the same MASTER_ADDR/MASTER_PORT the tasks get (e.g. "
                          "`export MASTER_PORT=$((10000 + SLURM_JOB_ID % 20000))` in the batch script, as "
                          "ntp_nemo/launch/slurm/train_live.sbatch does).")
    started = time.time()
    world, timeouts, end_step, checkpoint_dir = _settings(argv)
    heartbeat_s = timeouts.heartbeat_s
    _raise_open_files()
    from ntp_nemo.resilience.coordinator import STATE_FILE, Coordinator
    from ntp_nemo.resilience.store_auth import host_cluster_store, job_secret

    port = int(port_text)
    try:
        job = host_cluster_store(port, required_by=f"ntp-coordinator's store on port {port}")
    except RuntimeError as err:  # the port is taken (another job, or a coordinator already running)
        raise ConfigError("MASTER_PORT", f"cannot listen on port {port} ({err}); pick a free port.") from None
    # Its own store may stay silent as long as a collective may wait; then the job stops (exit 75).  A
    # rejoin may form as long as a repaired task waits for the survivors.
    run_dir = _run_dir(argv)
    coordinator = Coordinator(job, job_secret(), world, heartbeat_s, end_step=end_step,
                              store_timeout_s=timeouts.collective_s, rejoin_s=timeouts.rejoin_s,
                              say=lambda s: print(s, flush=True),
                              state_path=run_dir / STATE_FILE if run_dir is not None else None)
    host = os.environ.get("MASTER_ADDR") or socket.gethostname()
    print(f"coordinator ready on {host}:{port} ({world} places; heartbeat timeout {heartbeat_s:g} s)",
          flush=True)
    code = coordinator.serve()
    if code != EXIT_OK:
        return code
    code, note = tasks_stop_code(run_dir, checkpoint_dir, started)
    if note is not None:
        print(f"coordinator: the tasks {note.removeprefix('error: ')}", flush=True)
    if code == EXIT_STOPPED:
        print("coordinator: resubmit the job with resume=auto to continue", flush=True)
    return code


def main() -> None:
    try:
        code = run(sys.argv[1:])
    except ConfigError as err:
        report_config_error(err)
        sys.exit(EXIT_CONFIG)
    except KeyboardInterrupt:
        print("coordinator: interrupted; exiting (the tasks stop: their coordinator is gone)",
              file=sys.stderr, flush=True)
        sys.exit(130)
    sys.exit(code)


if __name__ == "__main__":
    main()
