"""Every command in README.md and docs/*.md, extracted from the documents and run or checked.

How each command is treated is decided by `plan()`, in this order (each rule says why):

- run: the commands that make and use files (the README's resume-on-another-layout pair, the
  Hugging Face import/train/export chain, `ntp-goodput`, the re-planning CLI) run as written in one
  scratch directory, in document order (a simple command of a project program other than `ntp-train`
  and `ntp-sim` is called in this process, with its words as `sys.argv`, as its console script calls
  it, and a `python -c CODE` or `python - <<'EOF'` snippet is compiled and run here as `__main__`: they
  then pay no interpreter, torch or transformers start-up of their own), with two mechanical changes: step
  counts are divided by `SCALE` (`trainer.max_steps=300` -> 6, `step_000300` -> `step_000006`; a recipe's own
  `trainer.max_steps` is scaled the same way) and the small model and batch of `TINY` are appended
  (not for `model.init_from` runs, whose sizes come from the Hugging Face directory). `<time>` and
  `...` placeholders of run directories are replaced by a run directory made earlier.
- config-only, `ntp-train`: every other training command (each takes minutes as written) is
  composed and put through the same checks `ntp-train` runs before launching anything.
- config-only, cluster: `torchrun` / `srun` need several machines, and `trainer.dry_run=true`
  commands rehearse layouts of hundreds of ranks; their arguments are composed and checked as above.
- config-only, `ntp-sim`: simulator studies take minutes; composed with `--cfg job`.
- exists: `python bench/*.py` benchmarks take minutes and their printed figures sit in
  docs/benchmarks.md (the suite's current results) or the doc of the decision they fed, next to the
  command; the script must exist.
- skipped: `pip install` (the checkout under test is installed already) and `pytest` (this suite).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, TINY, compose

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCALE = 50
BIN = Path(sys.executable).parent
# Runs that make files other commands use, and the commands using them, run for real.
RUN_PATTERNS = (
    "hydra.run.dir=runs/",
    "resume=runs/",
    "save_pretrained",
    "ntp-export ",
    "ntp-goodput ",
    "ntp_nemo.resilience.replan",
)
CLUSTER = ("torchrun", "srun", "sbatch", "ntp-coordinator")
PROGRAMS = {
    *("ntp-train", "ntp-sim", "ntp-goodput", "ntp-export", "ntp-plan", "ntp-preprocess"),
    *("python", "pip", "pytest", *CLUSTER),
}
# Programs called in the test process (`ntp-train` starts workers; `ntp-sim` is a Hydra application).
IN_PROCESS = ("ntp-plan", "ntp-goodput", "ntp-export", "ntp-eval", "ntp-preprocess")
# Files only the user has (their own model, data): left out of the config check.
USER_FILES = ("model.init_from=", "data.path=", "data.tokenizer=hf:")
PLACEHOLDERS = {"outputs/failover_demo/<time>": "runs/a", "outputs/...": "runs/a"}


def _strip_comment(line: str) -> str:
    """Drop a trailing `# comment` that is outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def doc_commands(path: Path) -> list[str]:
    """Shell commands of a document's ```bash blocks (and of untagged blocks whose lines start
    with `$ `): continuation lines joined, comments dropped, a heredoc kept with its command."""
    out: list[str] = []
    for lang, block in re.findall(r"```(\w*)\n(.*?)```", path.read_text(), flags=re.S):
        lines = block.splitlines()
        if lines and lines[0].startswith("#!"):  # a batch script: its program lines, variables filled in
            values = dict(re.findall(r'^(\w+)="([^"]*)"', block, flags=re.M))
            for line in lines:
                cmd = re.split(r"\s(?:\|\||&&|;|&)(?:\s|$)", _strip_comment(line).strip() + " ")[0].strip()
                if cmd.split()[:1] and cmd.split()[0] in PROGRAMS:
                    for name, value in values.items():
                        cmd = cmd.replace("$" + name, value)
                    out.append(cmd)
            continue
        if lang not in ("bash", "sh", "console"):  # untagged: command lines among printed output
            keep, cont = [], False
            for line in lines:
                words = line.split() + ["", ""]
                is_output = words[1].endswith(":") or re.search(r"\S\s{3,}[\d.]", _strip_comment(line))
                if line.startswith("$ ") or (words[0] in PROGRAMS and not is_output) or cont:
                    keep.append(line.removeprefix("$ "))
                cont = bool(keep) and keep[-1] is not None and line.rstrip().endswith("\\")
            lines = keep
        i = 0
        while i < len(lines):
            cmd = lines[i].removeprefix("$ ")
            while cmd.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd.rstrip()[:-1] + " " + lines[i].strip()
            heredoc = re.search(r"<<'?(\w+)'?", cmd)
            if heredoc:
                body = []
                while i + 1 < len(lines) and lines[i + 1].strip() != heredoc.group(1):
                    i += 1
                    body.append(lines[i])
                i += 1
                cmd = "\n".join([cmd, *body, heredoc.group(1)])
            else:
                cmd = _strip_comment(cmd)
            i += 1
            if cmd.strip():
                out.append(cmd.strip())
    return out


