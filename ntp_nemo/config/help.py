"""`ntp-train --help`: the recipes, the main config groups and a few examples (Hydra's own help,
which lists every config group of the package including the simulator's, is `--hydra-help`)."""

from __future__ import annotations

from ntp_nemo.config.paths import recipes_dir

GROUPS = (
    ("model", "architecture and sizes (model.hidden_size, model.num_layers, model.init_from)"),
    ("mesh", "mesh.dp replicas x mesh.tp nominal TP x mesh.pp stages"),
    ("ntp", "ntp.replica_tp active TP ranks per replica, ntp.power_boost, ntp.sequence_parallel, "
            "ntp.capacity ranks|work, ntp.pattern row_column|block"),
    ("layout", "layout.layer_tp per-layer degrees (or auto), layout.stage_layers, layout.schedule"),
    ("data", "data.path, data.tokenizer, data.seq_len, data.global_batch_size, data.micro_batch_size"),
    ("optim", "optim.lr, optim.warmup_steps, optim.weight_decay, optim.grad_clip"),
    ("trainer", "trainer.max_steps, trainer.precision, trainer.accelerator, trainer.val_every_n_steps"),
    ("checkpoint", "checkpoint.every_n_steps, checkpoint.keep_last, checkpoint.dir"),
    ("quant", "quant=int8|fp8|nvfp4 quantisation-aware training, quant.start_step"),
    ("fault", "fault=kill_rank|hang|... injected failures, fault.policy"),
    ("logger / callbacks", "logger=csv|tensorboard|none; +callbacks.NAME._target_=my.Callback"),
)
EXAMPLES = (
    ("ntp-train trainer.max_steps=20", "the default recipe, 20 steps"),
    ("ntp-train recipe=llama_tiny mesh.dp=2 mesh.tp=3 ntp.replica_tp=[3,2]", "a replica degraded to TP 2"),
    ("ntp-train hydra.run.dir=runs/a", "the same command again resumes from its last checkpoint"),
)

# The project's other programs ([project.scripts] of pyproject.toml), each with what it is for.
COMMANDS = (
    ("ntp-goodput RUN_DIR", "goodput and badput of a run, by category"),
    ("ntp-eval RUN_DIR TOKENS", "a checkpoint's loss and perplexity on a token file"),
    ("ntp-export RUN_DIR OUT_DIR", "a checkpoint as a Hugging Face directory"),
    ("ntp-preprocess TEXT --out TOKENS", "text, .jsonl or Parquet files to a token file (data.path)"),
    ("ntp-plan [key=value ...]", "per-layer TP layouts ranked by the cost model"),
    ("ntp-sim", "the cluster goodput simulator (DP-DROP, NTP, NTP-PW, spares)"),
    ("ntp-coordinator [overrides]", "a SLURM job's live-failover coordinator "
                                    "(ntp_nemo/launch/slurm/train_live.sbatch)"),
    ("ntp-incidents RUN_DIR", "a run's integrity findings (corruption, non-finite steps)"),
    ("ntp-dashboard RUN_DIR", "a live read-only page of a run or a sweep"),
)


def recipe_summaries(width: int = 88) -> list[tuple[str, str]]:
    """(name, first sentence of the recipe file's leading comment, cut to `width`) for every recipe."""
    out = []
    for path in sorted(recipes_dir().glob("*.yaml")):
        comment = []
        for line in path.read_text().splitlines():
            if not line.startswith("#"):
                break
            comment.append(line.lstrip("# ").strip())
        text = " ".join(comment)
        head, sep, rest = text.partition(": ")
        text = rest if sep and head.split(" ")[0] == path.stem else text
        text = text.split(". ")[0].rstrip(".")
        out.append((path.stem, text if len(text) <= width else text[: width - 1].rstrip() + "…"))
    return out


def help_text() -> str:
    recipes = recipe_summaries()
    width = max(len(n) for n, _ in recipes)
    lines = [
        "ntp-train: train a GPT-style model with nonuniform tensor parallelism (Hydra + Lightning).",
        "",
        "usage: ntp-train [recipe=NAME] [group.key=value ...]      (-m key=a,b ...: a sweep)",
        "",
        "recipes (recipe=NAME; default gpt_tiny):",
        *(f"  {n:<{width}}  {d}" for n, d in recipes),
        "",
        "main config groups (any key can be set as group.key=value):",
        *(f"  {g:<18}  {d}" for g, d in GROUPS),
        "",
        "examples:",
        *(f"  {c:<70}  # {d}" for c, d in EXAMPLES),
        "",
        "also: --cfg job (print the composed config without running), --hydra-help (Hydra's options)",
        "",
        "other commands:",
        *(f"  {c:<34}  {d}" for c, d in COMMANDS),
    ]
    return "\n".join(lines)
