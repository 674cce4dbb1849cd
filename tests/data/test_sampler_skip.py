"""Skipping bad samples: every step before the first skipped position draws what it drew before, the
skipped ids never come back, and a sampler given the ids from its start draws the same stream."""

from __future__ import annotations

from ntp_nemo.data.sampler import GlobalBatchSampler


def test_skip_keeps_earlier_steps_and_matches_a_sampler_skipping_from_the_start():
    clean = GlobalBatchSampler(50, 8, seed=3)
    before = [clean.batch_ids(s).tolist() for s in range(20)]  # 3.2 epochs
    bad = before[4][3]
    found = GlobalBatchSampler(50, 8, seed=3)
    early = [found.batch_ids(s).tolist() for s in range(5)]
    found.skip([bad])  # found while running step 4
    from_start = GlobalBatchSampler(50, 8, seed=3)
    from_start.skip([bad])
    after = [found.batch_ids(s).tolist() for s in range(20)]
    assert early == before[:5] and after[:4] == before[:4]
    assert after[4] == [i for i in before[4] if i != bad] + [before[5][0]]
    assert after == [from_start.batch_ids(s).tolist() for s in range(20)]
    assert all(bad not in ids for ids in after)
    assert sorted(sum(after, [])[:49]) == sorted(set(range(50)) - {bad})  # epoch 0: every other id once
