"""Lightning's private state is touched in one file, `ntp_nemo/lightning/adapter.py`, which names the
Lightning releases it was checked against; the strategy takes its options in its constructor and its
recovery behaviour through one `RecoveryHooks` object.

What counts as touching a private attribute (an AST walk, no import of the code): `x._name` (read,
write or call) and `getattr/setattr/hasattr/delattr(x, "_name")`, where `x` is not `self`, `cls` or
`super()` and `_name` is not a dunder, and `_name` is a private name of Lightning (every `self._name`
and every `def _name` in lightning.pytorch and lightning.fabric) or of ntp_nemo's Lightning objects
(the same in ntp_nemo/lightning/: the strategy, the module, the callbacks).
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "ntp_nemo"
ADAPTER = "ntp_nemo/lightning/adapter.py"
PRIVATE = re.compile(r"\bself\.(_\w+)|\bdef\s+(_\w+)")

# Accesses outside ntp_nemo/lightning/ whose name is also a Lightning private name but whose object is
# not a Lightning object nor the strategy: (file, name) -> what the object is.
NOT_LIGHTNING = {
    ("ntp_nemo/quant/sharding.py", "_modules"): "a modelopt quantised layer's torch submodule registry",
    ("ntp_nemo/topology/groups.py", "_timeout"): "a torch process group backend's options",
    ("ntp_nemo/parallel/sequence.py", "_version"): "a torch tensor's version counter (in-place writes)",
    ("ntp_nemo/resilience/nccl_abort.py", "_world"): "torch.distributed's registry of process groups",
}


def _private_names(files) -> set[str]:
    names: set[str] = set()
    for f in files:
        try:
            tree = ast.parse(Path(f).read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "self"):
                name = node.attr
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = node.name
            else:
                continue
            if name.startswith("_") and not name.startswith("__"):
                names.add(name)
    return names


@functools.cache
def lightning_private_names() -> frozenset[str]:
    """`self._name` and `def _name` in Lightning's source (a regular expression: parsing all of it takes
    many seconds on a loaded machine)."""
    import importlib.util

    src = Path(importlib.util.find_spec("lightning").origin).parent  # not imported: ~10 s
    names = set()
    for f in [*(src / "pytorch").rglob("*.py"), *(src / "fabric").rglob("*.py")]:
        for attr, fn in PRIVATE.findall(f.read_text(errors="replace")):
            names.add(attr or fn)
    return frozenset(n for n in names if not n.startswith("__"))


def own_private_names(pkg: Path = PKG) -> set[str]:
    return _private_names((pkg / "lightning").glob("*.py"))


def _is_self(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def private_accesses(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, private name, source text) of every private attribute access on an object other than
    self/cls/super()."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name, base = node.attr, node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            name, base = node.args[1].value, node.args[0]
        else:
            continue
        if name.startswith("_") and not name.startswith("__") and not _is_self(base):
            out.append((node.lineno, name, ast.unparse(node)))
    return out


def private_lightning_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of every import of a private Lightning module or name."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lightning":
            parts = node.module.split(".")
            for alias in node.names:
                if any(p.startswith("_") for p in parts) or alias.name.startswith("_"):
                    out.append((node.lineno, f"{node.module}.{alias.name}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "lightning" and any(p.startswith("_") for p in parts):
                    out.append((node.lineno, alias.name))
    return out


def lightning_touches_outside(pkg: Path = PKG) -> list[str]:
    """Every access, outside ntp_nemo/lightning/, to a private attribute of a Lightning object or of
    the strategy (and every private Lightning import outside the adapter), as `file:line: text`."""
    names = lightning_private_names() | own_private_names(pkg)
    found = []
    for path in sorted(pkg.rglob("*.py")):
        rel = f"ntp_nemo/{path.relative_to(pkg).as_posix()}"
        tree = ast.parse(path.read_text())
        if rel != ADAPTER:
            found += [f"{rel}:{line}: import {what}" for line, what in private_lightning_imports(tree)]
        if rel.startswith("ntp_nemo/lightning/"):
            continue
        found += [f"{rel}:{line}: {text}" for line, name, text in sorted(private_accesses(tree))
                  if name in names and (rel, name) not in NOT_LIGHTNING]
    return found


def test_nothing_outside_the_lightning_package_touches_private_lightning_or_strategy_state():
    found = lightning_touches_outside()
    assert not found, (
        "private state of a Lightning object or of NTPStrategy used outside ntp_nemo/lightning/ (give the "
        "strategy a public method, a RecoveryHooks hook, or a function in ntp_nemo/lightning/adapter.py):\n"
        + "\n".join(found))


def _defined_names(files) -> set[str]:
    """Private names a file defines itself: `def _name`, `_name = ...` in a class, `self._name = ...`."""
    names: set[str] = set()
    for f in files:
        for node in ast.walk(ast.parse(Path(f).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Name):
                        names.add(t.id)
                    elif isinstance(t, ast.Attribute) and _is_self(t.value):
                        names.add(t.attr)
    return {n for n in names if n.startswith("_")}


def test_inside_the_lightning_package_only_the_adapter_touches_lightnings_private_state():
    """The strategy, the module and the callbacks use Lightning's private names only through the
    adapter: no private Lightning import, and no `x._name` or `self._name` that is Lightning's and not
    an attribute or method they define themselves."""
    files = [f for f in sorted((PKG / "lightning").glob("*.py")) if f.name != "adapter.py"]
    lightning_only = lightning_private_names() - _defined_names(files)
    found = []
    for path in files:
        tree = ast.parse(path.read_text())
        found += [f"ntp_nemo/lightning/{path.name}:{line}: import {what}"
                  for line, what in private_lightning_imports(tree)]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in lightning_only:
                found.append(f"ntp_nemo/lightning/{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "Lightning's private state outside the adapter:\n" + "\n".join(found)


def test_the_check_sees_the_accesses_it_is_for(tmp_path):
    """The walk itself: on a package written here, the kinds of access the live path once made are
    found, `self._x`, a project object's own private attribute and the allow-listed ones are not."""
    pkg = tmp_path / "ntp_nemo"
    (pkg / "lightning").mkdir(parents=True)
    (pkg / "resilience").mkdir()
    (pkg / "lightning" / "strategy.py").write_text(
        "class S:\n    def __init__(self):\n        self._saver = None\n        self._timeout = 1\n")
    (pkg / "resilience" / "live.py").write_text(
        "from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher\n"
        "def f(trainer, strategy, thing):\n"
        "    trainer.strategy._launcher = None\n"
        "    trainer.fit_loop.epoch_loop.val_loop._combined_loader = None\n"
        "    trainer._checkpoint_connector.dump_checkpoint()\n"
        "    strategy._timeout.total_seconds()\n"
        "    getattr(strategy, '_saver', None)\n"
        "    thing._private_to_the_project = 1\n"
        "    return self._launcher\n")
    found = lightning_touches_outside(pkg)
    assert [f.split(": ", 1)[1] for f in found] == [
        "import lightning.pytorch.strategies.launchers.multiprocessing._MultiProcessingLauncher",
        "trainer.strategy._launcher",
        "trainer.fit_loop.epoch_loop.val_loop._combined_loader",
        "trainer._checkpoint_connector",
        "strategy._timeout",
        "getattr(strategy, '_saver', None)",
    ], found


