"""The shipped SLURM batch scripts (ntp_nemo/launch/slurm/*.sbatch) run by bash under a fake SLURM.

There is no cluster here, so `srun`, `scontrol`, `scancel`, `openssl` and `ntp-coordinator` are small
executables on PATH, written by the test, that record their arguments and environment. The script runs
with the variables `sbatch` sets in a batch script for the allocation its own `#SBATCH` header asks for
(SLURM_NTASKS of the whole allocation, SLURM_GPUS_PER_NODE, SLURM_CPUS_PER_TASK, ...). What each `srun`
step asks for is then read as srun reads it: an option on the command line, else the input variable it
inherits (SLURM_NTASKS, SLURM_NTASKS_PER_NODE, SLURM_GPUS_PER_NODE, SRUN_CPUS_PER_TASK; srun no longer
reads SLURM_CPUS_PER_TASK since Slurm 22.05). `pytest -s` prints the table of inherited variables
against each step's request.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCRIPTS = ROOT / "ntp_nemo" / "launch" / "slurm"
RESTART, LIVE = SCRIPTS / "train.sbatch", SCRIPTS / "train_live.sbatch"
JOB_ID = 123457

_RECORD = """import json, os, sys
def record(**fields):
    keep = ("SLURM_", "SRUN_", "MASTER_", "NTP_COORDINATOR")
    fields.setdefault("env", {k: v for k, v in os.environ.items() if k.startswith(keep)})
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(json.dumps(dict(prog=os.path.basename(sys.argv[0]), pid=os.getpid(), ppid=os.getppid(),
                                **fields)) + "\\n")
"""
FAKES = {
    # a step: records itself; FAKE_SRUN=block waits for a signal (as a training step does), else exits
    "srun": _RECORD + """import signal
record(argv=sys.argv[1:])
if os.environ.get("FAKE_SRUN") == "block":
    def stop(sig, _):
        record(ended=sig, env={})
        sys.exit(128 + sig)
    signal.signal(signal.SIGTERM, stop)
    signal.alarm(60)  # a bound: a step nobody ends goes away on its own
    signal.pause()
sys.exit(int(os.environ.get("FAKE_SRUN", "0")))
""",
    # waits until FAKE_WAIT_SRUNS steps started (bounded), then exits with FAKE_COORDINATOR
    "ntp-coordinator": _RECORD + """import time
record(argv=sys.argv[1:])
want, deadline = int(os.environ.get("FAKE_WAIT_SRUNS", "0")), time.monotonic() + 30
def started():
    with open(os.environ["FAKE_LOG"]) as f:
        return sum('"prog": "srun"' in line and '"argv"' in line for line in f)
while started() < want and time.monotonic() < deadline:
    time.sleep(0.02)
sys.exit(int(os.environ.get("FAKE_COORDINATOR", "0")))
""",
    "scontrol": _RECORD + """record(argv=sys.argv[1:])
if sys.argv[1:3] == ["show", "hostnames"]:
    print("\\n".join(os.environ["FAKE_HOSTS"].split()))
""",
    "scancel": _RECORD + "record(argv=sys.argv[1:])\n",
    "openssl": "print('ab' * 32)\n",
}


def sbatch_options(script: Path) -> dict[str, str]:
    """The script's `#SBATCH` header as {option: value} (`--requeue` -> '')."""
    opts: dict[str, str] = {}
    for line in script.read_text().splitlines():
        if line.startswith("#SBATCH"):
            for word in shlex.split(line)[1:]:
                key, _, value = word.removeprefix("--").partition("=")
                opts[key] = value
    return opts


def allocation_env(script: Path, restarts: int | None) -> dict[str, str]:
    """The variables sbatch sets in the batch script for the allocation its header asks for."""
    opts = sbatch_options(script)
    nodes, per_node = int(opts["nodes"]), int(opts["ntasks-per-node"])
    env = {
        "SLURM_JOB_ID": str(JOB_ID), "SLURM_JOBID": str(JOB_ID), "SLURM_JOB_NAME": opts["job-name"],
        "SLURM_NNODES": str(nodes), "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NTASKS": str(nodes * per_node), "SLURM_NPROCS": str(nodes * per_node),
        "SLURM_NTASKS_PER_NODE": str(per_node), "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})",
        "SLURM_GPUS_PER_NODE": opts["gpus-per-node"], "SLURM_CPUS_PER_TASK": opts["cpus-per-task"],
        "SLURM_JOB_NODELIST": f"gpu[01-{nodes:02d}]", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
    }
    if restarts is not None:  # SLURM sets it on a requeued job's later runs only
        env["SLURM_RESTART_COUNT"] = str(restarts)
    return env


