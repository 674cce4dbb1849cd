"""Integrity checked while reading, once per load; balanced writes.

A checkpoint saved by two replicas (both write: bytes per rank counted) is damaged file by file: a
flipped byte in any data file is found by the load (the cheap pre-launch check cannot see it), the
checkpoint is marked corrupt and skipped with a warning naming the file, and the previous one is
loaded; a truncated file is caught before loading.  Every record is hashed exactly once per load,
by one of the ranks that read it, also when a 3-rank layout loads the 2-rank checkpoint.
"""

from __future__ import annotations

import json
import shutil
import warnings

import numpy as np
import pytest
import torch

from ntp_nemo.checkpoint import (
    CheckpointSkippedWarning,
    CorruptCheckpointError,
    checkpoint_name,
    checkpoint_problem,
    latest_valid_checkpoint,
    load,
    load_with_fallback,
    save_checkpoint,
)
from ntp_nemo.checkpoint.storage import Index
from ntp_nemo.launch.workers import run_workers
from ntp_nemo.runtime.runtime import RankPlace
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import GPT, SEED

REPLICAS = (1, [1, 1], [1] * 4)  # two replicas of TP 1: both hold everything
SINGLE = (1, [1], [1] * 4)
TP3 = (3, [3], [3] * 4)


def _model_opt(rank: int, layout, seed: int = SEED):
    model = RankPlace(ResolvedLayout.make(Topology(*layout)), rank).build_model(GPT, seed)
    return model, torch.optim.AdamW(model.parameters())


def _values(model) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def _save_two(rank, world, directory):
    torch.set_num_threads(1)
    model, opt = _model_opt(rank, REPLICAS)
    values = {}
    for step in (1, 2):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.1 * step)
        opt.step()
        save_checkpoint(f"{directory}/{checkpoint_name(step)}", model, opt, {"n": step}, step=step)
        values[step] = _values(model)
    return values


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpts")
    values = run_workers(_save_two, 2, str(directory))
    return directory, values[0]


@pytest.fixture
def ckpts(pristine, tmp_path):
    directory = tmp_path / "checkpoints"
    shutil.copytree(pristine[0], directory)
    return directory, pristine[1]


def test_both_replicas_write_their_share(pristine):
    path = pristine[0] / checkpoint_name(2)
    per_rank = [sum(f.stat().st_size for f in path.glob(f"data_{r:05d}_*.bin")) for r in range(2)]
    assert min(per_rank) > 0.4 * sum(per_rank), per_rank
    model, _ = _model_opt(0, SINGLE)
    logical = 3 * sum(p.numel() * 4 for p in model.parameters())  # weights + two Adam moments
    assert logical <= sum(per_rank) < 1.05 * logical  # each element once (plus alignment and steps)


def _load_quietly(path, fallback=True):
    model, opt = _model_opt(0, SINGLE, seed=SEED + 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_with_fallback(path, model, opt, fallback=fallback)
    skipped = [str(w.message) for w in caught if issubclass(w.category, CheckpointSkippedWarning)]
    return loaded, model, skipped


def test_flipped_byte_in_any_data_file_is_found_on_load_and_skipped(ckpts):
    directory, values = ckpts
    latest = directory / checkpoint_name(2)
    files = sorted(latest.glob("data_*.bin"))
    assert len(files) >= 4  # several files per rank, from both ranks
    for victim in files:
        (latest / "corrupt.json").unlink(missing_ok=True)
        original = victim.read_bytes()
        raw = bytearray(original)
        raw[len(raw) // 3] ^= 0x10
        victim.write_bytes(bytes(raw))
        assert checkpoint_problem(latest) is None  # the pre-launch check reads no data
        loaded, model, skipped = _load_quietly(latest)
        assert loaded.path == directory / checkpoint_name(1) and loaded.extra == {"n": 1}
        assert len(skipped) == 1 and victim.name in skipped[0] and "xxh3_64" in skipped[0]
        assert checkpoint_name(2) in skipped[0] and str(loaded.path) in skipped[0]
        got = _values(model)
        assert all(np.array_equal(got[n], v) for n, v in values[1].items())
        # Marked: later checks (the next restart's) skip it without reading the data again.
        assert victim.name in checkpoint_problem(latest)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CheckpointSkippedWarning)
            assert latest_valid_checkpoint(directory) == directory / checkpoint_name(1)
        victim.write_bytes(original)


def test_flipped_byte_in_a_named_checkpoint_fails_naming_the_file(ckpts):
    directory, _ = ckpts
    latest = directory / checkpoint_name(2)
    victim = sorted(latest.glob("data_00001_*.bin"))[0]
    raw = bytearray(victim.read_bytes())
    raw[-100] ^= 0xFF
    victim.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError) as err:
        _load_quietly(latest, fallback=False)
    assert err.value.key == "resume" and victim.name in str(err.value) and str(latest) in str(err.value)


