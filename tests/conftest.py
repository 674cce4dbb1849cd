"""Shared fixtures: composing real configs, running the real CLI, one `ntp-train -m` sweep for many
cases, and the failure-free reference curves every comparison reads (computed once per session).

The suite's budget is 15 minutes on 2 cores (tests/README.md): a test that compares a loss curve reads
`reference_losses`, and layout cases of one module run as one sweep (`sweep_cases`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.shapes import TINY_OVERRIDES
from tests.waits import wait_until

ROOT = Path(__file__).resolve().parents[1]
# `--failures-file`: the failed test calls a session writes down for its rerun (`python -m tests.rerun`)
pytest_plugins = ("tests.rerun",)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist with `--dist loadgroup` (the README's test command), the tests of a module that
    read a module-scoped fixture run on one worker, so the fixture (often a whole sweep of runs) is
    computed once instead of once per worker; every other test goes to whichever worker is free.  First
    among the hooks: xdist's own (on each worker) reads the groups to name the scheduling units, and
    marks added after it would be ignored."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        if any(fd.scope == "module" for defs in info.name2fixturedefs.values() for fd in defs):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    # xdist sends the groups first (most tests first), then single tests in this order: the slow ones
    # first, so that the last tests of the run are short and both workers finish together.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# Small enough for 2 cores, big enough to learn: used by CLI tests unless they override it (tests/shapes.py).
TINY = list(TINY_OVERRIDES)
SINGLE = ["mesh.dp=1", "mesh.tp=1", "ntp.replica_tp=null"]


@pytest.fixture(scope="session", autouse=True)
def _shared_cache(tmp_path_factory):
    """One corpus/token cache for the whole session (the embedded corpus is tokenised once), and one
    intra-op thread per process started: a one-process run keeps torch's default (every core), which
    the ranks of a layout do not (each sets 1), and on a busy machine its threads wait on each other
    for seconds a step."""
    if "NTP_NEMO_CACHE" not in os.environ:
        os.environ["NTP_NEMO_CACHE"] = str(tmp_path_factory.mktemp("ntp_cache"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _warm_cli(_shared_cache, tmp_path_factory):
    """This test worker's warm interpreter for `run_cli` (tests/warm_cli.py), started in the background at
    once; NTP_TEST_COLD_CLI=1 starts every command as a fresh interpreter instead."""
    if os.environ.get("NTP_TEST_COLD_CLI"):
        yield
        return
    from tests import warm_cli

    proc = warm_cli.start(tmp_path_factory.mktemp("warm_cli"))
    yield
    os.environ.pop(warm_cli.ENV, None)
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_cli(
    args: list[str], cwd: Path, timeout: int = 300, module: str = "ntp_nemo.train"
) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` in `cwd`, its output captured: through this worker's warm interpreter
    where it runs (tests/warm_cli.py: a fork of a process that did the imports), else a fresh one."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    from tests import warm_cli

    if os.environ.get(warm_cli.ENV):
        return warm_cli.run(module, args, cwd, env, timeout)
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_cli_until_step(args: list[str], cwd: Path, run_dir: Path, step: int,
                         timeout: float = 240) -> subprocess.Popen:
    """Start `ntp-train args` in a session of its own (a signal to its process group reaches every
    worker, as a scheduler's does), its stdout and stderr together; return once rank 0's heartbeat says
    step `step` started (the test fails if it never does within `timeout` s)."""
    proc = subprocess.Popen([sys.executable, "-m", "ntp_nemo.train", *args], cwd=cwd, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    beat = run_dir / "failover" / "heartbeats" / "rank_00000.json"

    def started() -> bool:
        try:
            doc = json.loads(beat.read_text())
        except (OSError, ValueError):
            return False
        return doc.get("step") == step and doc.get("phase") == "step_start"

    try:
        wait_until(started, timeout, f"step {step} to start", alive=lambda: proc.poll() is None)
    except AssertionError:
        proc.kill()
        pytest.fail(f"step {step} never started:\n{proc.communicate()[0]}")
    return proc


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from ntp_nemo.config.paths import conf_dir
    from ntp_nemo.config.register import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return hydra_compose(config_name="config", overrides=overrides)


def case_file(root: Path, name: str, overrides: list[str]) -> None:
    """Write `overrides` as the option `name` of the test-only config group `tests/case` under `root`,
    applied last (`# @package _global_`): one job's settings of a sweep. `key=value` sets a value (read
    as the command line reads it: `fault.more=[{kind:kill_rank,step:6}]` is a list of one mapping); a
    group choice such as `fault=hang` becomes an `override /fault: hang` entry of its defaults list."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from ntp_nemo.config.paths import conf_dir

    assert all("=" in o and not o.startswith(("+", "~", "recipe=")) for o in overrides), overrides
    groups = [o.split("=", 1) for o in overrides if (conf_dir() / o.split("=", 1)[0]).is_dir()]
    values = [o for o in overrides if not (conf_dir() / o.split("=", 1)[0]).is_dir()]
    text = "# @package _global_\n"
    if groups:
        text += "defaults:\n" + "".join(f"  - override /{group}: {choice}\n" for group, choice in groups)
    if values:
        cfg = OmegaConf.create()
        for override in OverridesParser.create().parse_overrides(values):
            OmegaConf.update(cfg, override.key_or_group, override.value(), force_add=True)
        text += OmegaConf.to_yaml(cfg)
    folder = root / "tests" / "case"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.yaml").write_text(text)