def test_the_installed_lightning_is_one_the_adapter_supports():
    from ntp_nemo.lightning.adapter import lightning_version_problem

    problem = lightning_version_problem()
    assert problem is None, problem


def test_an_unsupported_lightning_is_named_with_the_fix():
    from ntp_nemo.lightning.adapter import SUPPORTED_LIGHTNING, lightning_version_problem

    assert lightning_version_problem(f"{SUPPORTED_LIGHTNING[-1]}.3") is None
    problem = lightning_version_problem("3.1.0")
    assert problem is not None
    assert "Lightning 3.1.0 is installed" in problem and "SUPPORTED_LIGHTNING" in problem
    assert "ntp_nemo/lightning/adapter.py" in problem
    assert lightning_version_problem("2.10.0") is not None  # not read as 2.1


def test_the_strategy_takes_its_options_and_hooks_in_its_constructor():
    import torch

    from ntp_nemo.lightning.hooks import RecoveryHooks
    from ntp_nemo.lightning.strategy import NTPStrategy
    from ntp_nemo.topology import ResolvedLayout, Topology

    layout = ResolvedLayout.make(Topology(1, [1, 1], [1] * 4))  # two replicas of TP 1, two layers
    hooks = RecoveryHooks()
    s = NTPStrategy(layout, keep_last=3, async_save=True, allow_cross_node_tp=True, recovery=hooks,
                    parallel_devices=[torch.device("cpu")] * 2)
    assert (s.keep_last, s.async_save, s.allow_cross_node_tp, s.recovery) == (3, True, True, hooks)
    assert s.parallel_devices == [torch.device("cpu")] * 2
    plain = NTPStrategy(layout)
    assert type(plain.recovery) is RecoveryHooks and plain.keep_last is None and not plain.async_save
