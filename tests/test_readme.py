"""Every `ntp-train` example in the README composes and validates (the README stays true)."""

from __future__ import annotations

import re
import shlex

import pytest

from ntp_nemo.config.validate import resolve_layer_tp, validate
from tests.conftest import ROOT, compose

SKIP_KEYS = ("hydra.", "resume=", "model.init_from=")  # paths that only exist in the user's session


def readme_examples() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            if "ntp-train" not in line:
                continue
            args = shlex.split(line[line.index("ntp-train") + len("ntp-train"):])
            out.append([a for a in args if a != "-m" and not a.startswith(SKIP_KEYS)])
    return out


def test_readme_has_examples():
    assert len(readme_examples()) >= 8


@pytest.mark.parametrize("args", readme_examples(), ids=lambda a: " ".join(a) or "(default)")
def test_readme_example_validates(args):
    overrides = []
    for a in args:
        key, _, value = a.partition("=")
        overrides += [f"{key}={v}" for v in value.split(",")][:1] if key == "optim.lr" else [a]
    cfg = compose(overrides)
    if cfg.model.get("init_from", None) == "???":
        pytest.skip("needs a Hugging Face directory")
    validate(cfg)
    resolve_layer_tp(cfg)