def all_commands() -> list[tuple[str, str]]:
    seen, out = set(), []
    for path in DOCS:
        for cmd in doc_commands(path):
            if cmd not in seen:  # the same command in two documents runs once
                seen.add(cmd)
                out.append((path.name, cmd))
    return out


def plan(cmd: str) -> tuple[str, str]:
    """(mode, reason) for one command."""
    words = cmd.split()
    if words[0] == "pip":
        return "skip", "installs the package; the checkout under test is installed already"
    if words[0] == "pytest":
        return "skip", "this test suite"
    if words[:2] == ["git", "worktree"]:
        return "skip", "checks out the commits a benchmark compares (needs the repository's history)"
    if words[0] in CLUSTER or "sbatch" in words:  # `NTP_ARGS="..." sbatch SCRIPT` too
        return "config", "needs a cluster"
    if words[0] == "python" and len(words) > 1 and words[1].startswith("bench/"):
        return "exists", "a benchmark of minutes; its figures are in docs/ next to the command"
    if words[0] == "ntp-sim":
        return "sim", "simulator studies take minutes"
    if "trainer.dry_run=true" in cmd:
        return "config", "a dry run of a cluster layout (hundreds of ranks), timed in docs/performance.md"
    if any(p in cmd for p in RUN_PATTERNS):
        return "run", "makes or uses files of the runs above"
    if words[0] == "ntp-train" or "ntp_nemo.train" in cmd:
        return "config", "trains for minutes as written"
    return "run", "quick"


def train_args(cmd: str) -> list[str]:
    words = shlex.split(cmd)
    if "sbatch" in words:  # a shipped batch script (it must exist) run with the overrides in NTP_ARGS
        at = words.index("sbatch")
        assert (ROOT / words[-1]).is_file(), cmd
        return shlex.split(dict(w.split("=", 1) for w in words[:at]).get("NTP_ARGS", ""))
    for program in ("ntp-train", "ntp-coordinator"):  # the coordinator takes the tasks' overrides
        if program in words:
            return words[words.index(program) + 1 :]
    return words[words.index("ntp_nemo.train") + 1 :]


def scaled(cmd: str, recipe_steps: int) -> str:
    """Divide step counts by SCALE; append the tiny model for a training command."""
    cmd = re.sub(r"trainer\.max_steps=(\d+)", lambda m: f"trainer.max_steps={int(m[1]) // SCALE}", cmd)
    cmd = re.sub(r"step_(\d{6})", lambda m: f"step_{int(m[1]) // SCALE:06d}", cmd)
    for old, new in PLACEHOLDERS.items():
        cmd = cmd.replace(old, new)
    if not cmd.startswith("ntp-train"):
        return cmd
    extra = [a for a in TINY if not (a.startswith("model.") and "model.init_from" in cmd)]
    extra = [a for a in extra if not a.startswith(("checkpoint.", "optim.warmup"))]
    if "trainer.max_steps=" not in cmd:
        extra.append(f"trainer.max_steps={recipe_steps // SCALE}")
    extra.append("checkpoint.every_n_steps=0")  # the final checkpoint (save_on_end) only
    return cmd + " " + " ".join(extra)


