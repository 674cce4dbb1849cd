"""A checkpoint counts only once committed and intact: manifests, corruption, `.tmp` leftovers, pruning."""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from ntp_nemo.checkpoint import (
    CheckpointSkippedWarning,
    NoUsableCheckpointError,
    checkpoint_name,
    checkpoint_problem,
    is_valid_checkpoint,
    keep_last_k,
    latest_valid_checkpoint,
    load_checkpoint,
    read_manifest,
    require_valid_checkpoint,
    save_checkpoint,
)
from ntp_nemo.errors import ConfigError
from ntp_nemo.launch.workers import run_workers
from ntp_nemo.models.model_config import ModelConfig
from ntp_nemo.runtime.runtime import RankPlace
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import GPT, SEED

LAYOUT = (2, [2], [2] * 4)


def _model(rank: int, cfg: ModelConfig = GPT, layout=LAYOUT):
    return RankPlace(ResolvedLayout.make(Topology(*layout)), rank).build_model(cfg, SEED)


def _save_two(rank, world, directory):
    torch.set_num_threads(1)
    model = _model(rank)
    opt = torch.optim.AdamW(model.parameters())
    for step in (1, 2):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.1 * step)
        opt.step()
        save_checkpoint(f"{directory}/{checkpoint_name(step)}", model, opt, {"n": step}, step=step,
                        layout={"replica_tp": LAYOUT[1]})
    # Saving the same step again replaces the committed directory.
    save_checkpoint(f"{directory}/{checkpoint_name(2)}", model, opt, {"n": 22}, step=2)
    return load_checkpoint(f"{directory}/{checkpoint_name(2)}", _model(rank))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpts")
    extras = run_workers(_save_two, 2, str(directory))
    assert extras == [{"n": 22}, {"n": 22}]
    return directory


@pytest.fixture
def ckpts(pristine, tmp_path):
    directory = tmp_path / "checkpoints"
    shutil.copytree(pristine, directory)
    return directory


def _latest(directory):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = latest_valid_checkpoint(directory)
    return chosen, [str(w.message) for w in caught if issubclass(w.category, CheckpointSkippedWarning)]


def _largest_data_file(path):
    return max(path.glob("data_*.bin"), key=lambda f: f.stat().st_size)


def test_manifest_lists_every_file_with_size_and_checksum(ckpts):
    path = ckpts / checkpoint_name(2)
    doc = read_manifest(path)
    assert doc["step"] == 2 and doc["version"] == 2
    files = sorted(f.name for f in path.iterdir() if f.name != "manifest.json")
    assert sorted(doc["files"]) == files
    assert "index.json" in files and "meta.pt" in files and any(f.startswith("data_") for f in files)
    assert all(doc["files"][f]["size"] == (path / f).stat().st_size for f in files)
    # The metadata files carry a whole-file digest; the data files' digests are per block of each record
    # in the index (and the record's digest is the digest of its block digests).
    import xxhash

    for f in ("index.json", "meta.pt"):
        assert doc["files"][f]["xxh3_64"] == xxhash.xxh3_64_hexdigest((path / f).read_bytes())
    index = json.loads((path / "index.json").read_text())
    for t in index["tensors"].values():
        for r in t["records"]:
            data = (path / r["file"]).read_bytes()[r["offset"] : r["offset"] + r["nbytes"]]
            n = r["block_bytes"]
            blocks = [xxhash.xxh3_64_hexdigest(data[i : i + n]) for i in range(0, len(data), n)]
            assert r["blocks"] == blocks and len(blocks) >= 1
            assert xxhash.xxh3_64_hexdigest("".join(blocks).encode()) == r["xxh3_64"]
    assert read_manifest(ckpts / checkpoint_name(1))["layout"] == {"replica_tp": [2]}
    assert not list(ckpts.glob("*.tmp"))


def test_latest_ignores_uncommitted_tmp_directory(ckpts):
    shutil.copytree(ckpts / checkpoint_name(2), ckpts / (checkpoint_name(3) + ".tmp"))
    (ckpts / (checkpoint_name(3) + ".tmp") / "manifest.json").unlink()
    chosen, skipped = _latest(ckpts)
    assert chosen == ckpts / checkpoint_name(2)
    assert skipped == []


def test_truncated_file_is_skipped_with_warning(ckpts):
    victim = _largest_data_file(ckpts / checkpoint_name(2))
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    chosen, skipped = _latest(ckpts)
    assert chosen == ckpts / checkpoint_name(1)
    assert len(skipped) == 1 and checkpoint_name(2) in skipped[0] and str(chosen) in skipped[0]
    assert "truncated" in skipped[0]


def test_flipped_byte_is_left_to_the_load_but_caught_by_a_full_check(ckpts):
    path = ckpts / checkpoint_name(2)
    victim = _largest_data_file(path)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    assert checkpoint_problem(path) is None  # same size: the cheap check cannot see it, the load does
    problem = checkpoint_problem(path, verify_data=True)
    assert problem is not None and victim.name in problem and "xxh3_64" in problem


