"""Packages import downward only, in the order the README's "Layout of the code" section gives."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _levels() -> dict[str, int]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Layout of the code", 1)[1].split("\n## ", 1)[0]
    levels: dict[str, int] = {}
    for line in section.splitlines():
        m = re.match(r"^(\d+)\. (.*?):", line)
        if m:
            for name in re.findall(r"`(\w+)`", m.group(2)):
                levels[name] = int(m.group(1))
    return levels


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
    return out


def test_readme_names_every_package():
    levels = _levels()
    packages = {p.name.removesuffix(".py") for p in (ROOT / "ntp_nemo").iterdir()
                if (p.suffix == ".py" or (p / "__init__.py").exists()) and p.name != "__init__.py"}
    assert packages - set(levels) == set(), "packages missing from the README's Layout of the code"
    assert set(levels) - packages == set(), "the README names packages that do not exist"


def test_packages_import_downward_only():
    levels = _levels()
    upward = []
    for f in sorted((ROOT / "ntp_nemo").rglob("*.py")):
        parts = f.relative_to(ROOT / "ntp_nemo").parts
        me = parts[0].removesuffix(".py")
        if me == "__init__":
            continue
        for lineno, module in _imports(ast.parse(f.read_text())):
            names = module.split(".")
            if names[0] == "ntp_nemo" and len(names) > 1 and levels.get(names[1], 0) > levels[me]:
                upward.append(f"{f.relative_to(ROOT)}:{lineno} imports {module}")
    assert upward == []


def test_the_check_sees_an_upward_import(tmp_path):
    tree = ast.parse("def f():\n    from ntp_nemo.lightning.module import NTPLightningModule\n")
    assert _imports(tree) == [(2, "ntp_nemo.lightning.module")]
    assert _levels()["lightning"] > _levels()["topology"]
