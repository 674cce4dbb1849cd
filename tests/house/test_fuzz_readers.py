"""Every reader of untrusted input (`bench/fuzz.py`'s table: the bounded JSON parser, a token file's
sidecar, a checkpoint's manifest and index, a tokenizer.json, an HF config.json, the coordinator's line
parser) fed a few dozen seeded mutations of what its real producer writes: each input is read or refused
with the reader's documented error, never another exception or a hang. The bench runs thousands."""

from __future__ import annotations

import pytest

from bench import fuzz


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    return fuzz.readers(tmp_path_factory.mktemp("fuzz"))


@pytest.mark.parametrize("name", ["bounded JSON parser", "token file sidecar", "checkpoint manifest.json",
                                  "checkpoint index.json", "tokenizer.json", "HF config.json",
                                  "coordinator link line"])
def test_a_reader_reads_or_refuses_every_mutated_input(table, name):
    text, feed, refusals = table[name]
    tally = fuzz.fuzz_reader(name, text, feed, refusals, examples=20, seed=1)
    assert tally.tried == 20
    assert not [f for f in tally.failures if f], tally.failures
    assert tally.refused > 0 or name == "coordinator link line"  # the mutations do reach the refusals
