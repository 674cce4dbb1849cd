"""`python -m ntp_nemo.resilience.replan`: the failover plan for a cluster restart.

The same policies the local supervisor uses, for torchrun/SLURM: given the layout that ran, the
failed global ranks and the policy, print the `ntp-train` overrides of the new layout and which
node and GPU each new rank runs on, so the relaunch excludes the failed GPUs:

    python -m ntp_nemo.resilience.replan --tp 4 --replica-tp 4,4 --failed 6 --policy ntp \\
        --nodes gpu-a,gpu-b --gpus-per-node 4

Ranks of the old run are placed in order, `gpus_per_node` per node (torchrun's and srun's block
placement).  A lost GPU's node keeps its other GPUs (CUDA_VISIBLE_DEVICES lists them); a node
left without work is listed for `srun --exclude`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Collection, Sequence
from typing import Any

from ntp_nemo.errors import EXIT_RUNTIME, ConfigError, cli_main
from ntp_nemo.resilience.policies import POLICY_NAMES, Replan, make_policy, replan
from ntp_nemo.topology import ResolvedLayout, Topology


def _ints(text: str, key: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(
            key, f"{text!r} is not a comma-separated list of integers, e.g. {key} 4,4."
        ) from None


def relaunch_devices(
    plan: Replan, devices: Sequence[int], lost: Collection[int], visible: int
) -> tuple[list[int], list[str]]:
    """CUDA device of each rank of the re-planned layout on this machine, and notes to print.

    `devices[old_rank]` is the device the old rank used; new rank i takes the device of its old rank
    `plan.assignment[i]`, so the survivors keep their GPUs and a lost device (`lost`) is never handed
    out.  Under `restart` a replaced rank takes a spare: a visible device no rank uses and none lost;
    with no spare left it restarts on its old device (the restart policy assumes it recovered)."""
    lost_set = set(lost)
    taken = {devices[o] for o in plan.assignment if o not in plan.replaced}
    spares = [d for d in range(visible) if d not in taken and d not in lost_set]
    out, notes = [], []
    for new_rank, old in enumerate(plan.assignment):
        device = devices[old]
        if old in plan.replaced:
            if spares:
                device = spares.pop(0)
                notes.append(f"rank {new_rank} takes spare cuda:{device} for lost cuda:{devices[old]}")
            else:
                notes.append(
                    f"no spare GPU for rank {new_rank}: it restarts on cuda:{device} "
                    "(policy restart; use fault.policy=ntp to continue without the lost device)"
                )
        elif device in lost_set:
            raise RuntimeError(f"rank {new_rank} of the re-planned layout would bind the lost cuda:{device}")
        out.append(device)
    return out, notes


def placement(plan: Replan, nodes: list[str], per_node_procs: list[int]) -> dict[str, Any]:
    """Per new rank and per node: where the processes of the new layout run.  The old run placed its
    ranks in order, `per_node_procs[i]` of them on node i (torchrun's and srun's block placement)."""
    ranks = []
    per_node: dict[str, dict[str, Any]] = {n: {"devices": [], "ranks": []} for n in nodes}
    where = [(nodes[i], g) for i, n in enumerate(per_node_procs) for g in range(n)]
    for new_rank, old in enumerate(plan.assignment):
        node, gpu = where[old]
        spare = old in plan.replaced
        ranks.append({"rank": new_rank, "old_rank": old, "node": node, "gpu": gpu, "spare": spare})
        per_node[node]["devices"].append(gpu)
        per_node[node]["ranks"].append(new_rank)
    used = {n: v for n, v in per_node.items() if v["ranks"]}
    return {"ranks": ranks, "nodes": used, "exclude": [n for n in nodes if n not in used]}


def build_plan(args: argparse.Namespace) -> dict[str, Any]:
    replica_tp = _ints(args.replica_tp, "--replica-tp")
    if not replica_tp or any(not 1 <= n <= args.tp for n in replica_tp):
        raise ConfigError(
            "--replica-tp", f"every replica needs 1..{args.tp} active ranks, got {args.replica_tp}."
        )
    if args.pp < 1:
        raise ConfigError("--pp", f"must be >= 1, got {args.pp}.")
    # The plan depends on the replica sizes alone: one layer per stage at the nominal degree stands in
    # for the model.
    layout = ResolvedLayout.make(Topology(args.tp, replica_tp, [args.tp] * (args.pp + 2), args.pp))
    plan = replan(layout, _ints(args.failed, "--failed"), make_policy(args.policy, args.min_replica_tp))
    per_node_procs = _procs_per_node(args.gpus_per_node or str(args.tp), layout.world_size)
    n_nodes = len(per_node_procs)
    nodes = args.nodes.split(",") if args.nodes else [f"node{i}" for i in range(n_nodes)]
    if len(nodes) < n_nodes:
        raise ConfigError(
            "--nodes",
            f"{len(nodes)} node(s) given but {layout.world_size} ranks at "
            f"{args.gpus_per_node or args.tp} per node need {n_nodes}; list every node of the old run in "
            "rank order.",
        )
    where = placement(plan, nodes[:n_nodes], per_node_procs)
    endpoint = args.rdzv_endpoint or f"{next(iter(where['nodes']))}:29500"
    for i, v in enumerate(where["nodes"].values()):
        v["env"] = {"CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in v["devices"])}
        v["torchrun_args"] = [
            f"--nnodes={len(where['nodes'])}",
            f"--node-rank={i}",
            f"--nproc-per-node={len(v['devices'])}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            "-m",
            "ntp_nemo.train",
            *plan.overrides(),
            "resume=auto",
        ]
    return {
        "policy": plan.policy,
        "old_layout": layout.describe(),
        "new_layout": plan.new.describe(),
        "failed": list(plan.failed),
        "dropped_replicas": list(plan.dropped),
        "overrides": plan.overrides(),
        **where,
    }


def _procs_per_node(text: str, world_size: int) -> list[int]:
    """`--gpus-per-node`: one count for every node (`4`), or the old run's per-node counts in SLURM's
    notation (`4,3`, `4(x2),3`)."""
    from ntp_nemo.launch.node_layout import parse_tasks_per_node

    try:
        counts = parse_tasks_per_node(text)
    except ConfigError:
        raise ConfigError(
            "--gpus-per-node", f"{text!r} is neither a count nor a per-node list such as 4,3 or 4(x2),3."
        ) from None
    if len(counts) == 1:
        counts = counts * -(-world_size // counts[0])
    if sum(counts) < world_size or any(n < 1 for n in counts):
        raise ConfigError(
            "--gpus-per-node",
            f"per-node counts {counts} place {sum(counts)} ranks but the old layout ran {world_size}.",
        )
    while sum(counts[:-1]) >= world_size:  # a count for every node: drop nodes the old run left empty
        counts.pop()
    counts[-1] -= sum(counts) - world_size
    return counts


def render(doc: dict[str, Any]) -> str:
    lines = [
        f"policy {doc['policy']}: layout {doc['old_layout']} -> {doc['new_layout']} "
        f"(failed ranks {doc['failed']}, dropped replicas {doc['dropped_replicas'] or 'none'})",
        "ntp-train overrides: " + " ".join(doc["overrides"]),
        "",
        "new rank  node:gpu  (old rank)",
    ]
    for r in doc["ranks"]:
        lines.append(
            f"  {r['rank']:>4}    {r['node']}:{r['gpu']}  ({r['old_rank']}{', spare' if r['spare'] else ''})"
        )
    lines += [
        "",
        f"per node (torchrun --nnodes={len(doc['nodes'])}, one command per node; append the run's other "
        "overrides and its hydra.run.dir):",
    ]
    for node, v in doc["nodes"].items():
        env = " ".join(f"{k}={x}" for k, x in v["env"].items())
        lines.append(f"  {node}: {env} torchrun {' '.join(v['torchrun_args'])}")
    if doc["exclude"]:
        lines.append(f"srun --exclude={','.join(doc['exclude'])} (nodes left without work)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="python -m ntp_nemo.resilience.replan", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--tp", type=int, required=True, help="nominal TP degree (mesh.tp)")
    ap.add_argument(
        "--replica-tp", required=True, help="active ranks per replica of the run that failed, e.g. 4,4"
    )
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages per replica (mesh.pp)")
    ap.add_argument("--failed", required=True, help="failed global ranks, e.g. 6 or 5,6")
    ap.add_argument("--policy", default="ntp", choices=POLICY_NAMES)
    ap.add_argument("--min-replica-tp", type=int, default=1, help="ntp.min_replica_tp")
    ap.add_argument("--nodes", help="node names of the old run in rank order (default node0, node1, ...)")
    ap.add_argument(
        "--gpus-per-node",
        help="ranks per node of the old run: one count (default: --tp) or a list such as 4,3 or 4(x2),3",
    )
    ap.add_argument(
        "--rdzv-endpoint", help="HOST:PORT of the relaunch's c10d rendezvous (default: first node:29500)"
    )
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = ap.parse_args()
    try:
        doc = build_plan(args)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_RUNTIME
    print(json.dumps(doc, indent=2) if args.json else render(doc))
    return 0


cli = cli_main(main)  # console-script entry point: ConfigError -> exit 2

if __name__ == "__main__":
    cli()
