"""A cluster job's start-up: TP groups inside a node, every GPU of a node visible to its tasks, the
open-file limit and the communicator splits of 1,000+ ranks, a taken MASTER_PORT, and the README's
batch scripts under SLURM's semantics.

Host names and GPU counts are simulated (the rank -> host map a job's exchange would gather); the
exchange itself runs in a real two-process gloo world.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

from ntp_nemo.errors import ConfigError
from ntp_nemo.launch.node_layout import (
    NodeFacts,
    check_placement,
    check_tp_within_nodes,
    gpus_on_node,
    isolated_gpu_warning,
)
from ntp_nemo.launch.workers import run_workers
from ntp_nemo.topology import Topology
from tests.conftest import ROOT


def block_hosts(per_node: list[int]) -> list[str]:
    """The rank -> host map of a block placement (srun --distribution=block, torchrun agents in order)."""
    return [f"node{n:02d}" for n, count in enumerate(per_node) for _ in range(count)]


# ---- 1. TP groups stay inside a node ---------------------------------------------------------------------
def test_tp_group_across_nodes_is_refused_naming_group_nodes_and_fix():
    # PP 2, seven TP-8 replicas and a TP-7 one under srun's block placement on 8-GPU nodes: replica 7's
    # stage 1 (ranks 119-125) starts on node 14 (ranks 112-119) and ends on node 15.
    topo = Topology(8, [8] * 7 + [7], [8] * 34, pp=2)
    hosts = block_hosts([8] * 15 + [6])
    with pytest.raises(ConfigError) as err:
        check_tp_within_nodes(hosts, topo)
    text = str(err.value)
    assert err.value.key == "ntp.allow_cross_node_tp"
    assert "replica 7 stage 1 (ranks 119-125)" in text
    assert "node14: ranks [119]" in text and "node15: ranks [120, 121, 122, 123, 124, 125]" in text
    assert "ntp.allow_cross_node_tp=true" in text and "multiple of the stages' TP sizes" in text
    # Opted in: the same paragraph, as a warning.
    assert check_tp_within_nodes(hosts, topo, allow=True).startswith("the TP group of replica 7 stage 1")
    # The TP-7 replica's stages on their own 7-GPU nodes: every group inside one node.
    assert check_tp_within_nodes(block_hosts([8] * 14 + [7, 7]), topo) is None


def test_a_smaller_node_sorted_into_the_middle_shifts_later_groups_across_nodes():
    # torchrun orders the agents by host: a 7-GPU node between two 8-GPU nodes moves replica 1's
    # last rank onto the third node.
    topo = Topology(8, [8, 8, 7], [8] * 6)
    with pytest.raises(ConfigError, match=r"replica 1 stage 0 \(ranks 8-15\) spans 2 nodes"):
        check_tp_within_nodes(block_hosts([8, 7, 8]), topo)
    assert check_tp_within_nodes(block_hosts([8, 8, 7]), topo) is None


def test_per_layer_tp_subgroups_are_checked_too():
    # A replica of 4 with per-layer degree 2: the subgroups (0,1) and (2,3) sit on nodes of 2 ranks.
    topo = Topology(4, [4], [2, 2, 2, 2])
    assert check_tp_within_nodes(block_hosts([2, 2]), topo) is None
    assert (0, 1) in topo.tp_group_tuples() and (0, 1, 2, 3) not in topo.tp_group_tuples()
    with pytest.raises(ConfigError, match=r"\(ranks 0-1\) spans 2 nodes .*\(and 2 more TP group\(s\)\)"):
        check_tp_within_nodes(block_hosts([1, 2, 1]), Topology(4, [4], [4, 2, 2, 4]))


# ---- 2. NVLink stays on ----------------------------------------------------------------------------------
def test_gpus_on_node_reads_slurm():
    assert gpus_on_node({"SLURM_GPUS_ON_NODE": "8"}) == 8
    assert gpus_on_node({"SLURM_GPUS_PER_NODE": "h200:8"}) == 8
    assert gpus_on_node({"SLURM_GPUS_PER_NODE": "4(x2)"}) == 4
    assert gpus_on_node({}) is None


def test_one_gpu_per_task_on_a_larger_node_warns_once_naming_the_nodes():
    isolated = [NodeFacts(f"gpu{n}", 1, 8) for n in range(2) for _ in range(8)]
    text = isolated_gpu_warning(isolated)
    assert text.startswith("each task sees one GPU on 2 node(s) with more: gpu0 (8 GPUs), gpu1 (8 GPUs)")
    assert "NVLink" in text and "--gpus-per-node" in text and "--gpus-per-task" in text
    assert isolated_gpu_warning([NodeFacts("gpu0", 8, 8)] * 8) is None  # every GPU visible
    assert isolated_gpu_warning([NodeFacts("gpu0", 1, 1)]) is None  # a one-GPU node
    assert isolated_gpu_warning([NodeFacts("cpu0", 0, None)] * 3) is None  # CPU job


@pytest.mark.parametrize("value, count", [
    ("3", 1),  # srun --gpus-per-task=1: one id per task
    ("0,1,2,3", 4),
    ("1,-1,2", 1),  # CUDA stops at the first invalid entry
    ("0,0", 0),  # a repeated id hides every device
    ("", 0),
    (None, 0),  # unset on a CPU run: no CUDA query, nothing counted
])
def test_a_cpu_task_counts_the_gpus_cuda_visible_devices_names(monkeypatch, value, count):
    from ntp_nemo.launch import devices

    if value is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    monkeypatch.setattr(devices, "cuda_device_count", lambda: pytest.fail("a CUDA query on a CPU run"))
    assert devices.visible_gpus(on_cuda=False) == count


def test_cuda_visible_devices_alone_does_not_make_a_cpu_machine_a_gpu_one(monkeypatch):
    """The accelerator check reads CUDA's own count, not the variable the placement report reads."""
    import torch

    from ntp_nemo.launch import devices

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    expected = torch.cuda.device_count() > 0  # what CUDA says on this machine, not the variable
    assert devices.cuda_available() is expected


