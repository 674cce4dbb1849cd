"""Tokenizing documents into token files: in order, in one process or several, with progress.

The inputs are cut into units (see `readers`); each unit is tokenized on its own (in a worker
process when there are several) and the results are appended in unit order, so the output does not
depend on the number of workers. Used by `ntp-preprocess` and, for text given as `data.path`, by
training (tokenized once into the cache directory).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ntp_nemo.data.cache import cache_dir, fingerprint
from ntp_nemo.data.readers import (
    UNIT_BYTES,
    InputError,
    InputFile,
    Unit,
    collect_inputs,
    documents,
    plan_units,
)
from ntp_nemo.data.tokenizer import build_tokenizer
from ntp_nemo.data.tokens import (
    _DTYPES,
    FORMAT_VERSION,
    TokenFileWriter,
    dtype_for_vocab,
    read_sidecar,
    sidecar_path,
)
from ntp_nemo.errors import ConfigError

BATCH_DOCS = 256  # documents per encode_batch call


@dataclass
class UnitResult:
    tokens: np.ndarray  # in the output dtype, end-of-document ids included
    doc_lengths: np.ndarray
    max_id: int
    size: int  # input bytes


@dataclass
class Summary:
    out: Path
    num_tokens: int
    num_documents: int
    input_bytes: int
    num_files: int
    seconds: float
    up_to_date: bool = False


def _encode_unit(unit: Unit, spec: str, field: str, dtype: str) -> UnitResult:
    tok = build_tokenizer(spec, key="--tokenizer")
    prefix = getattr(tok, "prefix", np.zeros(0, dtype=np.int64))
    eos = np.asarray([tok.eos_id], dtype=np.int64)
    pieces: list[np.ndarray] = []
    lengths: list[int] = []
    batch: list[str | bytes] = []

    def flush() -> None:
        if not batch:
            return
        if hasattr(tok, "encode_documents"):
            ids, lens = tok.encode_documents(batch)
            pieces.append(ids)
            lengths.extend(lens)
        else:
            for ids in tok.encode_batch(batch):
                pieces.extend((prefix, ids, eos))
                lengths.append(len(prefix) + len(ids) + 1)
        batch.clear()

    for doc in documents(unit, field):
        if isinstance(doc, list):  # a text file: one document in several pieces
            flush()
            encoded = tok.encode_batch(doc)
            pieces.extend((prefix, *encoded, eos))
            lengths.append(len(prefix) + sum(len(e) for e in encoded) + 1)
            continue
        batch.append(doc)
        if len(batch) >= BATCH_DOCS:
            flush()
    flush()
    ids = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    max_id = int(ids.max()) if ids.size else -1
    if ids.size and (int(ids.min()) < 0 or max_id >= tok.vocab_size):
        raise InputError("--tokenizer", f"the tokenizer produced ids outside [0, {tok.vocab_size}).")
    return UnitResult(ids.astype(_DTYPES[dtype]), np.asarray(lengths, dtype=np.int64), max_id, unit.size)


def _work(args: tuple[Unit, str, str, str]) -> UnitResult | InputError:
    try:
        return _encode_unit(*args)
    except InputError as err:
        return err
    except ConfigError as err:
        return InputError(err.key, str(err).split(": ", 1)[-1])


def _results(units: list[Unit], spec: str, field: str, dtype: str, workers: int) -> Iterator[UnitResult]:
    jobs = [(u, spec, field, dtype) for u in units]
    if workers <= 1 or len(units) <= 1:
        for job in jobs:
            yield _raise_on_error(_work(job))
        return
    import multiprocessing as mp

    with mp.get_context("fork").Pool(min(workers, len(units))) as pool:
        for result in pool.imap(_work, jobs, chunksize=1):
            yield _raise_on_error(result)


def _raise_on_error(result: UnitResult | InputError) -> UnitResult:
    if isinstance(result, InputError):
        raise result.config_error()
    return result


def _progress(total_bytes: int, enabled: bool):
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class Rates(ProgressColumn):
        """Documents and input megabytes per second since the start (averages: units finish in bursts)."""

        def render(self, task) -> Text:
            elapsed = task.elapsed or 0.0
            docs = task.fields.get("docs", 0) / elapsed if elapsed > 0 else 0.0
            mbs = task.completed / elapsed / 1e6 if elapsed > 0 else 0.0
            return Text(f"{docs:,.0f} docs/s {mbs:,.2f} MB/s", style="progress.data.speed")

    return Progress(
        TextColumn("tokenizing"), BarColumn(), TextColumn("{task.fields[docs]:,} docs"), Rates(),
        TextColumn("ETA"), TimeRemainingColumn(),
        console=Console(stderr=True), disable=not enabled, transient=False,
    ), total_bytes


def inputs_record(files: Sequence[InputFile]) -> list[list]:
    return [f.record() for f in files]


def tokenize_to_file(
    files: Sequence[InputFile],
    spec: str,
    out: Path,
    field: str = "text",
    workers: int = 1,
    progress: bool = False,
    key: str = "INPUT",
    unit_bytes: int = UNIT_BYTES,
) -> Summary:
    """Tokenize `files` into the token file `out` (no-op when it is up to date); returns the counts."""
    t0 = time.perf_counter()
    tok = build_tokenizer(spec, key="--tokenizer" if key == "INPUT" else "data.tokenizer")
    identity = dict(tok.identity, eos_id=int(tok.eos_id))
    record = {"inputs": inputs_record(files), "field": field}
    existing = read_sidecar(out)
    if existing is not None:
        old = existing.get("tokenizer_identity") or {"name": existing.get("tokenizer"), "hash": None}
        if old.get("hash") != identity["hash"]:
            raise ConfigError(
                "--out" if key == "INPUT" else "data.path",
                f"{str(out)!r} already holds tokens from tokenizer {old.get('name')!r} "
                f"(hash {old.get('hash')}), "
                f"not {identity['name']!r} (hash {identity['hash']}). Choose another --out, or delete "
                f"{out.name} and {sidecar_path(out).name} to re-tokenize with this tokenizer.",
            )
        same = all(existing.get(k) == v for k, v in record.items())
        if same and existing.get("format_version") == FORMAT_VERSION and out.is_file():
            return Summary(out, int(existing["num_tokens"]), int(existing.get("num_documents", 0)),
                           sum(f.size for f in files), len(files), time.perf_counter() - t0, up_to_date=True)
    units = plan_units(files, unit_bytes)
    dtype = dtype_for_vocab(tok.vocab_size)
    total = sum(u.size for u in units)
    bar, _ = _progress(total, progress)
    extra = {"tokenizer_identity": identity, "eos_id": int(tok.eos_id), "input_bytes": total, **record}
    ndocs = 0
    with bar, TokenFileWriter(out, tok.name, tok.vocab_size, extra) as writer:
        task = bar.add_task("tokenize", total=max(total, 1), docs=0)
        try:
            for res in _results(units, spec, field, dtype, workers):
                writer.append_encoded(res.tokens, res.doc_lengths, res.max_id)
                ndocs += len(res.doc_lengths)
                bar.update(task, advance=res.size, docs=ndocs)
        except InputError as err:
            raise err.config_error() from err
        if writer.num_tokens == 0 or ndocs == 0:
            raise ConfigError(key, f"the inputs ({len(files)} files) hold no documents: nothing to tokenize. "
                                   "Check that the files are not empty (and --field names the text).")
    return Summary(out, writer.num_tokens, ndocs, total, len(files), time.perf_counter() - t0)



def cached_text_tokens(path: str | os.PathLike, spec: str) -> Path:
    """Token file for text given as `data.path` (a file or directory), built on first use and cached.

    The cache key covers each file's absolute path, size and modification time, and the tokenizer,
    so editing a file retokenizes it.
    """
    files, _ = collect_inputs([path], key="data.path")
    if not files:
        raise ConfigError(
            "data.path",
            f"{str(path)!r} contains no text files (binary files are skipped). Point data.path at a "
            "text file, .jsonl file or a directory holding some.",
        )
    if all(f.size == 0 for f in files):
        raise ConfigError(
            "data.path",
            f"{str(path)!r} is empty: there is no text to train on. Point data.path at a non-empty text "
            "file, or leave it empty to use the built-in corpus.",
        )
    tok = build_tokenizer(spec)
    key = fingerprint({"files": inputs_record(files), "tokenizer": tok.identity, "v": 2})
    out = cache_dir("tokens") / f"text-{tok.name.replace(':', '_').replace('/', '_')}-{key}.bin"
    if not sidecar_path(out).exists():
        try:
            tokenize_to_file(files, spec, out, key="data.path")
        except InputError as err:
            raise err.config_error() from err
    return out
