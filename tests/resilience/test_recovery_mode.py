"""What `fault.recovery` becomes on GPUs (NCCL), under torchrun and under SLURM, and what the run says.

`auto` keeps the restart path where live recovery is unverified (NCCL) or cannot work (torchrun stops
every local worker when one exits; SLURM without an ntp-coordinator); an explicit `live` on GPUs is
accepted with one warning line, and under torchrun it is a config error (exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from ntp_nemo.errors import ConfigError
from ntp_nemo.resilience.fault_config import (
    NCCL_UNVERIFIED,
    NO_COORDINATOR,
    TORCHRUN_RESTARTS,
    LaunchContext,
    recovery_mode,
    validate_fault_config,
)
from tests.conftest import TINY, compose

TWO_REPLICAS = ["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,2]", "trainer.max_steps=10"]
TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29511",
                "TORCHELASTIC_RUN_ID": "none", "ROLE_RANK": "0", "ROLE_WORLD_SIZE": "4"}
SRUN_ENV = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
            "SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NAME": "train"}


def _spec(*overrides):
    from ntp_nemo.config.failover import failover_spec

    return failover_spec(compose([*TWO_REPLICAS, *overrides]))


@pytest.mark.parametrize(
    "overrides,launcher,coordinator,mode,why",
    [
        ([], None, False, "live", "fault.recovery=auto"),
        (["trainer.accelerator=gpu"], None, False, "restart", f"fault.recovery=auto: {NCCL_UNVERIFIED}"),
        (["trainer.accelerator=gpu", "fault.recovery=live"], None, False, "live", "fault.recovery=live"),
        ([], "torchrun", False, "restart", f"fault.recovery=auto: {TORCHRUN_RESTARTS}"),
        (["trainer.accelerator=gpu"], "torchrun", True, "restart",
         f"fault.recovery=auto: {TORCHRUN_RESTARTS}"),
        (["fault.recovery=restart"], "torchrun", False, "restart", "fault.recovery=restart"),
        ([], "slurm", False, "restart", f"fault.recovery=auto: {NO_COORDINATOR}"),
        ([], "slurm", True, "live", "fault.recovery=auto"),
        (["trainer.accelerator=gpu"], "slurm", True, "restart", f"fault.recovery=auto: {NCCL_UNVERIFIED}"),
        (["optim.distributed=true"], "slurm", True, "restart", "optim.distributed=true"),
    ],
)
def test_recovery_mode_and_its_reason(overrides, launcher, coordinator, mode, why):
    got, reason = recovery_mode(_spec(*overrides), launcher, coordinator)
    assert got == mode, reason
    assert reason == why if why.startswith("fault.recovery=") else why in reason, reason


def test_explicit_live_on_gpu_is_accepted_but_live_under_torchrun_is_refused():
    validate_fault_config(_spec("trainer.accelerator=gpu", "fault.recovery=live"), LaunchContext())
    with pytest.raises(ConfigError) as err:
        validate_fault_config(_spec("fault.recovery=live"), LaunchContext("torchrun"))
    assert err.value.key == "fault.recovery"
    assert TORCHRUN_RESTARTS in str(err.value) and "ntp-coordinator" in str(err.value)
    with pytest.raises(ConfigError, match="NTP_COORDINATOR"):
        validate_fault_config(_spec("fault.recovery=live"), LaunchContext("slurm", coordinator=False))
    validate_fault_config(_spec("fault.recovery=live"), LaunchContext("slurm", coordinator=True))
    validate_fault_config(_spec(), LaunchContext("torchrun"))  # auto: restart, no error


def test_launch_context_from_the_launchers_variables():
    assert LaunchContext.from_env({}) == LaunchContext(None, False, 0)
    assert LaunchContext.from_env({**TORCHRUN_ENV, "RANK": "3"}) == LaunchContext("torchrun", False, 3)
    srun = LaunchContext.from_env({**SRUN_ENV, "NTP_COORDINATOR": "node0:29400"})
    assert srun == LaunchContext("slurm", True, 2)
    assert LaunchContext.from_env({**SRUN_ENV, "NTP_COORDINATOR": ""}).coordinator is False


def _start_up_lines(capsys, run_dir, context, *overrides):
    """What `Supervisor.build_first` prints (the trainer is a stand-in: nothing is built)."""
    from ntp_nemo.config.failover import failover_spec
    from ntp_nemo.config.resolve_layout import resolve_layout
    from ntp_nemo.resilience.supervisor import Supervisor

    cfg = compose([*TWO_REPLICAS, "fault=kill_rank", "fault.rank=1", "fault.step=3", *overrides])

    def build(layout, callbacks, devices, stop):
        trainer = SimpleNamespace(strategy=SimpleNamespace(launcher=object()), callbacks=list(callbacks))
        return trainer, None, None

    sup = Supervisor(failover_spec(cfg), resolve_layout(cfg), run_dir, build, context=context)
    sup.build_first()
    return capsys.readouterr().out.splitlines()


def test_start_up_lines_say_the_mode_once(capsys, tmp_path):
    cap = (capsys, tmp_path)
    lines = _start_up_lines(*cap, LaunchContext(), "trainer.accelerator=gpu", "fault.recovery=live")
    warnings = [line for line in lines if "unverified" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: fault.recovery=live on GPUs (NCCL)")
    assert [line for line in lines if line.startswith("fault injection:")] == [
        "fault injection: kill_rank rank 1 at step 3; policy ntp; recovery live (fault.recovery=live)"]

    lines = _start_up_lines(*cap, LaunchContext(), "trainer.accelerator=gpu")  # auto: no warning, restart
    assert not [line for line in lines if line.startswith("warning")]
    assert lines[-1].endswith(f"recovery restart (fault.recovery=auto: {NCCL_UNVERIFIED})")

    lines = _start_up_lines(*cap, LaunchContext("torchrun", global_rank=0))
    assert lines[-1].endswith(f"recovery restart (fault.recovery=auto: {TORCHRUN_RESTARTS})")
    # another rank of the same job prints neither line
    assert _start_up_lines(*cap, LaunchContext("slurm", True, 1), "trainer.accelerator=gpu",
                           "fault.recovery=live") == []


def test_cli_refuses_live_under_torchrun(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(TORCHRUN_ENV, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "ntp_nemo.train", *TINY, *TWO_REPLICAS, "fault.recovery=live",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "fault.recovery" in out and TORCHRUN_RESTARTS in out and "ntp-coordinator" in out, out[-3000:]
