"""Checkpoints from elsewhere: what a crafted or damaged checkpoint directory can make a load do.

A real checkpoint (written by `save_checkpoint` in this process) is rewritten the way an attacker
would, keeping the manifest's digests right so only the new checks can refuse it: an index naming a
file outside the directory, a manifest naming one, a data file replaced by a link (to a secret, to
/dev/zero), a FIFO, a negative record offset, a 1 TiB record, deeply nested JSON.  Each is refused
before anything is read, with a message naming the checkpoint and the problem and revealing nothing
about files outside it; a load raises on every rank at once (a ConfigError, exit 2 from the CLI),
never hangs; corrupt.json is never written through a link.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import warnings

import pytest
import torch

from ntp_nemo.checkpoint import (
    CheckpointSkippedWarning,
    checkpoint_name,
    checkpoint_problem,
    latest_valid_checkpoint,
    load,
    load_with_fallback,
    require_valid_checkpoint,
    save_checkpoint,
)
from ntp_nemo.checkpoint.manifest import CORRUPT_MARKER, file_digest, mark_corrupt
from ntp_nemo.checkpoint.storage import Index, read_chunks
from ntp_nemo.errors import ConfigError
from ntp_nemo.runtime.runtime import RankPlace
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.ntp_cases import GPT, SEED

SINGLE = (1, [1], [1] * 4)


def _model():
    return RankPlace(ResolvedLayout.make(Topology(*SINGLE)), 0).build_model(GPT, SEED)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hostile")
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    for step in (1, 2):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.1 * step)
        opt.step()
        save_checkpoint(directory / checkpoint_name(step), model, opt, {"n": step}, step=step)
    return directory


@pytest.fixture
def ckpt(pristine, tmp_path):
    directory = tmp_path / "checkpoints"
    shutil.copytree(pristine, directory)
    return directory / checkpoint_name(2)


def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


def _write_manifest(path, doc):
    (path / "manifest.json").write_text(json.dumps(doc))


def _rewrite_index(path, change):
    """Apply `change` to the index and fix the manifest's size and digest of index.json, as an attacker
    who rewrites a checkpoint would (so only the new checks can tell)."""
    doc = json.loads((path / "index.json").read_text())
    change(doc)
    (path / "index.json").write_text(json.dumps(doc))
    man = _manifest(path)
    size, digest = file_digest(path / "index.json")
    man["files"]["index.json"] = {"size": size, "xxh3_64": digest}
    _write_manifest(path, man)


def _first_record(doc):
    return next(t["records"][0] for t in doc["tensors"].values() if t["records"] and t["shape"])


def _load_error(path) -> ConfigError:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointSkippedWarning)
        with pytest.raises(ConfigError) as err:
            load(path, _model(), None)
    return err.value


def _refused(path, *words):
    problem = checkpoint_problem(path)
    assert problem is not None and all(w in problem for w in words), problem
    with pytest.raises(ConfigError) as err:
        require_valid_checkpoint(path)
    assert err.value.key == "resume" and str(path) in str(err.value)
    loaded = _load_error(path)
    assert loaded.key == "resume" and all(w in str(loaded) for w in words), str(loaded)
    return problem


def test_the_pristine_checkpoint_loads(ckpt):
    assert checkpoint_problem(ckpt) is None
    assert load(ckpt, _model(), None).extra == {"n": 2}


def test_index_naming_a_file_outside_the_checkpoint_is_refused(ckpt, tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"s" * 4096)

    def point_outside(doc):
        _first_record(doc)["file"] = str(secret)

    _rewrite_index(ckpt, point_outside)
    problem = _refused(ckpt, "names a file the manifest does not list")
    assert "4096" not in problem
    with pytest.raises(ValueError, match="is damaged"):  # the export path reads the index the same way
        Index.read(ckpt)


def test_manifest_naming_a_file_outside_the_checkpoint_is_refused(ckpt):
    for name in ("/etc/passwd", "../../../../etc/passwd", "sub/../x.bin"):
        man = _manifest(ckpt)
        man["files"][name] = {"size": os.stat("/etc/passwd").st_size}
        _write_manifest(ckpt, man)
        problem = _refused(ckpt, "names a file outside the checkpoint directory")
        assert str(os.stat("/etc/passwd").st_size) not in problem.replace(name, "")
        man["files"].pop(name)
        _write_manifest(ckpt, man)
    assert checkpoint_problem(ckpt) is None


@pytest.mark.parametrize("target", ["secret", "/dev/zero"])
def test_data_file_replaced_by_a_link_is_refused_without_telling_its_size(ckpt, tmp_path, target):
    victim = sorted(ckpt.glob("data_*.bin"))[0]
    if target == "secret":
        target = tmp_path / "secret.txt"
        target.write_bytes(b"x" * 12345)
    victim.unlink()
    victim.symlink_to(target)
    problem = _refused(ckpt, victim.name, "symbolic link")
    assert "12345" not in problem


def _within(seconds, fn, *args):
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("v", fn(*args)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn.__name__} blocked for more than {seconds} s"
    return out["v"]


def test_a_fifo_named_by_a_checkpoint_never_blocks(ckpt):
    victim = sorted(ckpt.glob("data_*.bin"))[0]
    victim.unlink()
    os.mkfifo(victim)
    problem = _within(20, checkpoint_problem, ckpt)
    assert problem is not None and victim.name in problem and "not a regular file" in problem
    # The reader itself (export, a load after the check) opens nothing that could block either.
    index = Index.read(ckpt.parent / checkpoint_name(1))
    first = ckpt.parent / checkpoint_name(1)
    (first / victim.name).unlink()
    os.mkfifo(first / victim.name)
    chunks = _chunks(index)

    def read():
        try:
            read_chunks(first, chunks)
        except ValueError as err:
            return str(err)
        return None

    msg = _within(20, read)
    assert msg is not None and "not a regular file" in msg


def _chunks(index):
    from ntp_nemo.checkpoint.storage import Chunk

    return [Chunk(r.key, index.tensors[r.key].shape, r.offsets,
                  torch.empty(r.sizes, dtype=index.tensors[r.key].dtype))
            for recs in index.records.values() for r in recs]


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("offset", -64, ["negative"]),
        ("nbytes", 1 << 40, ["1099511627776 bytes"]),
        ("offset", 1 << 40, ["reaches past the end"]),
        ("sizes", [10**12], ["lies outside the tensor's shape"]),
        ("sizes", [-1], ["offsets/sizes"]),
    ],
)
def test_record_offsets_and_sizes_are_checked_before_reading(ckpt, field, value, words):
    def damage(doc):
        _first_record(doc)[field] = value

    _rewrite_index(ckpt, damage)
    _refused(ckpt, "index.json", *words)


@pytest.mark.parametrize("change,words", [("drop", ["missing or doubled", "not the"]),
                                          ("double", ["missing or doubled", "not the"])])
def test_records_that_do_not_hold_every_element_once_are_refused(ckpt, change, words):
    """A tensor's records must add up to its shape: an index that lost a writer's piece (or lists one
    twice) is refused by the cheap check, so `resume=auto` takes the step before it instead of failing
    at the load (or loading uninitialised memory for the hole)."""
    def damage(doc):
        t = next(t for t in doc["tensors"].values() if t["records"] and t["shape"])
        if change == "drop":
            t["records"].pop()
        else:
            t["records"].append(dict(t["records"][0]))

    _rewrite_index(ckpt, damage)
    _refused(ckpt, "index.json", *words)
    with pytest.warns(CheckpointSkippedWarning, match="missing or doubled"):
        assert latest_valid_checkpoint(ckpt.parent) == ckpt.parent / checkpoint_name(1)
    assert (ckpt / "index.json").exists()  # refused, not deleted


def test_deeply_nested_json_is_a_clear_problem(ckpt):
    good = (ckpt / "manifest.json").read_text()
    (ckpt / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    problem = _refused(ckpt, "manifest.json", "levels deep")
    assert len(problem) < 300
    (ckpt / "manifest.json").write_text(good)
    _rewrite_index(ckpt, lambda doc: doc["tensors"].update({"deep": json.loads("[" * 60 + "]" * 60)}))
    with open(ckpt / "index.json", "w") as f:  # nested beyond the bound, digest fixed
        f.write('{"digest":"xxh3_64","tensors":' + "[" * 5000 + "]" * 5000 + "}")
    man = _manifest(ckpt)
    size, digest = file_digest(ckpt / "index.json")
    man["files"]["index.json"] = {"size": size, "xxh3_64": digest}
    _write_manifest(ckpt, man)
    _refused(ckpt, "index.json", "levels deep")


def test_manifest_that_omits_the_index_or_the_metadata_is_refused(ckpt):
    man = _manifest(ckpt)
    man["files"].pop("meta.pt")
    _write_manifest(ckpt, man)
    _refused(ckpt, "meta.pt")


def test_corrupt_marker_is_never_written_through_a_link(ckpt, tmp_path):
    link = tmp_path / "elsewhere"
    link.symlink_to(ckpt, target_is_directory=True)
    mark_corrupt(link, "file x fails")
    assert not (ckpt / CORRUPT_MARKER).exists()
    # A data file flipped in a checkpoint reached through a link: the load fails naming the file and
    # leaves the directory it points to untouched.
    victim = sorted(ckpt.glob("data_*.bin"))[0]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    with pytest.raises(ConfigError) as err:
        load_with_fallback(link, _model(), None, fallback=False)
    assert victim.name in str(err.value)
    assert not (ckpt / CORRUPT_MARKER).exists()
    # A marker that is itself a link is not followed either (the file it points to is not overwritten).
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    (ckpt / CORRUPT_MARKER).symlink_to(outside)
    mark_corrupt(ckpt, "file x fails")
    assert outside.read_text() == "keep me"
    assert checkpoint_problem(ckpt) is not None  # a marker there, whatever it is, keeps it skipped


def test_export_reads_only_an_intact_confined_checkpoint(ckpt):
    from ntp_nemo.hf.checkpoint_source import ARG, CheckpointTensors, find_checkpoint

    assert find_checkpoint(ckpt) == ckpt
    source = CheckpointTensors(ckpt)
    names = sorted(k.removeprefix("model/") for k in source.stored if k.startswith("model/"))
    assert len(source(names[:1])) == 1
    record = max((r for k, recs in Index.read(ckpt).records.items() if k.startswith("model/") for r in recs),
                 key=lambda r: r.nbytes)
    victim = ckpt / record.file
    raw = bytearray(victim.read_bytes())
    raw[record.offset + record.nbytes // 2] ^= 0xFF  # a byte of a model weight
    victim.write_bytes(bytes(raw))
    with pytest.raises(ConfigError) as err:
        source(names)
    assert err.value.key == ARG and victim.name in str(err.value) and "intact copy" in str(err.value)
    (ckpt.parent / checkpoint_name(1) / "index.json").write_text("[" * 10_000)
    with pytest.raises(ConfigError) as err:
        find_checkpoint(ckpt.parent / checkpoint_name(1))
    assert err.value.key == ARG and "index.json" in str(err.value)


def test_records_that_overlap_although_their_counts_add_up_are_refused(ckpt):
    """Two records of one tensor that share rows while their element counts still add up to the shape
    (so one row is never written): the count check passes them; the tiling check refuses them before any
    read (before, the unwritten row came from uninitialised memory and the loss went to 4e15)."""
    def damage(doc):
        t = next(t for t in doc["tensors"].values() if len(t["shape"]) == 2 and t["shape"][0] >= 4)
        (rows, cols), whole = t["shape"], t["records"][0]
        item = whole["nbytes"] // (rows * cols)
        half = rows // 2
        first = dict(whole, offsets=[0, 0], sizes=[half, cols], nbytes=half * cols * item, blocks=[])
        second = dict(whole, offsets=[half - 1, 0], sizes=[rows - half, cols],
                      offset=whole["offset"] + (half - 1) * cols * item, nbytes=(rows - half) * cols * item,
                      blocks=[])
        t["records"] = [first, second]

    _rewrite_index(ckpt, damage)
    _refused(ckpt, "index.json", "records 0 and 1 that overlap")
    assert (ckpt / "index.json").exists()  # refused, not deleted


def _overlap_by_hand(offsets, sizes):
    cells = {}
    for i, (off, size) in enumerate(zip(offsets, sizes, strict=True)):
        import itertools

        for cell in itertools.product(*(range(o, o + s) for o, s in zip(off, size, strict=True))):
            if cell in cells:
                return True
            cells[cell] = i
    return False


def test_the_tiling_check_agrees_with_counting_every_element():
    """`overlapping_records` against the oracle that marks every element, on random boxes of one to three
    dimensions: row pieces, column pieces, grids, and boxes nudged by one."""
    import random

    from ntp_nemo.checkpoint.storage import overlapping_records

    rng = random.Random(3)
    found = 0
    for _ in range(400):
        dims = rng.randint(1, 3)
        shape = [rng.randint(1, 6) for _ in range(dims)]
        cuts = [sorted(rng.sample(range(1, n + 1), rng.randint(1, n))) for n in shape]
        import itertools

        boxes = []
        for corner in itertools.product(*([0] + c[:-1] for c in cuts)):
            off = list(corner)
            size = [c[c.index(o) + 1] - o if o in c[:-1] and c.index(o) + 1 < len(c) else
                    (c[0] - o if o == 0 else 0) for o, c in zip(off, cuts, strict=True)]
            boxes.append((off, size))
        if rng.random() < 0.5 and boxes:
            k = rng.randrange(len(boxes))
            off, size = boxes[k]
            d = rng.randrange(dims)
            off = list(off)
            off[d] = max(0, off[d] - 1)
            boxes[k] = (off, size)
        offsets, sizes = [b[0] for b in boxes], [b[1] for b in boxes]
        want = _overlap_by_hand(offsets, sizes)
        got = overlapping_records(offsets, sizes)
        assert (got is not None) == want, (offsets, sizes, got)
        found += want
    assert 50 < found < 350  # both answers were exercised