def run_script(script: Path, tmp_path: Path, *, restarts: int | None = None, **fake: str):
    """Run `script` under the fake SLURM; returns (completed process, records, allocation env)."""
    bin_dir, venv = tmp_path / "fakebin", tmp_path / "venv"
    bin_dir.mkdir(exist_ok=True)
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    (venv / "bin" / "activate").write_text("# the fake cluster's environment: nothing to set\n")
    for name, body in FAKES.items():
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{body}")
        path.chmod(0o755)
    log = tmp_path / "fake.jsonl"
    log.write_text("")
    alloc = allocation_env(script, restarts)
    nodes = int(alloc["SLURM_NNODES"])
    env = {
        "PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin", "HOME": str(tmp_path),
        "NTP_VENV": str(venv), "NTP_ARGS": "recipe=gpt2_124m hydra.run.dir=/shared/runs/x",
        "FAKE_LOG": str(log), "FAKE_HOSTS": " ".join(f"gpu{i:02d}" for i in range(1, nodes + 1)),
        **alloc, **{f"FAKE_{k.upper()}": v for k, v in fake.items()},
    }
    try:
        res = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=120)
    finally:
        records = [json.loads(line) for line in log.read_text().splitlines()]
        for pid in {r["pid"] for r in records if r["prog"] == "srun"}:  # no fake step outlives its test
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return res, records, alloc


def request(argv: list[str], env: dict[str, str]) -> dict[str, str]:
    """What an srun step asks for: its options, else the input variables it inherits."""
    opts = {}
    for word in argv[: argv.index("python")]:
        key, _, value = word.removeprefix("--").partition("=")
        opts[key] = value
    inherited = {"ntasks": "SLURM_NTASKS", "ntasks-per-node": "SLURM_NTASKS_PER_NODE",
                 "gpus-per-node": "SLURM_GPUS_PER_NODE", "cpus-per-task": "SRUN_CPUS_PER_TASK",
                 "nodes": "SLURM_NNODES"}  # inside an allocation a step spans all its nodes by default
    out = {k: opts.get(k) or env.get(var, "1" if k == "cpus-per-task" else "")  # srun's default: 1 CPU
           for k, var in inherited.items()}
    for key in ("kill-on-bad-exit", "nodelist", "exclude", "exact"):
        out[key] = opts.get(key, "-") if key != "exact" else ("yes" if "exact" in opts else "-")
    return out


def steps(records: list[dict]) -> list[dict]:
    return [r for r in records if r["prog"] == "srun" and "argv" in r]


def print_table(script: Path, alloc: dict[str, str], rows: list[tuple[str, dict[str, str]]]) -> None:
    keys = ("SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_GPUS_PER_NODE", "SLURM_CPUS_PER_TASK")
    print(f"\n{script.name}: inherited from sbatch: " + " ".join(f"{k}={alloc[k]}" for k in keys))
    cols = ("nodes", "ntasks", "ntasks-per-node", "gpus-per-node", "cpus-per-task", "kill-on-bad-exit",
            "exclude", "nodelist", "exact")
    print(f"  {'step':<10}" + "".join(f"{c:>18}" for c in cols))
    for name, req in rows:
        print(f"  {name:<10}" + "".join(f"{req[c]:>18}" for c in cols))


def test_scripts_header_append_and_requeue():
    """A requeued job appends to its output file (sbatch truncates it otherwise) and may be requeued."""
    for script in (RESTART, LIVE):
        opts = sbatch_options(script)
        assert opts.get("open-mode") == "append", script.name
        assert "requeue" in opts and opts["signal"] == "B:USR1@300", script.name


def test_restart_script_step(tmp_path):
    res, records, alloc = run_script(RESTART, tmp_path)
    assert res.returncode == 0, res.stderr
    (step,) = steps(records)
    req = request(step["argv"], step["env"])
    print_table(RESTART, alloc, [("train", req)])
    per_node, nodes = int(alloc["SLURM_NTASKS_PER_NODE"]), int(alloc["SLURM_NNODES"])
    assert (req["nodes"], req["ntasks"], req["ntasks-per-node"]) == (str(nodes), str(nodes * per_node),
                                                                     str(per_node))
    assert req["cpus-per-task"] == alloc["SLURM_CPUS_PER_TASK"]  # through SRUN_CPUS_PER_TASK
    assert req["kill-on-bad-exit"] == "1"  # a lost task ends the step now, not after the collective timeout
    assert step["argv"][-2:] == ["recipe=gpt2_124m", "hydra.run.dir=/shared/runs/x"]
    assert not [r for r in records if r["prog"] == "scontrol"]


