"""The `bitflip` and `poison_sample` fault kinds and the `integrity` group: seeded values, and a bad
value answered with a one-paragraph error naming the key (in process, as `ntp-train` checks it)."""

from __future__ import annotations

import pytest

from ntp_nemo.errors import ConfigError
from tests.conftest import compose, run_cli


def _check(overrides: list[str]):
    from ntp_nemo.config.data_keys import explicit_keys
    from ntp_nemo.resilience.fault_config import resolve_faults
    from ntp_nemo.train import check_config

    spec = check_config(compose(["trainer.max_steps=8", *overrides]), explicit_keys(overrides))
    return resolve_faults(spec.failover), spec.failover.integrity


def test_corrupting_faults_resolve_seeded():
    faults, _ = _check(["fault=bitflip", "fault.rank=1", "fault.step=3"])
    (f,) = faults
    assert (f.kind, f.target, f.rank, f.step, f.bit, f.persistent, f.once) == ("bitflip", "param", 1, 3, 22,
                                                                               False, True)
    (g,) = _check(["fault=bitflip", "fault.target=grad", "fault.persistent=true"])[0]
    assert (g.target, g.bit, g.once) == ("grad", 30, False)  # a bad device fires on every step
    (p,) = _check(["fault=poison_sample", "fault.step=2"])[0]
    assert (p.kind, p.step, p.sample) == ("poison_sample", 2, None)
    assert _check(["fault=poison_sample", "fault.step=2"])[0] == [p]  # the same draws from the same seed
    assert _check(["fault=poison_sample", "fault.step=2", "seed=5"])[0][0].draw != p.draw
    _, integrity = _check(["integrity.every_n_steps=5", "integrity.skip_samples=[3,9]"])
    assert (integrity.every_n_steps, list(integrity.skip_samples)) == (5, [3, 9])


@pytest.mark.parametrize("overrides, key, words", [
    (["fault=bitflip", "fault.target=weights"], "fault.target", "unknown bitflip target"),
    (["fault=bitflip", "fault.bit=40"], "fault.bit", "0..31"),
    (["fault=kill_rank", "fault.bit=3"], "fault.bit", "bitflip only"),
    (["fault=hang", "fault.persistent=true"], "fault.persistent", "bitflip only"),
    (["fault=bitflip", "fault.sample=4"], "fault.sample", "poison_sample only"),
    (["fault=poison_sample", "fault.sample=-1"], "fault.sample", ">= 0"),
    (["integrity.every_n_steps=-1"], "integrity.every_n_steps", ">= 0"),
    (["integrity.spike_window=1"], "integrity.spike_window", ">= 3"),
    (["integrity.outlier_ratio=0.5"], "integrity.outlier_ratio", "e.g. 1000"),
    (["integrity.skip_samples=[-2]"], "integrity.skip_samples", "ntp-incidents"),
])
def test_bad_values_name_the_key(overrides, key, words):
    with pytest.raises(ConfigError) as err:
        _check(overrides)
    assert err.value.key == key and words in str(err.value)
    assert "\n" not in str(err.value)


def test_cli_exit_code(tmp_path):
    """The command line answers the same check with exit code 2 and no traceback."""
    proc = run_cli(["fault=bitflip", "fault.target=weights", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "fault.target" in proc.stderr and "Traceback" not in proc.stderr
