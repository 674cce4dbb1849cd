"""Global sampler: a pure function of (seed, step), epochs as permutations, consumer-count independence."""

from __future__ import annotations

import numpy as np
import pytest

from ntp_nemo.data.rebalance import assign_microbatches, replica_microbatch_slices
from ntp_nemo.data.sampler import GlobalBatchSampler
from ntp_nemo.errors import ConfigError


def _stream(sampler: GlobalBatchSampler, steps: int) -> np.ndarray:
    return np.concatenate([sampler.batch_ids(s) for s in range(steps)])


def test_same_seed_same_batches_other_seed_differs():
    a, b = GlobalBatchSampler(100, 8, seed=3), GlobalBatchSampler(100, 8, seed=3)
    c = GlobalBatchSampler(100, 8, seed=4)
    assert np.array_equal(_stream(a, 30), _stream(b, 30))
    assert not np.array_equal(_stream(a, 30), _stream(c, 30))
    ids = a.batch_ids(0)
    assert ids.dtype == np.int64 and ids.shape == (8,)


@pytest.mark.parametrize("num_samples,batch", [(10, 4), (12, 5), (3, 7), (7, 7)])
def test_every_epoch_is_a_permutation_across_batch_boundaries(num_samples, batch):
    sampler = GlobalBatchSampler(num_samples, batch, seed=11)
    epochs = 4
    steps = -(-epochs * num_samples // batch)
    stream = _stream(sampler, steps)
    for e in range(epochs):
        chunk = stream[e * num_samples : (e + 1) * num_samples]
        assert sorted(chunk.tolist()) == list(range(num_samples))
    first, second = stream[:num_samples], stream[num_samples : 2 * num_samples]
    if num_samples >= 7:
        assert not np.array_equal(first, second)  # a fresh order each epoch


def test_resume_from_step_alone():
    straight = GlobalBatchSampler(50, 6, seed=0)
    expected = [straight.batch_ids(s) for s in range(40)]
    resumed = GlobalBatchSampler(50, 6, seed=0)
    for s in range(23, 40):
        assert np.array_equal(resumed.batch_ids(s), expected[s])
    # Out-of-order queries (e.g. a rewind after a failure) see the same batches.
    for s in (39, 2, 17, 2, 38):
        assert np.array_equal(resumed.batch_ids(s), expected[s])


@pytest.mark.parametrize("capacities", [[1.0], [1.0, 1.0], [1.0, 0.5], [1.0, 1.0, 1.0], [1.0, 0.75, 0.5]])
def test_union_of_consumers_is_the_global_batch(capacities):
    """Each consumer builds its own sampler (as a separate process would) and takes its slice."""
    global_batch, micro = 24, 2
    counts = assign_microbatches(global_batch // micro, capacities)
    slices = replica_microbatch_slices(counts)
    reference = GlobalBatchSampler(37, global_batch, seed=5)
    for step in range(6):
        gathered = []
        for replica in range(len(capacities)):
            own = GlobalBatchSampler(37, global_batch, seed=5)
            micros = own.microbatch_ids(step, micro)
            gathered.extend(micros[i] for i in slices[replica])
        assert np.array_equal(np.concatenate(gathered), reference.batch_ids(step))


def test_microbatches_are_consecutive_cuts():
    sampler = GlobalBatchSampler(20, 12, seed=1)
    micros = sampler.microbatch_ids(3, 4)
    assert [len(m) for m in micros] == [4, 4, 4]
    assert np.array_equal(np.concatenate(micros), sampler.batch_ids(3))
    with pytest.raises(ConfigError) as err:
        sampler.microbatch_ids(0, 5)
    assert err.value.key == "data.micro_batch_size"


def test_bad_arguments():
    with pytest.raises(ConfigError) as err:
        GlobalBatchSampler(10, 0, seed=0)
    assert err.value.key == "data.global_batch_size"
    with pytest.raises(ValueError):
        GlobalBatchSampler(10, 2, seed=0).batch_ids(-1)
    # Negative seeds are valid config values and stay deterministic.
    neg = [GlobalBatchSampler(10, 4, seed=-1).batch_ids(2) for _ in range(2)]
    assert np.array_equal(neg[0], neg[1])