@pytest.mark.parametrize(
    ("code", "restarts", "requeued"),
    [(78, None, True), (137, 2, True), (137, 3, False), (1, None, False), (2, None, False)],
)
def test_restart_script_requeue(tmp_path, code, restarts, requeued):
    """78 (time limit) and 137 (a task killed) are requeued while SLURM_RESTART_COUNT is below
    NTP_MAX_REQUEUES (3); 1 and 2 never; the script exits with the step's code."""
    res, records, _ = run_script(RESTART, tmp_path, restarts=restarts, srun=str(code))
    assert res.returncode == code
    asked = [r["argv"] for r in records if r["prog"] == "scontrol"]
    assert asked == ([["requeue", str(JOB_ID)]] if requeued else [])
    if code in (78, 137) and not requeued:
        assert "not requeued: the job ran 4 times (NTP_MAX_REQUEUES=3)" in res.stdout


def test_live_script_steps(tmp_path):
    """Main step on all nodes but the last with the main nodes' task count; one spare per GPU of the
    last node, all at once, one GPU each; when the coordinator exits every step's srun is ended."""
    port = 10000 + JOB_ID % 20000
    held = socket.socket()
    try:  # a job sharing the node listens on the port drawn from this job's id: it is passed over
        held.bind(("127.0.0.1", port))
        held.listen()
    except OSError:
        pass  # taken by someone else already: passed over all the same
    try:
        res, records, alloc = run_script(LIVE, tmp_path, srun="block", wait_sruns="9", coordinator="0")
    finally:
        held.close()
    assert res.returncode == 0, res.stderr
    per_node, nodes = int(alloc["SLURM_NTASKS_PER_NODE"]), int(alloc["SLURM_NNODES"])
    started = steps(records)
    reqs = [request(s["argv"], s["env"]) for s in started]
    (coordinator,) = [r for r in records if r["prog"] == "ntp-coordinator"]
    # the batch shell starts the main step and the coordinator; the spare loops start the others
    main = [r for s, r in zip(started, reqs, strict=True) if s["ppid"] == coordinator["ppid"]]
    spares = [r for s, r in zip(started, reqs, strict=True) if s["ppid"] != coordinator["ppid"]]
    assert len(main) == 1, main
    m = main[0]
    print_table(LIVE, alloc, [("train", m), *[("spare", r) for r in spares]])
    assert len(spares) == per_node  # every GPU of the spare node holds a spare
    assert (m["nodes"], m["ntasks"], m["ntasks-per-node"]) == (str(nodes - 1), str((nodes - 1) * per_node),
                                                               str(per_node))
    assert m["gpus-per-node"] == alloc["SLURM_GPUS_PER_NODE"] and m["exclude"] == f"gpu{nodes:02d}"
    assert m["kill-on-bad-exit"] == "0"
    for s in spares:
        assert (s["nodes"], s["ntasks"], s["gpus-per-node"]) == ("1", "1", "1"), s
        assert s["nodelist"] == f"gpu{nodes:02d}" and s["kill-on-bad-exit"] == "0"
    assert {r["cpus-per-task"] for r in reqs} == {alloc["SLURM_CPUS_PER_TASK"]}
    # every srun was ended by the script (SIGTERM), none left running
    ended = {r["pid"] for r in records if r["prog"] == "srun" and r.get("ended") == signal.SIGTERM}
    assert ended == {s["pid"] for s in started}
    env = coordinator["env"]
    assert env["MASTER_ADDR"] == "gpu01"
    assert 10000 <= int(env["MASTER_PORT"]) < 30000 and int(env["MASTER_PORT"]) != port
    assert env["NTP_COORDINATOR"] == f"gpu01:{env['MASTER_PORT']}"
    assert all(s["env"]["MASTER_PORT"] == env["MASTER_PORT"] for s in started)
    assert not [r for r in records if r["prog"] == "scontrol" and r["argv"][0] == "requeue"]


@pytest.mark.parametrize(("code", "restarts", "requeued"), [(75, 1, True), (76, 3, False), (0, None, False)])
def test_live_script_requeue(tmp_path, code, restarts, requeued):
    res, records, _ = run_script(LIVE, tmp_path, restarts=restarts, srun="block", wait_sruns="9",
                                 coordinator=str(code))
    assert res.returncode == code
    asked = [r["argv"] for r in records if r["prog"] == "scontrol" and r["argv"][0] == "requeue"]
    assert asked == ([["requeue", str(JOB_ID)]] if requeued else [])
    assert re.search("not requeued" if code and not requeued else "^", res.stdout)


def test_scripts_default_args_are_valid():
    """Each script's default NTP_ARGS pass the checks ntp-train runs before launching anything."""
    from tests.house.test_readme_commands import check_config

    for script in (RESTART, LIVE):
        default = re.search(r'^: "\$\{NTP_ARGS:=(.*)\}"', script.read_text(), flags=re.M)
        assert default, script.name
        check_config(shlex.split(default[1]))
