"""Packages import downward only, in the order of the layer diagram of docs/architecture.md (the one list of
the layers: `tests/house/test_architecture.py` checks the rest of that page against the code).

What counts as a reference to a package: `import ntp_nemo.x`, `from ntp_nemo.x import y`, `from ntp_nemo
import x`, relative imports (`from ..x import y`, resolved against the file's package), string constants
passed to `importlib.import_module` / `import_module` / `__import__`, and `_target_` strings naming a
project class (a `_target_` field, keyword or dict key in Python; a `_target_:` line in the YAML configs).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "ntp_nemo"
IMPORTERS = {"import_module", "__import__"}

# Known upward references, each with its reason (file, referenced module) -> why.
KNOWN = {
    ("ntp_nemo/quant/qat_config.py", "ntp_nemo.lightning.qat.QuantizationCallback"): (
        "QuantConfig's `_target_` (and conf/quant/*.yaml's) names the callback `lightning/factory.py` builds "
        "from `quant.format`; nothing instantiates it from the string. Dropping it means changing the "
        "schema and the four conf/quant files together."
    ),
    **{
        (f"conf/quant/{name}.yaml", "ntp_nemo.lightning.qat.QuantizationCallback"): "as quant/qat_config.py"
        for name in ("none", "int8", "fp8", "nvfp4")
    },
}


def _levels(text: str | None = None) -> dict[str, int]:
    """{package: level} from the diagram (the first ```text block) of docs/architecture.md's "The layers":
    rows `N │ names │ what they hold`, a row without a number continuing the one above."""
    text = text if text is not None else (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## The layers", 1)[1].split("\n## ", 1)[0]
    diagram = section.split("```text\n", 1)[1].split("```", 1)[0]
    levels: dict[str, int] = {}
    level = None
    for line in diagram.splitlines():
        m = re.match(r"^\s*(\d*)\s*│([^│]*)│", line)
        if m:
            level = int(m.group(1)) if m.group(1) else level
            for name in m.group(2).split():
                levels[name] = level
    return levels


def _absolute(node: ast.ImportFrom, package: str) -> str:
    """The module an `ImportFrom` names, relative ones resolved against `package` (dotted)."""
    if node.level == 0:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join([*base, node.module] if node.module else base)


def _string(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _imports(tree: ast.AST, package: str = "ntp_nemo") -> list[tuple[int, str]]:
    """(line, dotted module or class) of every reference to a module in `tree`; `package`: the dotted
    package of the file (for relative imports)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = _absolute(node, package)
            if module == "ntp_nemo" or node.module is None:
                # `from ntp_nemo import x`, `from . import x`: x is a package or module.
                out.extend((node.lineno, f"{module}.{a.name}") for a in node.names)
            else:
                out.append((node.lineno, module))
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in IMPORTERS and node.args and (value := _string(node.args[0])) is not None:
                out.append((node.lineno, value))
            for kw in node.keywords:
                if kw.arg == "_target_" and (value := _string(kw.value)) is not None:
                    out.append((node.lineno, value))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {getattr(t, "id", getattr(t, "attr", None)) for t in targets}
            if "_target_" in names and (value := _string(node.value)) is not None:
                out.append((node.lineno, value))
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if key is not None and _string(key) == "_target_" and (text := _string(value)) is not None:
                    out.append((node.lineno, text))
    return out


def _upward(levels: dict[str, int], me: str, module: str) -> bool:
    names = module.split(".")
    return names[0] == "ntp_nemo" and len(names) > 1 and levels.get(names[1], 0) > levels[me]


def _yaml_targets(path: Path) -> list[tuple[int, str, bool]]:
    """(line, `_target_` value, inside the `hydra:` node) of a YAML config file."""
    out, in_hydra = [], False
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if line and not line[0].isspace() and not line.startswith("#"):
            in_hydra = line.startswith("hydra:")
        m = re.match(r"^\s*_target_:\s*['\"]?([\w.]+)", line)
        if m:
            out.append((lineno, m.group(1), in_hydra))
    return out


def test_readme_names_every_package():
    levels = _levels()
    packages = {p.name.removesuffix(".py") for p in PKG.iterdir()
                if (p.suffix == ".py" or (p / "__init__.py").exists()) and p.name != "__init__.py"}
    assert packages - set(levels) == set(), "packages missing from the diagram of docs/architecture.md"
    assert set(levels) - packages == set(), "docs/architecture.md's diagram names packages that do not exist"


def test_packages_import_downward_only():
    levels = _levels()
    upward, known = [], set()
    for f in sorted(PKG.rglob("*.py")):
        parts = f.relative_to(PKG).parts
        me = parts[0].removesuffix(".py")
        if me == "__init__":
            continue
        rel = f.relative_to(ROOT).as_posix()
        package = ".".join(["ntp_nemo", *parts[:-1]])
        for lineno, module in _imports(ast.parse(f.read_text()), package):
            if _upward(levels, me, module):
                if (rel, module) in KNOWN:
                    known.add((rel, module))
                else:
                    upward.append(f"{rel}:{lineno} imports {module}")
    assert upward == []
    py_known = {k for k in KNOWN if k[0].endswith(".py")}
    assert known == py_known, f"listed exceptions that no longer occur: {sorted(py_known - known)}"


def test_config_files_name_classes_of_their_level():
    """A YAML group named after a package (conf/quant/) is that package's; other config files are the
    `config` package's; targets under `hydra:` are instantiated by Hydra in the entry point (any level)."""
    levels = _levels()
    upward, known = [], set()
    for f in sorted([*(ROOT / "conf").rglob("*.yaml"), *(ROOT / "recipes").glob("*.yaml")]):
        rel = f.relative_to(ROOT).as_posix()
        group = f.relative_to(ROOT).parts[1] if f.parent != ROOT / "conf" else ""
        me = group if group in levels else "config"
        for lineno, target, in_hydra in _yaml_targets(f):
            if not in_hydra and _upward(levels, me, target):
                if (rel, target) in KNOWN:
                    known.add((rel, target))
                else:
                    upward.append(f"{rel}:{lineno} names {target}")
    assert upward == []
    yaml_known = {k for k in KNOWN if k[0].endswith(".yaml")}
    assert known == yaml_known, f"listed exceptions that no longer occur: {sorted(yaml_known - known)}"


def test_the_check_sees_every_way_of_naming_a_package(tmp_path):
    source = "\n".join([
        "def f():",
        "    from ntp_nemo.lightning.lm_module import NTPLightningModule",  # 2: absolute
        "    from ..lightning import module",  # 3: relative, from ntp_nemo/topology/x.py
        "    from . import groups",  # 4: relative, same package
        "    from ntp_nemo import resilience",  # 5: the root package
        "    importlib.import_module('ntp_nemo.cli.plan')",  # 6: a string for importlib
        "    import_module('ntp_nemo.train')",  # 7
        "    x = {'_target_': 'ntp_nemo.lightning.qat.QuantizationCallback'}",  # 8
        "    _target_: str = 'ntp_nemo.sweep.SweepSummaryCallback'",  # 9
        "    instantiate(_target_='ntp_nemo.resilience.supervisor.Supervisor')",  # 10
        "    from .. import runtime",  # 11
    ])
    got = sorted(_imports(ast.parse(source), "ntp_nemo.topology"))
    assert got == [
        (2, "ntp_nemo.lightning.lm_module"),
        (3, "ntp_nemo.lightning"),
        (4, "ntp_nemo.topology.groups"),
        (5, "ntp_nemo.resilience"),
        (6, "ntp_nemo.cli.plan"),
        (7, "ntp_nemo.train"),
        (8, "ntp_nemo.lightning.qat.QuantizationCallback"),
        (9, "ntp_nemo.sweep.SweepSummaryCallback"),
        (10, "ntp_nemo.resilience.supervisor.Supervisor"),
        (11, "ntp_nemo.runtime"),
    ]
    levels = _levels()
    assert levels["lightning"] > levels["topology"]
    assert [m for _, m in got if _upward(levels, "topology", m)] == [m for _, m in got if "topology" not in m]
    yaml = tmp_path / "x.yaml"
    yaml.write_text("a:\n  _target_: ntp_nemo.lightning.qat.QuantizationCallback\nhydra:\n  callbacks:\n"
                    "    s:\n      _target_: 'ntp_nemo.sweep.SweepSummaryCallback'\n")
    assert _yaml_targets(yaml) == [(2, "ntp_nemo.lightning.qat.QuantizationCallback", False),
                                   (6, "ntp_nemo.sweep.SweepSummaryCallback", True)]


def test_the_diagram_is_read_row_by_row():
    text = ("## The layers\n\n```text\n 2 │ a  b │ what a and b hold\n   │ d    │ continued\n"
            "   │      │ more\n 1 │ c    │ c\n```\n## Next\n")
    assert _levels(text) == {"a": 2, "b": 2, "d": 2, "c": 1}
    levels = _levels()
    assert sorted(set(levels.values())) == list(range(1, 10))
    assert levels["errors"] == 1 and levels["train"] == 9 and levels["resilience"] == 8