def test_truncated_data_file_is_skipped_before_loading(ckpts):
    directory, values = ckpts
    latest = directory / checkpoint_name(2)
    for victim in sorted(latest.glob("data_*.bin")):
        original = victim.read_bytes()
        victim.write_bytes(original[: len(original) // 2])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            chosen = latest_valid_checkpoint(directory)
        assert chosen == directory / checkpoint_name(1)
        message = str(caught[0].message)
        assert len(caught) == 1 and victim.name in message and "truncated" in message
        victim.write_bytes(original)
    # Truncated behind the manifest's back (its size rewritten too): the reader still refuses it.
    victim = sorted(latest.glob("data_*.bin"))[-1]
    victim.write_bytes(victim.read_bytes()[:-64])
    doc = json.loads((latest / "manifest.json").read_text())
    doc["files"][victim.name]["size"] -= 64
    (latest / "manifest.json").write_text(json.dumps(doc))
    loaded, _, skipped = _load_quietly(latest)
    assert loaded.path == directory / checkpoint_name(1)
    assert len(skipped) == 1 and victim.name in skipped[0]


def _load_stats(rank, world, layout, path):
    torch.set_num_threads(1)
    model, opt = _model_opt(rank, layout, seed=SEED + 1)
    loaded = load(path, model, opt)
    return loaded.stats.verified, _values(model)


def test_each_block_is_verified_once_per_load(tmp_path, monkeypatch):
    # Block digests of 4 KiB, so that this small model's records span several blocks and the TP 3
    # ranks read parts of records (each block must still be checked exactly once, by one of its readers).
    import ntp_nemo.checkpoint.storage as storage

    monkeypatch.setattr(storage, "HASH_BLOCK", 4096)
    values = run_workers(_save_two, 2, str(tmp_path))[0]
    directory = tmp_path
    path = directory / checkpoint_name(2)
    recs = [r for rs in Index.read(path).records.values() for r in rs]
    blocks = sorted((*r.rid, k) for r in recs for k in range(len(r.blocks) or 1))
    assert any(len(r.blocks) > 1 for r in recs)  # some records span several digest blocks
    one, got = _load_stats(0, 1, SINGLE, path)
    assert sorted(one) == blocks  # one process reads and checks everything, each block once
    assert all(np.array_equal(got[n], v) for n, v in values[2].items())
    three = run_workers(_load_stats, 3, TP3, str(path))
    verified = [uid for ranks_verified, _ in three for uid in ranks_verified]
    assert sorted(tuple(u) for u in verified) == blocks  # across the 3 ranks: every block once, none twice
    assert sum(1 for v, _ in three if v) >= 2  # the work is shared


def test_export_to_dcp_reads_back_with_stock_dcp(pristine, tmp_path):
    import torch.distributed.checkpoint as dcp

    from ntp_nemo.checkpoint.dcp_io import export_dcp

    directory, values = pristine
    out = export_dcp(directory / checkpoint_name(2), tmp_path / "dcp")
    assert (out / ".metadata").is_file()
    state = {f"model/{n}": torch.empty(v.shape) for n, v in values[2].items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(out), no_dist=True)
    assert all(np.array_equal(state[f"model/{n}"].numpy(), v) for n, v in values[2].items())
