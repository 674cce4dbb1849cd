"""Fuzzing every reader of untrusted input with hypothesis (a well-kept property-based fuzzer).

    python bench/fuzz.py [--examples 2000] [--seed 0] [--reader NAME]

Readers: the bounded JSON parser (`data.bounded_json.parse_json`), a token file's sidecar
(`data.tokens.open_token_file`), a checkpoint's manifest and its index (`checkpoint.checkpoint_problem`,
then `load` when the check passes), a tokenizer.json (`data.tokenizer.load_tokenizer_json`), an HF
config.json (`hf.config_map.read_hf_config` and `hf_fields`), and the coordinator's line parser
(`resilience.cluster_protocol.parse`). Inputs start from what the real producer writes (a real sidecar,
manifest, index, tokenizer, config, hello) and are mutated: a field replaced by any JSON value (huge and
negative integers, 1e308, strings, deep lists), bytes flipped, inserted or cut, or random bytes.

The property, for every input: the reader returns, or raises its documented refusal (a `ConfigError`, a
`JSONInputError`/`ValueError`, a problem string), within `LIMIT_S`; never another exception, never a hang.
One row per reader (inputs tried, refused, accepted, failures), last line `fuzz: N inputs over R readers,
F failures` (exit 1 when F > 0, with the first failing input of each reader). The suite runs each reader
with a few dozen seeded inputs (`tests/house/test_fuzz_readers.py`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LIMIT_S = 5.0


class Refused(ValueError):
    """A reader's refusal given as a problem string (the checkpoint check) rather than raised."""


@dataclass
class Tally:
    tried: int = 0
    refused: int = 0
    accepted: int = 0
    failures: list[str] = field(default_factory=list)


def _json_values():
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                        st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
                        st.sampled_from([0, -1, 2**31, 2**63, 1e308, "", "..", "/etc/passwd", "uint16"]))
    def nest(inner):
        return st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4))

    return st.recursive(scalars, nest, max_leaves=12)


def _mutations(seed_text: str):
    """Byte-level mutations of a real file's text, and a field of it replaced by any JSON value."""
    from hypothesis import strategies as st

    structural = st.sampled_from(list('[]{}",:\\0123456789eE.-+ \n') + ["1e999", "\\u", "Infinity", "NaN"])

    @st.composite
    def edit(draw):
        text = seed_text
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, len(text)))
            kind = draw(st.sampled_from(["insert", "delete", "replace", "truncate"]))
            piece = draw(structural)
            if kind == "insert":
                text = text[:at] + piece + text[at:]
            elif kind == "delete":
                text = text[:at] + text[at + draw(st.integers(1, 8)):]
            elif kind == "replace":
                text = text[:at] + piece + text[at + len(piece):]
            else:
                text = text[:at]
        return text

    @st.composite
    def swap_field(draw):
        doc = json.loads(seed_text)
        path, node = [], doc
        while isinstance(node, (dict, list)) and node and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
            path.append(key)
            node = node[key]
        value = draw(_json_values())
        if not path:
            return json.dumps(value)
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = value
        return json.dumps(doc)

    return st.one_of(edit(), swap_field(), st.binary(max_size=300).map(lambda b: b.decode("latin-1")))