def first_job(arg: str) -> str:
    """`key=a,b` of a sweep (`-m`) -> `key=a`; lists and quoted values are kept."""
    return arg.split(",")[0] if not any(c in arg for c in "[]'\"") else arg


def check_config(args: list[str]) -> None:
    """What ntp-train checks before it launches anything, in process."""
    from ntp_nemo.config import checks
    from ntp_nemo.config.keys import check_override_keys
    from ntp_nemo.config.resolve import with_values
    from ntp_nemo.config.resolve_layout import resolve_layout
    from ntp_nemo.config.validate import validate

    args = [a for a in args if a != "-m" and not a.startswith("hydra.")]
    check_override_keys(args)
    args = [a for a in args if not a.startswith(USER_FILES)]
    overrides = [first_job(a) for a in args]
    cfg = compose(overrides)
    if cfg.model.get("init_from") == "???":
        cfg.model.init_from = None  # the recipe's Hugging Face directory is the user's
    cfg = with_values(cfg, checks.adjust(cfg))
    validate(cfg)
    checks.check_batch_split(resolve_layout(cfg), int(cfg.data.micro_batch_size))


def run_in_process(cmd: str, cwd: Path, monkeypatch, capsys):
    """A simple command (no shell syntax) of a project program called in this process: its console
    script's function (or `python -m MODULE`'s `__main__`) with the command's words as `sys.argv`, in
    `cwd`; or a Python snippet (`python -c CODE`, `python - <<'EOF'`, `_run_python`). Returns (exit code,
    stdout, stderr); None when the command is not one of those."""
    import importlib
    import runpy

    heredoc = re.fullmatch(r"python - <<'(\w+)'\n(.*)\n\1", cmd, flags=re.S)  # quoted: no expansion
    if heredoc:
        return _run_python(heredoc[2], "-", cwd, monkeypatch, capsys)
    words = shlex.split(cmd)
    if words[:2] == ["python", "-c"] and len(words) == 3 and not re.search(r"[$`]", cmd):
        return _run_python(words[2], "-c", cwd, monkeypatch, capsys)
    if re.search(r"[|&;<>$`]", cmd) or not words:
        return None
    if words[0] in IN_PROCESS:  # the checkout's own console scripts ([project.scripts] of pyproject.toml)
        text = (ROOT / "pyproject.toml").read_text()
        scripts = dict(re.findall(r'^(ntp-[\w-]+) = "([\w.]+:\w+)"', text, flags=re.M))
        module, _, name = scripts[words[0]].partition(":")
        call = getattr(importlib.import_module(module), name)
    elif words[:2] == ["python", "-m"] and words[2].startswith("ntp_nemo."):
        module, words = words[2], [words[2], *words[3:]]

        def call():
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        return None
    capsys.readouterr()
    with monkeypatch.context() as patch:
        patch.chdir(cwd)
        patch.setattr(sys, "argv", words)
        try:
            call()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def _run_python(code: str, argv0: str, cwd: Path, monkeypatch, capsys):
    """`python -c CODE` or `python - <<'EOF'` run in this process: the code compiled as the interpreter
    compiles it, run as `__main__` with fresh globals in `cwd` (the checkout's interpreter is the
    `python` of the documented command: PATH starts with its directory). An exception is the
    interpreter's exit 1 with its traceback on stderr. Returns (exit code, stdout, stderr)."""
    import traceback

    capsys.readouterr()
    with monkeypatch.context() as patch:
        patch.chdir(cwd)
        patch.setattr(sys, "argv", [argv0])
        try:
            exec(compile(code, "<string>" if argv0 == "-c" else "<stdin>", "exec"), {"__name__": "__main__"})
            rc = 0
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except Exception:  # noqa: BLE001 - what the interpreter prints before exiting 1
            traceback.print_exc()
            rc = 1
    out, err = capsys.readouterr()
    return rc, out, err