def _refused_placement_worker(rank: int, world: int) -> tuple[list[str], str | None]:
    seen: list[str] = []
    try:
        check_placement(Topology(2, [2], [2, 2, 2, 2]), allow_cross_node_tp=False, visible_gpus=1,
                        env={"SLURM_GPUS_ON_NODE": "8"}, host=["a", "b"][rank], warn=seen.append)
    except ConfigError as err:
        return seen, err.key
    return seen, None


def test_a_refused_placement_still_warns_of_isolated_gpus_first():
    """A job refused for a TP group across nodes hears of its one-GPU tasks in the same start-up."""
    out = run_workers(_refused_placement_worker, 2, timeout_s=60)
    assert [key for _, key in out] == ["ntp.allow_cross_node_tp"] * 2
    assert all(len(w) == 1 and w[0].startswith("each task sees one GPU on 2 node(s) with more: a (8 GPUs), "
                                               "b (8 GPUs)") for w, _ in out), out


def test_readme_recommends_every_gpu_of_a_node_visible():
    section = (ROOT / "README.md").read_text().split("## On GPUs and clusters")[1].split("\n## ")[0]
    assert "--gpus-per-node`, not `--gpus-per-task=1`" in section and "NVLink" in section
    for script in _batch_scripts():
        assert "--gpus-per-node=8" in script and "--gpus-per-task" not in script


def _placement_worker(rank: int, world: int, hosts: list[str], allow: bool, gpus: int, on_node: str):
    topo = Topology(2, [2], [2, 2, 2, 2])
    try:
        return check_placement(topo, allow_cross_node_tp=allow, visible_gpus=gpus,
                               env={"SLURM_GPUS_ON_NODE": on_node}, host=hosts[rank])
    except ConfigError as err:
        return f"ConfigError {err.key}: {err}"