class Sweep(NamedTuple):
    """A finished `ntp-train -m` sweep: the process and each case's job directory (by case name)."""

    proc: subprocess.CompletedProcess
    dirs: dict[str, Path]

    def run_dir(self, name: str) -> Path:
        """The job directory of case `name`, with the sweep's output when that job left no metrics."""
        run = self.dirs[name]
        assert (run / "metrics.jsonl").is_file(), (name, self.proc.stdout[-2000:], self.proc.stderr[-3000:])
        return run


def sweep_cases(cases: dict[str, list[str]], common: list[str], root: Path, timeout: int = 900) -> Sweep:
    """Run every case (name -> overrides on top of `common`) as one job of one `ntp-train -m` sweep: one
    interpreter and one import of Lightning for all of them; jobs run in the order of `cases`, each in
    its own run directory (`root/sweep/<job number>`). Each case becomes an option of a config group on
    `hydra.searchpath` (`+tests/case=a,b,...`), so one swept value sets several keys at once.

    A case with `hydra.sweep.subdir=NAME` runs in `root/sweep/NAME` instead: cases naming the same
    subdir continue one run directory in turn (a stop, then its resume, as two commands would), and a
    case may resume from a checkpoint an earlier job of the sweep wrote."""
    names = list(cases)
    given = {o.split("=", 1)[0] for o in common}
    both = sorted({o.split("=", 1)[0] for name in names for o in cases[name]} & given)
    assert not both, f"set in `common` and in a case (the command line would win over the case): {both}"
    for name in names:
        case_file(root / "cases", name, cases[name])
    sweep_dir = root / "sweep"
    proc = run_cli(
        ["-m", *common, f"hydra.searchpath=[file://{root / 'cases'}]", f"+tests/case={','.join(names)}",
         f"hydra.sweep.dir={sweep_dir}"],
        cwd=root,
        timeout=timeout,
    )
    subdirs = {name: next((o.split("=", 1)[1] for o in cases[name] if o.startswith("hydra.sweep.subdir=")),
                          str(i)) for i, name in enumerate(names)}
    return Sweep(proc, {name: sweep_dir / subdirs[name] for name in names})


# The failure-free curves of TINY that comparisons read: one process (every layout follows the same curve
# to 1e-5 relative, tests/cli/test_train_cli.py), per run length (the schedule depends on trainer.max_steps);
# NTP (2,1) at 20 steps for the resume tests' 1e-6 comparisons (same layout, same reduction order).
NTP21 = ["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,1]"]
REFERENCES = {
    "single-5": [*SINGLE, "trainer.max_steps=5"],
    "single-8": [*SINGLE, "trainer.max_steps=8"],
    "single-12": [*SINGLE, "trainer.max_steps=12"],
    "single-20": [*SINGLE, "trainer.max_steps=20"],
    # float64: a 40-step curve through three layout changes, compared tightly (float32 rounding grows
    # past 1e-4 relative at a loss spike late in such a run)
    "single-40-f64": [*SINGLE, "trainer.precision=64-true", "trainer.max_steps=40"],
    # the fault campaign's job (bench/fault_campaign.py: base_job, seed 7) at its 6 steps
    "single-6-seed7": [*SINGLE, "seed=7", "trainer.max_steps=6"],
    "ntp21-20": [*NTP21, "trainer.max_steps=20"],
}