def test_corrupt_metadata_file_is_caught_cheaply(ckpts):
    path = ckpts / checkpoint_name(2)
    raw = bytearray((path / "meta.pt").read_bytes())
    raw[len(raw) // 2] ^= 0x01
    (path / "meta.pt").write_bytes(bytes(raw))
    assert not is_valid_checkpoint(path)
    chosen, skipped = _latest(ckpts)
    assert chosen == ckpts / checkpoint_name(1)
    assert len(skipped) == 1 and "meta.pt fails its xxh3_64 check" in skipped[0]


def test_missing_manifest_and_wrong_version_are_skipped(ckpts):
    (ckpts / checkpoint_name(2) / "manifest.json").unlink()
    doc = read_manifest(ckpts / checkpoint_name(1))
    doc["version"] = 99
    (ckpts / checkpoint_name(1) / "manifest.json").write_text(json.dumps(doc))
    # Checkpoints there and none usable: an error naming each and why, never "no checkpoint".
    with pytest.raises(NoUsableCheckpointError) as err:
        _latest(ckpts)
    told = [why for _, why in err.value.damaged]
    assert len(told) == 2 and "manifest.json" in told[0] and "version" in told[1]
    assert latest_valid_checkpoint(ckpts / "nothing-here") is None


def test_keep_last_k_prunes_old_checkpoints_and_dead_saves(ckpts):
    shutil.copytree(ckpts / checkpoint_name(1), ckpts / (checkpoint_name(1) + ".tmp"))  # a save that died
    shutil.copytree(ckpts / checkpoint_name(2), ckpts / (checkpoint_name(3) + ".tmp"))  # a save in flight
    assert keep_last_k(ckpts, None) == []
    removed = keep_last_k(ckpts, 1)
    assert sorted(p.name for p in removed) == [checkpoint_name(1), checkpoint_name(1) + ".tmp"]
    assert sorted(p.name for p in ckpts.iterdir()) == [checkpoint_name(2), checkpoint_name(3) + ".tmp"]


def test_bad_explicit_path_is_a_config_error(ckpts):
    with pytest.raises(ConfigError, match="does not exist") as err:
        require_valid_checkpoint(ckpts / "step_999999")
    assert err.value.key == "resume"
    (ckpts / checkpoint_name(2) / "meta.pt").unlink()
    with pytest.raises(ConfigError, match="meta.pt is missing"):
        require_valid_checkpoint(ckpts / checkpoint_name(2), key="resume")
    assert require_valid_checkpoint(ckpts / checkpoint_name(1)) == ckpts / checkpoint_name(1)


def _load_error(rank, world, path, cfg):
    torch.set_num_threads(1)
    try:
        load_checkpoint(path, _model(rank, cfg, (1, [1], [1] * 4)))
    except ConfigError as err:  # ConfigError does not unpickle; send its parts
        return err.key, str(err)
    return None


def _one_process(fn, *args):
    ctx = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(fn, 0, 1, *args).result()


def test_load_refuses_corrupt_or_foreign_checkpoint(ckpts):
    victim = _largest_data_file(ckpts / checkpoint_name(2))
    victim.write_bytes(victim.read_bytes()[:-10])
    key, msg = _one_process(_load_error, str(ckpts / checkpoint_name(2)), GPT)
    assert key == "resume" and "truncated" in msg
    wider = ModelConfig(**{**GPT.__dict__, "hidden_size": 50})
    key, msg = _one_process(_load_error, str(ckpts / checkpoint_name(1)), wider)
    assert key == "resume" and "different model" in msg and "has shape (50,), the checkpoint (40,)" in msg


def _save_bad_extra(rank, world, directory):
    torch.set_num_threads(1)
    try:
        save_checkpoint(f"{directory}/{checkpoint_name(1)}", _model(rank, GPT, (1, [1], [1] * 4)), None,
                        {"where": Path(directory)}, step=1)
    except TypeError as err:
        return str(err)
    return None


def test_extra_that_cannot_reload_safely_is_refused_before_writing(tmp_path):
    msg = _one_process(_save_bad_extra, str(tmp_path))
    assert msg is not None and "weights_only" in msg
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_marked_corrupt_is_skipped_cheaply_and_not_counted_by_keep_last(ckpts):
    from ntp_nemo.checkpoint.manifest import mark_corrupt

    mark_corrupt(ckpts / checkpoint_name(2), "file data_00000_0.bin fails its xxh3_64 check (corrupted)")
    chosen, skipped = _latest(ckpts)
    assert chosen == ckpts / checkpoint_name(1)
    assert len(skipped) == 1 and "data_00000_0.bin fails its xxh3_64 check" in skipped[0]
    assert keep_last_k(ckpts, 1) == []  # the newest valid one stays; the corrupt one is left for inspection
    assert sorted(p.name for p in ckpts.iterdir()) == [checkpoint_name(1), checkpoint_name(2)]


def test_a_rotation_killed_halfway_leaves_no_committed_looking_checkpoint(ckpts, monkeypatch):
    """The process deleting an old checkpoint dies after its first file (the soak met it: a live job's
    rank 0 lost during keep_last left `step_000175` with half its data files, reported damaged at every
    resume and never deleted)."""
    real_rmtree = shutil.rmtree

    def killed(path, *args, **kwargs):
        next(p for p in Path(path).iterdir() if p.is_file()).unlink()
        raise KeyboardInterrupt  # the process dies here

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        keep_last_k(ckpts, 1)
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    assert [p.name for p in ckpts.iterdir() if not p.name.startswith(".")] == [checkpoint_name(2)]
    assert latest_valid_checkpoint(ckpts) == ckpts / checkpoint_name(2)
    keep_last_k(ckpts, 1)  # the next rotation removes what the dead one left
    assert sorted(p.name for p in ckpts.iterdir()) == [checkpoint_name(2)]