def test_the_start_up_exchange_gathers_every_ranks_host():
    """The function the strategy calls once after the process group is up, in a real gloo world."""
    out = run_workers(_placement_worker, 2, ["a", "b"], False, 0, "", timeout_s=60)
    assert all(o.startswith("ConfigError ntp.allow_cross_node_tp:") and "a: ranks [0], b: ranks [1]" in o
               for o in out)
    out = run_workers(_placement_worker, 2, ["a", "b"], True, 1, "2", timeout_s=60)
    assert [len(o) for o in out] == [2, 2] and out[0] == out[1]
    assert out[0][0].startswith("the TP group of replica 0 stage 0") and "each task sees one GPU" in out[0][1]
    assert run_workers(_placement_worker, 2, ["a", "a"], False, 2, "2", timeout_s=60) == [[], []]


# ---- 3. start-up at 1,000+ ranks -------------------------------------------------------------------------
_LIMIT = """
import resource, sys
from ntp_nemo.errors import ConfigError
from ntp_nemo.topology.groups import open_files_needed, raise_open_file_limit
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 1024))
world = int(sys.argv[1])
try:
    print(raise_open_file_limit(open_files_needed(world), world))
except ConfigError as err:
    print(err)
"""


@pytest.mark.parametrize("world, expected", [
    (300, "(256, 1024)"),  # 2 x 299 + 256 = 854 files: the soft limit goes up to the hard one
    (1022, "ulimit -n: a rank of this 1022-rank job needs about 2298 open files"),
])
def test_open_file_limit_raised_to_the_hard_one_or_refused(world, expected):
    out = subprocess.run([sys.executable, "-c", _LIMIT, str(world)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(expected), out.stdout
    if world == 1022:
        assert "may open only 1024" in out.stdout and "ulimit -Hn" in out.stdout


def _writer_group_worker(rank: int, world: int):
    import torch.distributed as dist

    from ntp_nemo.checkpoint import AsyncCheckpointSaver
    from ntp_nemo.topology.groups import counting_new_groups

    saver = AsyncCheckpointSaver()
    with counting_new_groups() as first:
        saver.prepare()
    with counting_new_groups() as again:
        saver.prepare()
    # gloo may finish connecting on one rank first: closing before the other has connected would cut
    # its half-made connection (no save ever happens in this test to keep both ranks together).
    dist.barrier()
    saver.close()
    return first, again


def test_the_checkpoint_writers_group_can_be_created_before_the_first_save():
    assert run_workers(_writer_group_worker, 2, timeout_s=60) == [([2], []), ([2], [])]


def test_pipeline_links_take_one_group_per_stage_pair_and_direction():
    from ntp_nemo.pipeline.p2p import StageLinks, link_pairs

    topo = Topology(3, [3, 2], [3] * 8, pp=3)
    made: list[list[int]] = []

    def new_group(ranks):
        made.append(list(ranks))
        return len(made) - 1

    links = StageLinks(topo, 0, new_group)
    assert len(made) == 2 * topo.dp * (topo.pp - 1) == 8  # was two per link: 2 x 10
    assert len(link_pairs(topo)) == 10
    for a, b in link_pairs(topo):
        for group in (links._fwd[(a, b)], links._bwd[(a, b)]):
            assert a in made[group] and b in made[group]
        assert links._fwd[(a, b)] != links._bwd[(a, b)]
    assert made[0] == topo.stage_ranks(0, 0) + topo.stage_ranks(0, 1)


def test_dry_run_counts_the_communicator_splits_before_step_1():
    import torch

    from ntp_nemo.models.model_config import ModelConfig
    from ntp_nemo.runtime.dry_run import StepShape, dry_run, splits_line
    from ntp_nemo.topology import ResolvedLayout

    cfg = ModelConfig(arch="llama", name="t", vocab_size=96, hidden_size=32, num_layers=4, num_heads=4,
                      num_kv_heads=2, ffn_hidden_size=64, max_seq_len=16)
    layout = ResolvedLayout.make(Topology(2, [2, 2, 1], [2] * 6, pp=2), num_microbatches=6)
    shape = StepShape(seq_len=16, micro_batch_size=1, param_dtype=torch.float32, compute_dtype=torch.float32)
    said: list[str] = []
    result = dry_run(layout, cfg, shape, progress=said.append, measure_options=False, checkpoint_group=True)
    # The dry run checks the counted kinds against the new_group calls of a rank's real assembly.
    s = result.splits
    assert s["world"] == 1 and s["checkpoint_writer"] == 1
    assert s["tp"] == 4  # stages 0 and 1 of the two TP-2 replicas
    assert s["pipeline_links"] == 2 * 3  # one group per stage pair and direction, 3 replicas
    assert s["total"] == 1 + 4 + s["holder_sets"] + 6 + 1
    assert splits_line(s) in said and said.index(splits_line(s)) < next(
        i for i, m in enumerate(said) if m.startswith("step shape"))


# ---- 5. a taken MASTER_PORT ------------------------------------------------------------------------------
def test_a_task_without_ntp_coordinator_beside_a_running_coordinator_names_the_variable(tmp_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NTP_", "MASTER_"))}
    env.update(SLURM_PROCID="0", SLURM_NTASKS="3", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_STEP_ID="0",
               SLURM_STEP_TASKS_PER_NODE="3", SLURM_NNODES="1", SLURM_JOB_ID="77",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        out = subprocess.run([sys.executable, "-m", "ntp_nemo.train", "trainer.max_steps=2",
                              f"hydra.run.dir={tmp_path / 'run'}"], env=env, capture_output=True, text=True,
                             timeout=300, cwd=tmp_path)
    finally:
        holder.close()
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"error: invalid configuration: MASTER_PORT: {port} on 127.0.0.1 is taken" in out.stderr
    assert "NTP_COORDINATOR" in out.stderr and "Traceback" not in out.stderr


# ---- 5. the shipped batch scripts -------------------------------------------------------------------------
def _batch_scripts() -> list[str]:
    """The batch scripts that ship with the package (the README links them;
    `tests/launch/test_slurm_scripts.py` runs them under a fake SLURM)."""
    return [p.read_text() for p in sorted((ROOT / "ntp_nemo" / "launch" / "slurm").glob("*.sbatch"))]


def _default_args(script: str) -> str:
    return re.search(r'^: "\$\{NTP_ARGS:=([^}]*)\}"', script, flags=re.M).group(1)


def test_live_script_under_slurm_semantics():
    live = next(b for b in _batch_scripts() if "ntp-coordinator" in b)
    nodes = re.search(r"--nodes=(\d+)", live)
    assert nodes and int(nodes.group(1)) >= 2
    # The main step leaves the spare node free: a replacement's srun finds GPUs there.
    assert "MAIN_NODES=$((SLURM_NNODES - 1))" in live
    assert re.search(r"srun [^\n]*--nodes=\$MAIN_NODES", live) and "--exclude=$SPARE_NODE" in live
    assert re.search(r"srun [^\n]*--ntasks=1 [^\n]*--gpus-per-node=1", live)
    args = _default_args(live)
    assert "data.path=" in args and "hydra.run.dir=" in args
    assert "source " in live  # the environment is activated on every node
    assert "scontrol requeue" in live
    for code in ("75", "76", "78"):
        assert re.search(rf"\b{code}\b", live), code


def test_every_batch_script_activates_the_environment_and_tells_a_time_limit_stop_from_training():
    scripts = _batch_scripts()
    assert len(scripts) >= 2
    for script in scripts:
        assert re.search(r'^source "?\S+/bin/activate', script, flags=re.M)
        assert "--signal=B:USR1@" in script and "--requeue" in script
        # ntp-train (and ntp-coordinator) exit 78 after a time-limit stop that saved its checkpoint
        # (test_resume_cli): the script requeues on that code.
        assert "scontrol requeue" in script
        requeued = re.search(r"^\s*[\d|]*\b78\b[\d|]*\)", script, flags=re.M)
        assert requeued, "78 is not among the codes the script requeues"
        args = _default_args(script)
        assert "data.path=/shared/" in args and "hydra.run.dir=/shared/" in args
    text = " ".join((ROOT / "README.md").read_text().split())  # the prose, whatever its line breaks
    assert "78 stopped at the time limit" in text
