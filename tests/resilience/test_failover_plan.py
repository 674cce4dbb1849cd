"""Failover building blocks without launching workers: policies, re-planning, detection, fault config."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from ntp_nemo.errors import ConfigError
from ntp_nemo.resilience.beats import Beat, suspects
from ntp_nemo.resilience.detection import LostRanks, Timeouts, Verdict, classify, is_lost_status
from ntp_nemo.resilience.policies import DropBelow, Policy, ShrinkToSurvivors, make_policy, replan
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.conftest import ROOT, compose

L44 = ResolvedLayout.make(Topology(tp=4, replica_tp=(4, 4), layer_tp=[4] * 4))


@pytest.mark.parametrize(
    "policy,failed,expected",
    [
        ("ntp", [6], (4, 3)),
        ("ntp", [0, 1, 2], (4,)),  # replica 0 left with 1 < min_replica_tp=2: dropped
        ("ntp", [0, 5], (3, 3)),
        ("dp_drop", [6], (4,)),
        ("dp_drop", [0, 5], None),
        ("restart", [6], (4, 4)),
    ],
)
def test_policies_on_a_4_4_layout(policy, failed, expected):
    p = make_policy(policy, min_replica_tp=2)
    if expected is None:
        with pytest.raises(RuntimeError, match="no replica"):
            replan(L44, failed, p)
        return
    plan = replan(L44, failed, p)
    assert plan.new.replica_tp == expected
    assert len(plan.assignment) == plan.new.world_size
    if policy == "restart":
        assert plan.assignment == tuple(range(8)) and plan.replaced == tuple(failed)
    else:
        assert not set(plan.assignment) & set(failed)  # survivors only


def test_replan_assignment_and_overrides():
    plan = replan(L44, [6], make_policy("ntp"))
    assert plan.assignment == (0, 1, 2, 3, 4, 5, 7)
    assert plan.overrides() == ["mesh.dp=2", "ntp.replica_tp=[4,3]"]
    assert plan.kept == (0, 1) and plan.dropped == ()
    drop = replan(L44, [1], make_policy("dp_drop"))
    assert drop.kept == (1,) and drop.dropped == (0,) and drop.assignment == (4, 5, 6, 7)


def test_pipeline_replica_runs_at_the_degree_of_its_worst_stage():
    # replica 0: stage 0 ranks 0,1; stage 1 ranks 2,3
    layout = ResolvedLayout.make(Topology(tp=2, replica_tp=(2, 2), layer_tp=[2] * 4, pp=2))
    assert layout.lost_per_replica([3]) == [1, 0]
    plan = replan(layout, [3], make_policy("ntp"))
    assert plan.new.replica_tp == (1, 2)
    assert plan.assignment == (0, 2, 4, 5, 6, 7)


def test_rules_compose():
    shrink_then_drop = Policy("custom", (ShrinkToSurvivors(), DropBelow(3)))
    assert shrink_then_drop.sizes(L44, [0]) == [3, 4]
    assert shrink_then_drop.sizes(L44, [0, 1]) == [0, 4]


def test_bad_policy_and_rank_are_config_errors():
    with pytest.raises(ConfigError, match="fault.policy"):
        make_policy("teleport")
    with pytest.raises(ConfigError, match="rank 8"):
        replan(L44, [8], make_policy("ntp"))


def test_lost_status_versus_python_exception():
    assert is_lost_status(137) and is_lost_status(-signal.SIGKILL) and is_lost_status(-signal.SIGSEGV)
    assert not any(is_lost_status(c) for c in (0, 1, None, -signal.SIGTERM))


def test_classify():
    # a kill: the lost rank by its status, survivors' errors (1) and our own kills (-9) are not blamed
    lost = classify([1, 137, -9], {2}, None, "gloo: connection closed", (), 6)
    assert lost == LostRanks((1,), "exit status", 6, "rank 1: 137")
    # a stall seen by the monitor wins over exit statuses (it killed everyone)
    v = Verdict("heartbeat", (2,), 5, 0.0, "silent")
    assert classify([-9, -9, -9], {0, 1, 2}, v, "", (), 5).ranks == (2,)
    # a collective timeout: blame the rank behind in the heartbeats
    to = classify([1, 1, -9], {2}, None, "RuntimeError: Timed out waiting 6000ms for recv", (2,), 5)
    assert to is not None and to.reason == "collective timeout" and to.ranks == (2,)
    # a plain Python error everywhere is a bug, not a lost rank
    assert classify([1, 1, 1], set(), None, "ValueError: bad shape", (), 3) is None


def test_suspects_from_heartbeats():
    beats = {
        0: Beat(0, 5, "step_start", 10.0, 1),
        1: Beat(1, 5, "step_start", 10.1, 2),
        2: Beat(2, 4, "step_end", 9.0, 3),
    }
    assert suspects(beats, 3) == (2,)
    beats[2] = Beat(2, 5, "step_start", 10.0, 3)
    assert suspects(beats, 3) == ()  # all equal: cannot tell
    assert suspects({0: beats[0]}, 2) == (1,)  # never reported


def _cfg(*overrides):
    return compose(["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,1]", "trainer.max_steps=10", *overrides])


def _spec(*overrides):
    from ntp_nemo.config.failover import failover_spec

    return failover_spec(_cfg(*overrides))


def test_timeout_hierarchy_is_validated():
    from ntp_nemo.resilience.supervisor import validate_fault_config

    t = Timeouts.from_config(_spec().fault)
    assert t.heartbeat_s < t.collective_s < t.step_s
    with pytest.raises(ConfigError, match="heartbeat < collective < whole step"):
        validate_fault_config(_spec("fault.heartbeat_timeout_s=700"))


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["fault.kind=meteor"], "fault.kind"),
        (["fault=kill_rank", "fault.rank=3"], "fault.rank"),
        (["fault=kill_rank", "fault.step=11"], "fault.step"),
        (["fault=slow", "fault.seconds=0"], "fault.seconds"),
        (["fault.repair_after_steps=0"], "fault.repair_after_steps"),
        (["fault=kill_rank", "fault.more=[{kind:kill_rank,rank:9,step:3}]"], "fault.more[0].rank"),
        (["fault=kill_rank", "fault.phase=during"], "fault.phase"),
        (["fault=hang", "fault.phase=backward"], "fault.phase"),
        (["fault.recovery=sideways"], "fault.recovery"),
        (["fault.recovery=live", "fault.policy=restart"], "fault.recovery"),
        (["fault.recovery=live", "optim.distributed=true"], "fault.recovery"),
    ],
)
def test_bad_fault_config(overrides, key):
    from ntp_nemo.resilience.supervisor import validate_fault_config

    with pytest.raises(ConfigError) as err:
        validate_fault_config(_spec(*overrides))
    assert err.value.key == key


@pytest.mark.parametrize(
    "overrides,mode,why",
    [
        ([], "live", "fault.recovery=auto"),  # two replicas on CPU: the survivors can reshard in memory
        (["fault.recovery=restart"], "restart", "fault.recovery=restart"),
        (["mesh.dp=1", "ntp.replica_tp=[2]"], "restart", "one replica"),
        (["optim.distributed=true"], "restart", "optim.distributed=true"),
        (["fault.policy=restart"], "restart", "spare"),
        (["trainer.accelerator=gpu"], "restart", "live recovery on NCCL has not run on a GPU yet"),
        (["fault.recovery=live", "trainer.accelerator=gpu"], "live", "fault.recovery=live"),  # with a warning
        (["fault.repair_after_steps=2"], "live", "fault.recovery=auto"),  # the repaired rank rejoins live
        (["fault.recovery=live", "mesh.dp=1", "ntp.replica_tp=[2]"], "live", "fault.recovery=live"),
    ],
)
def test_recovery_mode_auto_picks_live_where_it_can_work(overrides, mode, why):
    # With one replica an explicit `live` is kept: the survivors find no live copy and fall back, saying so.
    from ntp_nemo.resilience.supervisor import recovery_mode

    got, reason = recovery_mode(_spec("mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,2]", *overrides))
    assert got == mode and why in reason, reason


def test_unset_step_and_rank_are_drawn_from_the_seed():
    from ntp_nemo.resilience.faults import resolve_faults

    a = resolve_faults(_spec("fault=kill_rank"), 3)
    assert a == resolve_faults(_spec("fault=kill_rank"), 3)
    assert 0 <= a[0].rank < 3 and 1 <= a[0].step <= 10
    two = resolve_faults(_spec("fault=two_failures"), 3)
    assert [(f.kind, f.rank, f.step) for f in two] == [("kill_rank", 1, 4), ("kill_rank", 0, 8)]


def test_replan_command_prints_overrides_and_devices():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ntp_nemo.resilience.replan",
            "--tp",
            "4",
            "--replica-tp",
            "4,4",
            "--failed",
            "6",
            "--policy",
            "ntp",
            "--nodes",
            "gpu-a,gpu-b",
            "--gpus-per-node",
            "4",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["overrides"] == ["mesh.dp=2", "ntp.replica_tp=[4,3]"]
    assert doc["nodes"]["gpu-b"]["devices"] == [0, 1, 3]
    assert doc["nodes"]["gpu-a"]["devices"] == [0, 1, 2, 3]
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "ntp_nemo.resilience.replan",
            "--tp",
            "4",
            "--replica-tp",
            "4,4",
            "--failed",
            "9",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "rank 9" in bad.stderr


def test_a_stop_signal_ends_a_degraded_attempt_without_its_repair_relaunch(tmp_path):
    """In process, with stand-in trainers: attempt 0 loses rank 0, attempt 1 runs on the degraded layout
    until its repair stop, and a stop signal (the launcher's `stop_requested`) ends it first, the workers
    having checkpointed: the supervisor returns (outcome `stopped`, `result.stopped` for the exit code)
    instead of relaunching on the original layout as after a repair stop."""
    import time
    from types import SimpleNamespace

    from torch.multiprocessing import ProcessExitedException

    from ntp_nemo.config.resolve_layout import resolve_layout
    from ntp_nemo.resilience.supervisor import Supervisor

    class Proc:
        exitcode, pid, sentinel = 137, None, None

        def is_alive(self) -> bool:
            return False

    class Attempt:
        def __init__(self, stop_at) -> None:
            self.stop_at = stop_at
            self.strategy = SimpleNamespace(launcher=SimpleNamespace(procs=[], stop_requested=None))

        def fit(self, module, ckpt_path=None) -> None:
            if self.stop_at is None:  # attempt 0: rank 0 is lost
                self.strategy.launcher.procs = [Proc()]
                raise ProcessExitedException("process 0 terminated with exit code 137", 0, 0, 137)
            self.strategy.launcher.stop_requested = time.time()  # SIGTERM forwarded; the workers stop

    attempts: list[Attempt] = []

    def build(layout, extra, devices, stop_at):
        attempts.append(Attempt(stop_at))
        return attempts[-1], None, None

    cfg = _cfg("fault.recovery=restart", "fault.policy=ntp", "fault.repair_after_steps=2",
               "checkpoint.every_n_steps=2")
    sup = Supervisor(_spec("fault.recovery=restart", "fault.policy=ntp", "fault.repair_after_steps=2",
                           "checkpoint.every_n_steps=2"), resolve_layout(cfg), tmp_path / "run", build)
    result = sup.run(sup.build_first(), None)
    assert [a.stop_at for a in attempts] == [None, 2]  # attempt 1 was to stop at step 2 for its repair
    tries = [json.loads(line) for line in (sup.dir / "attempts.jsonl").read_text().splitlines()]
    assert [(t["outcome"], t["stop_at_step"]) for t in tries] == [("failed", None), ("stopped", 2)]
    assert result.stopped and result.exit_code == 0