def _continued_and_exported(hf_dir: Path, out_dir: Path, cfg) -> None:
    """`ntp-train recipe=llama_tiny_from_hf model.init_from=HF` (its composed config `cfg`) continued
    from the directory's weights and `ntp-export` wrote them back: the same architecture and tensors,
    each element moved (training ran) by at most about lr per AdamW step (a fresh initialisation differs
    from the directory's by ~0.1 at its largest), and `transformers` loads the result."""
    import transformers

    from ntp_nemo.hf.config_map import hf_fields
    from tests.hf.test_export import hf_state

    mine, theirs = (json.loads((d / "config.json").read_text()) for d in (out_dir, hf_dir))
    assert hf_fields(mine) == hf_fields(theirs)
    start, end = hf_state(hf_dir), hf_state(out_dir)
    assert sorted(start) == sorted(end)
    moved = max(float((end[k] - start[k]).abs().max()) for k in start)
    assert 0.0 < moved <= 1.5 * float(cfg.optim.lr) * int(cfg.trainer.max_steps), moved
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir)
    assert loaded.config.num_key_value_heads == 2


def test_documents_have_commands():
    cmds = all_commands()
    assert len(cmds) >= 25
    modes = {plan(c)[0] for _, c in cmds}
    assert modes == {"skip", "config", "exists", "sim", "run"}


@pytest.mark.slow
def test_every_documented_command(tmp_path, monkeypatch, capsys):
    from ntp_nemo.data.tokenizer import ByteTokenizer

    exported_ids = from_hf = None
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", PYTHONUNBUFFERED="1")
    done = []
    for doc, cmd in all_commands():
        mode, why = plan(cmd)
        if mode == "skip":
            continue
        if mode == "exists":
            assert (ROOT / cmd.split()[1]).is_file(), (doc, cmd)
        elif mode == "config":
            check_config(train_args(cmd))
        elif mode == "sim":
            args = [first_job(a) for a in shlex.split(cmd) if a != "-m"]
            res = subprocess.run(
                [*args, "--cfg", "job"], cwd=tmp_path, env=env, capture_output=True, text=True
            )
            assert res.returncode == 0, (doc, cmd, res.stderr[-2000:])
        else:
            recipe = next((a.split("=", 1)[1] for a in cmd.split() if a.startswith("recipe=")), None)
            steps = int(compose([f"recipe={recipe}"] if recipe else []).trainer.max_steps)
            run = scaled(cmd, steps)
            called = run_in_process(run, tmp_path, monkeypatch, capsys)
            if called is not None:
                res = subprocess.CompletedProcess(run, *called)
            else:
                res = subprocess.run(
                    ["bash", "-c", run], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
                )
            assert res.returncode == 0, (doc, run, res.stdout[-2000:], res.stderr[-3000:])
            assert "Traceback" not in res.stderr, (doc, run, res.stderr[-3000:])
            if run.startswith("ntp-export"):
                assert "skipping checkpoint" not in res.stderr, res.stderr  # logs/, failover/ are not ones
            if run.startswith("ntp-export runs/from_hf hf_trained"):
                # The ids of the tokenizer the run trained with (bytes: 256 ends a document), not the
                # Hugging Face directory's defaults it started from (README's directory: transformers').
                started = json.loads((tmp_path / "hf_llama" / "config.json").read_text())
                assert started["eos_token_id"] != ByteTokenizer.eos_id
                exported = json.loads((tmp_path / "hf_trained" / "config.json").read_text())
                exported_ids = [exported["bos_token_id"], exported["eos_token_id"]]
                _continued_and_exported(tmp_path / "hf_llama", tmp_path / "hf_trained", from_hf)
            if "model.init_from=" in run:  # a run from a model says so in its first lines
                from_hf = compose([a for a in train_args(run) if not a.startswith("hydra.")])
                head = res.stdout.splitlines()[:3]
                said = r"model weights: initialised from \S*hf_llama"
                assert any(re.search(said, line) for line in head), head
        done.append((mode, cmd))
    ran = [c for m, c in done if m == "run"]
    assert any("resume=runs/a/checkpoints/step_000300" in c for c in ran)
    assert any(c.startswith("ntp-export") for c in ran)
    assert (tmp_path / "runs" / "b" / "checkpoints" / "step_000008" / "manifest.json").is_file()
    assert exported_ids == [ByteTokenizer.eos_id] * 2
