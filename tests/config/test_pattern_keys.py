"""`ntp.pattern`: row_column or block per layout slot, checked before anything starts (exit 2, one
paragraph naming the key and the fix) and carried into the run's ResolvedLayout."""

from __future__ import annotations

import pytest

from ntp_nemo.config.resolve_layout import resolve_layout
from ntp_nemo.config.validate import validate
from ntp_nemo.errors import ConfigError
from tests.conftest import TINY, compose, run_cli

MESH4 = ["mesh.tp=4", "mesh.dp=1", "ntp.replica_tp=null"]
BLOCK4 = [*MESH4, "ntp.pattern=block"]


def test_block_pattern_reaches_the_layout():
    assert resolve_layout(compose([*TINY, *BLOCK4])).pattern == ("block",) * 4
    mixed = compose([*TINY, *MESH4, "ntp.pattern=[row_column,block,block,row_column]"])
    validate(mixed)
    assert resolve_layout(mixed).pattern == ("row_column", "block", "block", "row_column")
    # every slot row/column: stored empty, as the layouts written before patterns existed
    assert resolve_layout(compose([*TINY, *MESH4])).pattern == ()


@pytest.mark.parametrize("overrides,key,says", [
    (["mesh.tp=2", "mesh.dp=1", "ntp.replica_tp=null", "ntp.pattern=block"], "ntp.pattern", "square"),
    ([*MESH4, "ntp.pattern=diagonal"], "ntp.pattern", "row_column"),
    ([*MESH4, "ntp.pattern=[block,block]"], "ntp.pattern", "per layout slot"),
    ([*BLOCK4, "layout.layer_tp=[4,2,4,4]"], "ntp.pattern", "slot 1 has degree 2"),
    ([*BLOCK4, "data.micro_batch_size=1"], "data.micro_batch_size", "grid side 2"),
    ([*BLOCK4, "ntp.sequence_parallel=true"], "ntp.sequence_parallel", "ntp.pattern=row_column"),
    ([*BLOCK4, "model.dropout=0.1"], "model.dropout", "model.dropout=0"),
    ([*BLOCK4, "mesh.pp=2"], "mesh.pp", "mesh.pp=1"),
    ([*BLOCK4, "optim.distributed=true"], "optim.distributed", "optim.distributed=false"),
    ([*BLOCK4, "quant=int8"], "quant", "quant=none"),
    ([*BLOCK4, "model.init_from=/tmp"], "model.init_from", "no model.init_from"),
])
def test_bad_pattern_names_the_key_and_the_fix(overrides, key, says):
    with pytest.raises(ConfigError) as err:
        validate(compose([*TINY, *overrides]))
    assert err.value.key == key and says in str(err.value) and "ntp.pattern" in str(err.value)
    assert "\n" not in str(err.value).strip()  # one paragraph


def test_cli_refuses_block_on_a_degree_that_is_not_a_square(tmp_path):
    run = tmp_path / "run"
    proc = run_cli([*TINY, "mesh.tp=3", "mesh.dp=1", "ntp.replica_tp=null", "ntp.pattern=block",
                    f"hydra.run.dir={run}"],
                   cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "ntp.pattern" in proc.stderr and "square" in proc.stderr and "Traceback" not in proc.stderr
    assert not (run / "metrics.jsonl").exists()
