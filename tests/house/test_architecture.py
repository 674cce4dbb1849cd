"""docs/architecture.md agrees with the code: every module and function it names exists, its table of
console scripts is pyproject.toml's, and the README links it first. (The diagram's layers are the ones
`tests/house/test_layering.py` reads and checks every import against.)"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
# `path.py`, `path.py: name` or `path.py: Class.method` in backticks; also conf/, bench/, tests/ paths.
REF = re.compile(r"`((?:ntp_nemo|bench|tests|conf|recipes)/[\w/.]*?)(?:: ([\w.]+))?`")


def references(text: str) -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(2)) for m in REF.finditer(text)]


def defines(tree: ast.Module, dotted: str) -> bool:
    """Whether `tree` defines `dotted`: a function, class or assigned name at module level, or
    `Class.attr`."""
    head, _, rest = dotted.partition(".")
    for node in tree.body:
        names: list[str] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = [node.target.id]
        if head in names:
            if not rest:
                return True
            if isinstance(node, ast.ClassDef):
                return defines(ast.Module(body=node.body, type_ignores=[]), rest)
    return False


def unresolved(text: str, root: Path = ROOT) -> list[str]:
    out = []
    for path, name in references(text):
        f = root / path
        if not f.exists():
            out.append(f"{path}: no such file")
        elif name is not None and not defines(ast.parse(f.read_text()), name):
            out.append(f"{path}: {name} is not defined there")
    return out


def test_every_named_module_and_function_exists():
    text = DOC.read_text()
    refs = references(text)
    assert len(refs) > 40  # the life of a run and of a recovery name their functions
    assert unresolved(text) == []


def test_the_check_fails_on_a_name_that_is_gone(tmp_path):
    (tmp_path / "ntp_nemo").mkdir()
    (tmp_path / "ntp_nemo" / "m.py").write_text("class A:\n    def run(self): ...\n\nmain = print\n")
    text = ("`ntp_nemo/m.py: A.run` `ntp_nemo/m.py: main` `ntp_nemo/m.py: A.gone` `ntp_nemo/x.py` "
            "`ntp_nemo/m.py`")
    assert unresolved(text, tmp_path) == ["ntp_nemo/m.py: A.gone is not defined there",
                                          "ntp_nemo/x.py: no such file"]


def test_console_scripts_table_is_pyprojects():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    rows = {name: f"{path.replace('/', '.')}:{func}" for name, path, func in
            re.findall(r"^\| `([\w-]+)` \| `(ntp_nemo/[\w/]+)\.py: (\w+)` \|$", DOC.read_text(), flags=re.M)}
    assert rows == scripts


def test_console_scripts_live_in_cli():
    """Every console script's function is the `main` of a module of `ntp_nemo/cli/` named for its command
    (`ntp-plan` -> `ntp_nemo.cli.plan`; `ntp-eval` -> `ntp_nemo.cli.evaluate`): one place to find them."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    elsewhere = {}
    for command, target in scripts.items():
        module, _, func = target.partition(":")
        package, _, name = module.rpartition(".")
        if package != "ntp_nemo.cli" or func != "main" or not name.startswith(command.removeprefix("ntp-")):
            elsewhere[command] = target
    assert len(scripts) >= 10 and not elsewhere, elsewhere


def test_readme_links_the_architecture_first():
    readme = (ROOT / "README.md").read_text()
    docs = re.findall(r"`(docs/\w+\.md)`", readme.split("## Documentation", 1)[1])
    assert docs[0] == "docs/architecture.md"
    assert "docs/architecture.md" in readme.split("\n## ", 1)[0]  # named in the introduction too


def test_module_names_say_what_they_hold():
    """No two modules of the package share a file name, except the entry points of `ntp_nemo/cli/`, each
    named for its command (`cli/plan.py` runs `ntp-plan`): a reader who meets `layout.py` in a traceback
    knows which one it is."""
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "ntp_nemo").rglob("*.py")):
        rel = path.relative_to(ROOT / "ntp_nemo")
        if path.name == "__init__.py" or rel.parts[0] == "cli":
            continue
        seen.setdefault(path.name, []).append(str(rel))
    twice = {name: where for name, where in seen.items() if len(where) > 1}
    assert not twice, f"module names used more than once: {twice}"


MAIN_PATH = ("ntp_nemo/train.py", "ntp_nemo/cli/train.py", "ntp_nemo/resilience/supervisor.py",
             "ntp_nemo/lightning/factory.py")
MAIN_PATH_MOST_LINES = 60


def long_functions(source: str, most: int) -> list[tuple[str, int]]:
    """(name, lines) of each function of `source` longer than `most` lines (docstring included)."""
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > most]


def test_main_path_functions_read_as_named_stages():
    """From `ntp-train` to Lightning's loop (the CLI, `train`, the supervisor, the trainer's factory) no
    function is longer than MAIN_PATH_MOST_LINES: a long one is split into stages named for what they do
    (docs/architecture.md's life of a run names them)."""
    long = {path: found for path in MAIN_PATH
            if (found := long_functions((ROOT / path).read_text(), MAIN_PATH_MOST_LINES))}
    assert not long, long
    body = "\n".join(f"    x{i} = {i}" for i in range(MAIN_PATH_MOST_LINES))
    assert long_functions(f"def f():\n{body}\n", MAIN_PATH_MOST_LINES) == [("f", MAIN_PATH_MOST_LINES + 1)]