def reference_sweep(root: Path) -> None:
    """Run every REFERENCES case as one sweep under `root` and write `root/losses.json` ({case: {step:
    loss}}, or {"error": ...} when the sweep failed) in one atomic replace: what `reference_losses` reads."""
    result = sweep_cases(REFERENCES, [*TINY], root)
    if result.proc.returncode != 0:
        doc = {"error": f"exit {result.proc.returncode}\n{result.proc.stderr[-3000:]}"}
    else:
        doc = {case: {m["step"]: m["loss"] for m in read_metrics(result.run_dir(case))}
               for case in REFERENCES}
    tmp = root / "losses.json.tmp"
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, root / "losses.json")


def pytest_configure(config):
    """Under pytest-xdist, the controlling process starts the reference sweep at once in the background
    (`python -m tests.conftest <dir>`) and hands its directory and one shared data cache to the workers
    (through the environment they inherit): the sweep runs once per session, beside the first tests,
    instead of once per worker in the setup of the first test that reads it."""
    if hasattr(config, "workerinput") or not config.pluginmanager.hasplugin("xdist"):
        return
    if not config.getoption("numprocesses", None) or os.environ.get("NTP_TEST_REFERENCES"):
        return
    from importlib.metadata import version

    from packaging.version import Version

    if config.getoption("dist") == "loadgroup" and Version(version("pytest")) >= Version("9.2") \
            and Version(version("pytest-xdist")) <= Version("3.8"):
        pytest.exit("pytest-xdist <= 3.8 cannot group tests under pytest 9.2 (`--dist loadgroup` then runs "
                    "every module fixture on each worker): install the pytest pyproject.toml names "
                    "(`pip install 'pytest<9.2'`)", 4)
    root = Path(tempfile.mkdtemp(prefix="ntp-test-references-"))
    os.environ.setdefault("NTP_NEMO_CACHE", str(root / "cache"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["NTP_TEST_REFERENCES"] = str(root)
    config.stash[_REFERENCE_SWEEP] = subprocess.Popen(
        [sys.executable, "-m", "tests.conftest", str(root)], cwd=ROOT,
        stdout=(root / "sweep.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )


def pytest_unconfigure(config):
    proc = config.stash.get(_REFERENCE_SWEEP, None)
    if proc is None:
        return
    if proc.poll() is None:  # a short session: the sweep and the processes it started
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    shutil.rmtree(os.environ.pop("NTP_TEST_REFERENCES"), ignore_errors=True)


_REFERENCE_SWEEP = pytest.StashKey[subprocess.Popen]()
REFERENCE_WAIT_S = 1200  # the sweep's own timeout (sweep_cases) plus its start


@pytest.fixture(scope="session")
def reference_losses(tmp_path_factory) -> Callable[[str], dict[int, float]]:
    """`reference_losses(name)`: {step: loss} of the failure-free run REFERENCES[name] (TINY, no
    checkpoints), every reference computed by one sweep: the one the xdist controller started
    (`NTP_TEST_REFERENCES`), else one run here the first time any is asked for."""
    done: dict[str, dict[int, float]] = {}

    def get(name: str) -> dict[int, float]:
        if not done:
            shared = os.environ.get("NTP_TEST_REFERENCES")
            root = Path(shared) if shared else tmp_path_factory.mktemp("references")
            if not shared:
                reference_sweep(root)
            wait_until((root / "losses.json").is_file, REFERENCE_WAIT_S, f"the reference sweep in {root}",
                       poll_s=0.5)
            doc = json.loads((root / "losses.json").read_text())
            assert "error" not in doc, f"the reference sweep failed: {doc.get('error')}"
            done.update({case: {int(k): v for k, v in losses.items()} for case, losses in doc.items()})
        losses = done[name]
        steps = int(REFERENCES[name][-1].split("=")[1])
        assert sorted(losses) == list(range(1, steps + 1)), (name, sorted(losses))
        return losses

    return get


if __name__ == "__main__":  # the background reference sweep of pytest_configure
    reference_sweep(Path(sys.argv[1]))
