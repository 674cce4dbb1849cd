"""Weighted blends of token files: exact proportions, no repeats before a pass is used up, and the
same samples in the same order on layouts (1), (2,1), (3,2) and after a resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ntp_nemo.data.prepare import build_data
from ntp_nemo.data.rebalance import assign_microbatches, replica_microbatch_slices
from ntp_nemo.data.tokens import TokenFileWriter
from ntp_nemo.errors import ConfigError
from ntp_nemo.lightning.batches import StepBatches

SEQ, GBS, MBS = 16, 12, 2
SIZES = {"a": 4000, "b": 1500, "c": 700}  # tokens; source s holds ids in [100*s, 100*s + 100)
WEIGHTS = {"a": 0.5, "b": 0.3, "c": 0.2}


@pytest.fixture
def files(tmp_path):
    paths = {}
    rng = np.random.default_rng(0)
    for s, (name, n) in enumerate(SIZES.items()):
        path = tmp_path / f"{name}.bin"
        with TokenFileWriter(path, "test-tok", 300) as w:
            for _ in range(10):  # ten documents each
                w.append(100 * s + rng.integers(0, 100, size=n // 10))
                w.end_document()
        paths[name] = str(path)
    return paths


def _build(files, seed=7):
    blend = [[WEIGHTS[k], files[k]] for k in SIZES]
    return build_data(None, None, SEQ, GBS, seed, 0.1, 300, blend=blend)


def _source(rows: torch.Tensor) -> np.ndarray:
    """Which file each sample came from (files hold disjoint id ranges)."""
    src = rows // 100
    assert bool((src == src[:, :1]).all())
    return src[:, 0].numpy()


def test_one_epoch_holds_each_source_in_proportion_and_small_ones_repeat_only_after_a_pass(files):
    data = _build(files)
    n = len(data.train)
    per_epoch = -(-n // GBS) + 1
    seen = torch.cat([data.train.batch(data.sampler.batch_ids(s)) for s in range(per_epoch)])
    src = _source(seen[:n])  # the first blend epoch
    sizes = [len(d) for d in data.train.datasets]
    assert n == sum(sizes)
    for s, name in enumerate(SIZES):
        assert abs(np.count_nonzero(src == s) - WEIGHTS[name] * n) < 1, name
    # File c is up-sampled (0.2 of the blend > its share of the samples): within an epoch every sample of
    # it is drawn, none more than once more than any other.
    w0, l0 = data.train.locate(np.arange(n))
    counts = np.bincount(l0[w0 == 2], minlength=sizes[2])
    assert np.count_nonzero(w0 == 2) > sizes[2] and counts.min() >= 1 and counts.max() - counts.min() <= 1
    # Down-sampled file a shows samples in the second blend epoch that the first did not use.
    w1, l1 = data.train.locate(np.arange(n) + n)
    first, second = set(l0[w0 == 0].tolist()), set(l1[w1 == 0].tolist())
    assert len(first) == np.count_nonzero(w0 == 0) < sizes[0]  # no repeats inside an epoch
    assert second - first


def _consumed(data, layout: list[int], steps: list[int], start_step: int = 0) -> list[torch.Tensor]:
    """Per step, the samples each replica's StepBatches loads, concatenated in replica order."""
    num_micro = GBS // MBS
    slices = replica_microbatch_slices(assign_microbatches(num_micro, [float(t) for t in layout]))
    sets = []
    for r in range(len(layout)):
        ds = StepBatches(data.train, data.sampler, MBS, 100, lambda n, r=r: slices[r])
        ds.start_step = start_step
        sets.append(ds)
    out = []
    for step in steps:
        parts = [ds[step - start_step]["micro"].reshape(-1, SEQ + 1) for ds in sets]
        out.append(torch.cat(parts))
    return out


def test_same_order_on_every_layout_and_after_resume(files):
    data = _build(files)
    epoch_steps = len(data.train) // GBS
    steps = [0, 1, epoch_steps - 1, epoch_steps, epoch_steps + 1, 3 * epoch_steps]
    reference = [data.train.batch(data.sampler.batch_ids(s)) for s in steps]
    for layout in ([1], [2, 1], [3, 2]):
        for got, want in zip(_consumed(data, layout, steps), reference, strict=True):
            assert torch.equal(got, want), layout
    # Resume: fresh objects (a new process) starting at step k load what the first run would have.
    k = epoch_steps
    resumed = _build(files)
    later = [s for s in steps if s >= k]
    again = _consumed(resumed, [2, 1], later, start_step=k)
    for got, want in zip(again, reference[-len(later):], strict=True):
        assert torch.equal(got, want)


def test_the_seed_fixes_the_order(files):
    a, b, c = _build(files, 7), _build(files, 7), _build(files, 8)
    batches = [[d.train.batch(d.sampler.batch_ids(s)) for s in range(4)] for d in (a, b, c)]
    assert all(torch.equal(x, y) for x, y in zip(batches[0], batches[1], strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(batches[0], batches[2], strict=True))


def test_validation_is_held_out_per_file_by_documents(files):
    data = _build(files)
    for train, val in zip(data.train.datasets, data.val.datasets, strict=True):
        assert train.end == val.start  # the held-out tail starts at a document boundary
        assert val.end - val.start == pytest.approx(0.1 * val.end, rel=0.01)  # 1 of 10 equal documents


def test_bad_blends(files):
    for blend, key in (([[0.0, files["a"]]], "data.blend"), ([["x", files["a"]]], "data.blend"),
                       ([[1.0, files["a"] + ".missing"]], "data.blend")):
        with pytest.raises(ConfigError) as err:
            build_data(None, None, SEQ, GBS, 0, 0.1, 300, blend=blend)
        assert err.value.key == key, str(err.value)


def test_separate_validation_file(files):
    data = build_data(files["a"], None, SEQ, GBS, 0, 0.1, 300, val_path=files["c"])
    assert (data.train.start, data.train.end) == (0, SIZES["a"])  # all of a trains
    val = data.val.batch(np.arange(len(data.val)))
    assert bool(((val >= 200) & (val < 300)).all())  # validation is file c
