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

from ntp_nemo.data import readers
from ntp_nemo.data.cache import cache_dir, fingerprint
from ntp_nemo.data.readers import (
    UNIT_BYTES,
    InputError,
    InputFile,
    Unit,
    check_whole_texts,
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


# Text tokenizes at about 0.1 to 0.5 tokens per byte (a byte-level tokenizer: 1); fewer than this
# over a sizeable input means a broken tokenizer (every word unknown, or no vocabulary at all).
MIN_TOKENS_PER_BYTE = 1 / 32
MIN_BYTES_FOR_RATE = 4096


@dataclass
class Quality:
    """What tokenizing lost or found suspicious, counted over the documents."""

    replaced_documents: int = 0  # held bytes that are not UTF-8, replaced by U+FFFD
    empty_documents: int = 0  # encoded to no token (only the end-of-document id is written)
    text_bytes: int = 0  # UTF-8 bytes of the documents' text
    text_tokens: int = 0  # their tokens (no prefix, no end-of-document)

    def add(self, other: Quality) -> None:
        for name in ("replaced_documents", "empty_documents", "text_bytes", "text_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def tokens_per_byte(self) -> float | None:
        return self.text_tokens / self.text_bytes if self.text_bytes else None

    @property
    def few_tokens(self) -> bool:
        rate = self.tokens_per_byte
        return rate is not None and self.text_bytes >= MIN_BYTES_FOR_RATE and rate < MIN_TOKENS_PER_BYTE

    def record(self) -> dict:
        rate = self.tokens_per_byte
        return {"documents_with_replaced_bytes": self.replaced_documents,
                "empty_documents": self.empty_documents, "text_bytes": self.text_bytes,
                "tokens_per_byte": None if rate is None else round(rate, 6),
                "implausibly_few_tokens": self.few_tokens}

    @classmethod
    def from_record(cls, rec: dict | None) -> Quality:
        rec = rec or {}
        q = cls(int(rec.get("documents_with_replaced_bytes", 0)), int(rec.get("empty_documents", 0)),
                int(rec.get("text_bytes", 0)))
        rate = rec.get("tokens_per_byte")
        q.text_tokens = round(rate * q.text_bytes) if rate is not None else 0
        return q

    def problems(self, tokenizer: str) -> list[str]:
        """One sentence per problem found (empty when there is none)."""
        out = []
        if self.replaced_documents:
            out.append(f"{self.replaced_documents} document(s) held bytes that are not UTF-8; the tokenizer "
                       f"{tokenizer!r} saw U+FFFD in their place (the byte tokenizer keeps every byte)")
        if self.empty_documents:
            out.append(f"{self.empty_documents} document(s) were empty (written as an end-of-document id "
                       "alone)")
        if self.few_tokens:
            out.append(f"the tokenizer {tokenizer!r} made {self.text_tokens:,} tokens of "
                       f"{self.text_bytes:,} bytes of text ({self.tokens_per_byte:.4f} tokens per byte; text "
                       f"gives 0.1 to 0.5, below {MIN_TOKENS_PER_BYTE:.4f} the tokenizer is most likely "
                       "broken: check that it is the intended tokenizer.json)")
        return out


@dataclass
class UnitResult:
    tokens: np.ndarray  # in the output dtype, end-of-document ids included
    doc_lengths: np.ndarray
    max_id: int
    size: int  # input bytes
    quality: Quality


@dataclass
class Summary:
    out: Path
    num_tokens: int
    num_documents: int
    input_bytes: int
    num_files: int
    seconds: float
    up_to_date: bool = False
    quality: Quality | None = None


def _not_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def _encode_unit(unit: Unit, spec: str, field: str, dtype: str, eos_token: str | None = None) -> UnitResult:
    tok = build_tokenizer(spec, key="--tokenizer", eos_token=eos_token)
    prefix = getattr(tok, "prefix", np.zeros(0, dtype=np.int64))
    eos = np.asarray([tok.eos_id], dtype=np.int64)
    pieces: list[np.ndarray] = []
    lengths: list[int] = []
    batch: list[str | bytes] = []
    quality = Quality()

    def flush() -> None:
        if not batch:
            return
        if hasattr(tok, "encode_documents"):
            ids, lens = tok.encode_documents(batch)
            pieces.append(ids)
        else:
            encoded = tok.encode_batch(batch)
            lens = [len(prefix) + len(e) + 1 for e in encoded]
            for e in encoded:
                pieces.extend((prefix, e, eos))
        lengths.extend(lens)
        own = np.asarray(lens, dtype=np.int64) - (len(prefix) + 1)  # each document's own tokens
        quality.empty_documents += int(np.count_nonzero(own == 0))
        quality.text_tokens += int(own.sum())
        batch.clear()

    for doc in documents(unit, field, tok.text_cut):
        if not isinstance(doc, (str, bytes)):  # a text file: one document in pieces, encoded one by one
            flush()
            count, replaced = 0, False
            pieces.append(prefix)
            for piece in doc:
                ids = tok.encode(piece)
                pieces.append(ids)
                count += len(ids)
                quality.text_bytes += len(piece)
                replaced = replaced or (not tok.lossless and _not_utf8(piece))
            quality.replaced_documents += replaced
            pieces.append(eos)
            lengths.append(len(prefix) + count + 1)
            quality.empty_documents += count == 0
            quality.text_tokens += count
            continue
        size = len(doc.encode("utf-8")) if isinstance(doc, str) else len(doc)
        if size > readers.MAX_WHOLE_TEXT_BYTES:  # encoded whole: the size guard of every such document
            raise InputError("INPUT", f"{str(unit.file.path)!r} holds a document of {size / 2**20:.1f} MiB, "
                                      "which would be encoded whole (about "
                                      f"{size * 200 / 2**30:.1f} GiB of memory); the limit is "
                                      f"{readers.MAX_WHOLE_TEXT_BYTES >> 20} MiB. Split it into several "
                                      "documents.")
        quality.text_bytes += size
        batch.append(doc)
        if len(batch) >= BATCH_DOCS:
            flush()
    flush()
    ids = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    max_id = int(ids.max()) if ids.size else -1
    if ids.size and (int(ids.min()) < 0 or max_id >= tok.vocab_size):
        raise InputError("--tokenizer", f"the tokenizer produced ids outside [0, {tok.vocab_size}).")
    return UnitResult(ids.astype(_DTYPES[dtype]), np.asarray(lengths, dtype=np.int64), max_id, unit.size,
                      quality)


def _work(args: tuple[Unit, str, str, str, str | None]) -> UnitResult | InputError:
    try:
        return _encode_unit(*args)
    except InputError as err:
        return err
    except ConfigError as err:
        return InputError(err.key, str(err).split(": ", 1)[-1])


def _results(units: list[Unit], spec: str, field: str, dtype: str, workers: int,
             eos_token: str | None = None) -> Iterator[UnitResult]:
    jobs = [(u, spec, field, dtype, eos_token) for u in units]
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


def _strict_error(quality: Quality, tokenizer: str, out: Path) -> ConfigError:
    return ConfigError("--strict", f"{'; '.join(quality.problems(tokenizer))}. {str(out)!r} was not written. "
                                   "Fix the inputs (or the tokenizer), or leave --strict out to accept them.")


def tokenize_to_file(
    files: Sequence[InputFile],
    spec: str,
    out: Path,
    field: str = "text",
    workers: int = 1,
    progress: bool = False,
    key: str = "INPUT",
    unit_bytes: int = UNIT_BYTES,
    eos_token: str | None = None,
    strict: bool = False,
) -> Summary:
    """Tokenize `files` into the token file `out` (no-op when it is up to date); returns the counts.

    `strict`: documents with replaced bytes, empty documents or implausibly few tokens per byte
    raise a ConfigError instead of being written (they are always counted in the sidecar's `quality`).
    """
    t0 = time.perf_counter()
    tok_key = "--tokenizer" if key == "INPUT" else "data.tokenizer"
    tok = build_tokenizer(spec, key=tok_key, eos_token=eos_token)
    identity = dict(tok.identity, eos_id=int(tok.eos_id))
    record = {"inputs": inputs_record(files), "field": field}
    existing = read_sidecar(out)
    if existing is not None:
        old = existing.get("tokenizer_identity") or {"name": existing.get("tokenizer"), "hash": None}
        old_eos = old.get("eos_id", existing.get("eos_id"))
        other_eos = old_eos is not None and int(old_eos) != identity["eos_id"]
        if old.get("hash") != identity["hash"] or other_eos:
            eos_note = (f", end-of-document id {old_eos} instead of {identity['eos_id']}"
                        if old.get("hash") == identity["hash"] else "")
            raise ConfigError(
                "--out" if key == "INPUT" else "data.path",
                f"{str(out)!r} already holds tokens from tokenizer {old.get('name')!r} "
                f"(hash {old.get('hash')}{eos_note}), "
                f"not {identity['name']!r} (hash {identity['hash']}). Choose another --out, or delete "
                f"{out.name} and {sidecar_path(out).name} to re-tokenize with this tokenizer.",
            )
        same = all(existing.get(k) == v for k, v in record.items())
        if same and existing.get("format_version") == FORMAT_VERSION and out.is_file():
            quality = Quality.from_record(existing.get("quality"))
            if strict and quality.problems(tok.name):
                raise ConfigError("--strict", f"{str(out)!r} is up to date, but "
                                              f"{'; '.join(quality.problems(tok.name))}. Fix the inputs (or "
                                              "the tokenizer) and delete the output, or leave --strict out.")
            return Summary(out, int(existing["num_tokens"]), int(existing.get("num_documents", 0)),
                           sum(f.size for f in files), len(files), time.perf_counter() - t0, up_to_date=True,
                           quality=quality)
    check_whole_texts(files, tok.text_cut, tok.name, key)
    units = plan_units(files, unit_bytes)
    dtype = dtype_for_vocab(tok.vocab_size)
    total = sum(u.size for u in units)
    bar, _ = _progress(total, progress)
    quality = Quality()
    extra = {"tokenizer_identity": identity, "eos_id": int(tok.eos_id), "input_bytes": total, **record}
    ndocs = 0
    with bar, TokenFileWriter(out, tok.name, tok.vocab_size, extra) as writer:
        task = bar.add_task("tokenize", total=max(total, 1), docs=0)
        try:
            for res in _results(units, spec, field, dtype, workers, eos_token):
                writer.append_encoded(res.tokens, res.doc_lengths, res.max_id)
                ndocs += len(res.doc_lengths)
                quality.add(res.quality)
                bar.update(task, advance=res.size, docs=ndocs)
        except InputError as err:
            raise err.config_error() from err
        if writer.num_tokens == 0 or ndocs == 0:
            raise ConfigError(key, f"the inputs ({len(files)} files) hold no documents: nothing to tokenize. "
                                   "Check that the files are not empty (and --field names the text).")
        if strict and quality.problems(tok.name):
            raise _strict_error(quality, tok.name, out)
        writer.extra["quality"] = quality.record()
    return Summary(out, writer.num_tokens, ndocs, total, len(files), time.perf_counter() - t0,
                   quality=quality)


def cached_text_tokens(path: str | os.PathLike, spec: str, eos_token: str | None = None) -> Path:
    """Token file for text given as `data.path` (a file or directory), built on first use and cached.

    The cache key covers each file's absolute path, size and modification time, and the tokenizer
    (its end-of-document id included), so editing a file retokenizes it.
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
    tok = build_tokenizer(spec, eos_token=eos_token)
    # v3: pieces cut where whitespace begins, judged by characters (v2 files may differ at cuts)
    key = fingerprint({"files": inputs_record(files), "tokenizer": tok.identity, "v": 3})
    out = cache_dir("tokens") / f"text-{tok.name.replace(':', '_').replace('/', '_')}-{key}.bin"
    if not sidecar_path(out).exists():
        try:
            tokenize_to_file(files, spec, out, key="data.path", eos_token=eos_token)
        except InputError as err:
            raise err.config_error() from err
    return out
