"""`ntp-plan` through the real command: a ranking of the best few layouts by default, the full list
on request, a training run's own model config (model=, recipe=), and config errors without a traceback."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys

from ntp_nemo.planner import parse_layer_tp

LLAMA = ["model=llama3_8b", "hardware=h100", "mesh.tp=8", "mesh.pp=1", "ntp.replica_tp=[8,8,7]",
         "recompute=false", "memory_limit_gb=80"]


def _plan(args: list[str], cwd) -> subprocess.CompletedProcess:
    exe = shutil.which("ntp-plan")
    cmd = [exe] if exe else [sys.executable, "-m", "ntp_nemo.cli.plan"]
    return subprocess.run([*cmd, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def _rows(out: str) -> list[list[str]]:
    """The ranking's rows: the lines after the header and its dashes, up to the first blank line."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("# ")) + 2
    assert set(lines[start - 1].replace(" ", "")) == {"-"}
    rows = []
    for line in lines[start:]:
        if not line.strip() or line.startswith("("):
            break
        rows.append(line.split())
    return rows


def _command(out: str) -> list[str]:
    line = out.split("to train with the best layout:\n", 1)[1].splitlines()[0]
    return shlex.split(line)


def test_default_is_a_short_table_with_a_header_and_the_command(tmp_path):
    proc = _plan(LLAMA, tmp_path)
    assert proc.returncode == 0, proc.stderr
    header = next(line for line in proc.stdout.splitlines() if line.lstrip().startswith("# "))
    for column in ("embedding", "layers", "head", "ms/micro-batch", "vs best", "peak GB", "batch shares"):
        assert column in header
    rows = _rows(proc.stdout)
    assert 1 <= len(rows) <= 5 and [r[0] for r in rows] == [str(i + 1) for i in range(len(rows))]
    assert rows[0][1:4] == ["1", "8*32", "8"] and rows[0][5] == "best"  # embedding alone at degree 1
    times = [float(r[4]) for r in rows]
    assert times == sorted(times)
    assert "more: top=N or --all" in proc.stdout
    cmd = _command(proc.stdout)
    assert cmd[:2] == ["ntp-train", "model=llama3_8b"]
    assert "layout.layer_tp='1,8*32,8'" in cmd and "ntp.replica_tp=[8,8,7]" in cmd and "mesh.dp=3" in cmd
    assert "Traceback" not in proc.stderr


def test_all_and_top_change_the_number_of_rows(tmp_path):
    every = _rows(_plan([*LLAMA, "--all"], tmp_path).stdout)
    assert len(every) > 5
    two = _plan([*LLAMA, "top=2"], tmp_path)
    assert len(_rows(two.stdout)) == 2 and "more: top=N or --all" in two.stdout
    data = json.loads(_plan([*LLAMA, "format=json", "--all"], tmp_path).stdout)
    assert len(data["candidates"]) == len(every) == data["within_memory_limit"]
    assert data["candidates"][0]["layer_tp"] == "1,8*32,8" and len(data["layer_tp"]) == 34
    bad = _plan([*LLAMA, "top=0"], tmp_path)
    assert bad.returncode == 2 and "top" in bad.stderr and "Traceback" not in bad.stderr


def test_training_model_and_recipe(tmp_path):
    proc = _plan(["model=gpt_tiny"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    # The default recipe's mesh and data with gpt_tiny: TP 2, replicas [2, 1], sequence 128.
    assert proc.stdout.startswith("gpt_tiny: 4 layers, hidden 256, seq 128, micro-batch 2;"), proc.stdout
    assert "replica_tp=[2, 1]" in proc.stdout and 1 <= len(_rows(proc.stdout)) <= 5
    cmd = _command(proc.stdout)
    assert cmd[1] == "model=gpt_tiny"
    pattern = next(a for a in cmd if a.startswith("layout.layer_tp=")).split("=", 1)[1].strip("'")
    assert len(parse_layer_tp(pattern, 4, 2)) == 6

    pp = _plan(["recipe=gpt_tiny_pp", "--all"], tmp_path)
    assert pp.returncode == 0, pp.stderr
    assert "pp=2" in pp.stdout.splitlines()[0] and _command(pp.stdout)[1] == "recipe=gpt_tiny_pp"
    llama = _plan(["model=llama_tiny", "model.num_layers=6", "detail=true"], tmp_path)
    assert llama.returncode == 0, llama.stderr
    assert llama.stdout.startswith("llama_tiny: 6 layers") and "layer0-5" in llama.stdout


def test_printed_command_runs(tmp_path):
    """The command under the table is a valid `ntp-train` command line (checked by a dry run)."""
    cmd = _command(_plan(["model=gpt_tiny"], tmp_path).stdout)
    run = subprocess.run(
        [sys.executable, "-m", "ntp_nemo.train", *cmd[1:], "trainer.dry_run=true",
         f"hydra.run.dir={tmp_path / 'r'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "r" / "dry_run.json").is_file()


def test_unknown_model_or_recipe_exits_2_naming_the_choices(tmp_path):
    proc = _plan(["model=gpt_tinyy"], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: invalid configuration: model: unknown model 'gpt_tinyy'")
    assert len(proc.stderr.strip().splitlines()) == 1  # one paragraph
    for name in ("gpt_tiny", "llama_tiny", "gpt_480b", "recipe=NAME", "gpt_tiny_pp"):
        assert name in proc.stderr
    recipe = _plan(["recipe=nope"], tmp_path)
    assert recipe.returncode == 2 and "recipe: unknown recipe 'nope'" in recipe.stderr
    assert "Traceback" not in recipe.stderr


def test_printed_shares_are_the_split_of_the_printed_command(tmp_path):
    """The shares `ntp-plan` prints are the micro-batch split the `ntp-train` command it prints runs:
    the default recipe's 6 micro-batches over replicas (2, 1) are 4 and 2; with a 1.3 boost and 12
    micro-batches, 7 and 5."""
    from ntp_nemo.config.resolve_layout import resolve_layout
    from tests.conftest import compose

    for args, split in ((["model=gpt_tiny"], [4, 2]),
                        (["model=gpt_tiny", "ntp.power_boost=1.3", "data.global_batch_size=24"], [7, 5])):
        proc = _plan(args, tmp_path)
        assert proc.returncode == 0, proc.stderr
        shares = _rows(proc.stdout)[0][7:]
        assert shares == ["/".join(f"{m / sum(split):.3f}" for m in split), f"({'/'.join(map(str, split))})"]
        cmd = _command(proc.stdout)
        assert resolve_layout(compose(cmd[1:])).microbatches == tuple(split)
        data = json.loads(_plan([*args, "format=json"], tmp_path).stdout)
        assert data["microbatches"] == split and data["batch_shares"] == [m / sum(split) for m in split]