def readers(work: Path) -> dict[str, tuple[str, Callable[[str], Any], tuple[type, ...]]]:
    """name -> (the real producer's text to start from, a function that feeds one input to the reader,
    the exceptions that are its documented refusals)."""
    import numpy as np
    import torch

    from ntp_nemo.checkpoint import checkpoint_name, checkpoint_problem, load, save_checkpoint
    from ntp_nemo.checkpoint.manifest import file_digest
    from ntp_nemo.data.bounded_json import JSONInputError, parse_json
    from ntp_nemo.data.tokenizer import load_tokenizer_json, train_bpe
    from ntp_nemo.data.tokens import open_token_file, sidecar_path, write_token_file
    from ntp_nemo.errors import ConfigError
    from ntp_nemo.hf.config_map import hf_fields, read_hf_config
    from ntp_nemo.models.model_config import ModelConfig
    from ntp_nemo.resilience.cluster_protocol import parse
    from ntp_nemo.runtime.runtime import RankPlace
    from ntp_nemo.topology import ResolvedLayout, Topology

    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    tokens = write_token_file(np.arange(200) % 50, work / "tokens.bin", "byte", 257)
    sidecar_text = sidecar_path(tokens).read_text()

    def sidecar(text: str) -> None:
        sidecar_path(tokens).write_text(text)
        open_token_file(tokens)

    cfg = ModelConfig(arch="gpt2", vocab_size=67, hidden_size=16, num_layers=1, num_heads=2,
                      ffn_hidden_size=32, max_seq_len=8, tie_embeddings=True)

    def model():
        return RankPlace(ResolvedLayout.make(Topology(1, [1], [1] * 3)), 0).build_model(cfg, 1)

    pristine = work / "pristine" / checkpoint_name(1)
    save_checkpoint(pristine, model(), None, {"n": 1}, step=1)
    ckpt = work / "ckpt"

    def fresh() -> Path:
        if ckpt.exists():
            shutil.rmtree(ckpt)
        shutil.copytree(pristine, ckpt)
        return ckpt

    def check_and_load(path: Path) -> None:
        problem = checkpoint_problem(path)
        if problem is not None:
            raise Refused(problem)
        load(path, model(), None)  # a ConfigError when the load finds what the check did not

    def manifest(text: str) -> None:
        path = fresh()
        (path / "manifest.json").write_text(text)
        check_and_load(path)

    def index(text: str) -> None:
        path = fresh()
        (path / "index.json").write_text(text)
        man = json.loads((path / "manifest.json").read_text())
        size, digest = file_digest(path / "index.json")  # as an attacker who rewrites the index would
        man["files"]["index.json"] = {"size": size, "xxh3_64": digest}
        (path / "manifest.json").write_text(json.dumps(man))
        check_and_load(path)

    tok_path = work / "tokenizer.json"
    train_bpe(["the quick brown fox jumps over the lazy dog " * 20], 300).save(str(tok_path))
    tok_text = tok_path.read_text()
    fuzzed_tok = work / "fuzzed_tokenizer.json"

    def tokenizer(text: str) -> None:
        fuzzed_tok.write_text(text)
        load_tokenizer_json(str(fuzzed_tok))

    hf_dir = work / "hf"
    hf_dir.mkdir(exist_ok=True)
    hf_text = json.dumps({"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
                          "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                          "tie_word_embeddings": False, "hidden_act": "silu"})

    def hf_config(text: str) -> None:
        (hf_dir / "config.json").write_text(text)
        hf_fields(read_hf_config(hf_dir), str(hf_dir))

    def link_line(text: str) -> None:
        out = parse(text.encode("utf-8", "surrogateescape"))
        if not isinstance(out, (dict, str)):
            raise TypeError(f"parse returned {type(out).__name__}")

    def bounded(text: str) -> None:
        value = parse_json(text)  # what it accepts is what json.loads reads
        if json.dumps(value, sort_keys=True) != json.dumps(json.loads(text), sort_keys=True):
            raise AssertionError("parse_json and json.loads disagree")

    hello = json.dumps({"auth": "00" * 32, "nonce": "ab" * 16, "want": 0, "ntasks": 4, "host": "h", "pid": 1})
    refusals = (ConfigError, JSONInputError, ValueError)
    return {
        "bounded JSON parser": (sidecar_text, bounded, (JSONInputError,)),
        "token file sidecar": (sidecar_text, sidecar, (ConfigError,)),
        "checkpoint manifest.json": ((pristine / "manifest.json").read_text(), manifest,
                                     (ConfigError, Refused)),
        "checkpoint index.json": ((pristine / "index.json").read_text(), index, (ConfigError, Refused)),
        "tokenizer.json": (tok_text, tokenizer, refusals),
        "HF config.json": (hf_text, hf_config, (ConfigError,)),
        "coordinator link line": (hello, link_line, ()),
    }


def fuzz_reader(name: str, seed_text: str, feed: Callable[[str], Any], refusals: tuple[type, ...],
                examples: int, seed: int) -> Tally:
    """Feed `examples` inputs drawn from `seed_text`'s mutations to `feed`; count what happened."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed

    tally = Tally()

    @hypothesis_seed(seed)
    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck), phases=["generate"])
    @given(_mutations(seed_text))
    def run(text: str) -> None:
        tally.tried += 1
        start = time.monotonic()
        try:
            feed(text)
            tally.accepted += 1
        except refusals:
            tally.refused += 1
        except Exception as err:  # noqa: BLE001 - the finding
            if len(tally.failures) < 3:
                tally.failures.append(f"{type(err).__name__}: {str(err)[:200]} <- {text[:200]!r}")
            else:
                tally.failures.append("")
        took = time.monotonic() - start
        if took > LIMIT_S:
            tally.failures.append(f"took {took:.1f} s <- {text[:200]!r}")

    run()
    return tally


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=2000, help="inputs per reader")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reader", default=None, help="only this reader (a name of the table)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="fuzz-"))
    try:
        table = readers(work)
        rows = []
        for name, (text, feed, refusals) in table.items():
            if args.reader and args.reader != name:
                continue
            t = time.time()
            tally = fuzz_reader(name, text, feed, refusals, args.examples, args.seed)
            rows.append((name, tally, time.time() - t))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    width = max(len(r[0]) for r in rows)
    print(f"| {'reader':<{width}} | inputs | refused | accepted | failures | seconds |")
    print(f"|{'-' * (width + 2)}|--------|---------|----------|----------|---------|")
    for name, tally, secs in rows:
        print(f"| {name:<{width}} | {tally.tried:>6} | {tally.refused:>7} | {tally.accepted:>8} | "
              f"{len(tally.failures):>8} | {secs:>7.1f} |")
    for name, tally, _ in rows:
        for failure in [f for f in tally.failures if f][:3]:
            print(f"{name}: {failure}")
    total = sum(t.tried for _, t, _ in rows)
    failed = sum(len(t.failures) for _, t, _ in rows)
    print(f"fuzz: {total} inputs over {len(rows)} readers (seed {args.seed}), {failed} failures")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
