"""Reading documents from user files: plain text, JSON lines (plain, gzip, zstd) and Parquet.

- a text file is one document, as bytes: in pieces of about `CHUNK_BYTES` cut where the tokenizer
  encodes the pieces exactly like the whole (`text_pieces`), or whole when it has no such place;
- each line of a `.jsonl`, `.jsonl.gz` or `.jsonl.zst` file is a JSON object whose `field` is a
  document; each row of a `.parquet` file is one (its `field` column).

Inputs may be files, directories (their non-hidden files in sorted relative-path order; files that
look binary are skipped there) and glob patterns (`data/*.jsonl.zst`, `**` recursive). Work is cut
into units that can be tokenized independently and concatenated in order: a whole text or
compressed file, a byte range of a plain `.jsonl` file aligned to line starts, or one Parquet row
group. The output therefore does not depend on how many processes tokenize the units.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ntp_nemo.errors import ConfigError

CHUNK_BYTES = 1 << 22  # pieces of a text file
# A text file a tokenizer cannot take in pieces is encoded whole; the `tokenizers` library holds about
# 200 bytes per input byte while doing so, so larger ones are refused (split them into documents).
MAX_WHOLE_TEXT_BYTES = 16 << 20
UNIT_BYTES = 8 << 20  # byte ranges of a plain .jsonl file
_SNIFF_BYTES = 8192
_KINDS = ((".jsonl.gz", "jsonl.gz"), (".jsonl.zst", "jsonl.zst"), (".jsonl.zstd", "jsonl.zst"),
          (".jsonl", "jsonl"), (".parquet", "parquet"))


class InputError(Exception):
    """Bad input found while reading (picklable, unlike ConfigError, so it crosses process borders)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(key, message)
        self.key, self.message = key, message

    def config_error(self) -> ConfigError:
        return ConfigError(self.key, self.message)


@dataclass(frozen=True)
class InputFile:
    path: Path
    kind: str  # text | jsonl | jsonl.gz | jsonl.zst | parquet
    size: int
    mtime_ns: int

    def record(self) -> list:
        return [str(self.path), self.size, self.mtime_ns]


@dataclass(frozen=True)
class Unit:
    """A piece of work: a whole file, a byte range of a .jsonl file or a Parquet row group."""

    file: InputFile
    start: int = 0
    end: int = -1  # -1: to the end
    row_group: int | None = None
    size: int = 0  # input bytes it covers (for progress)


def kind_of(path: Path) -> str:
    name = path.name.lower()
    return next((kind for suffix, kind in _KINDS if name.endswith(suffix)), "text")


def _looks_binary(path: Path) -> bool:
    with open(path, "rb") as fh:
        return b"\x00" in fh.read(_SNIFF_BYTES)


def _input_file(path: Path, key: str) -> InputFile:
    try:
        with open(path, "rb") as fh:
            fh.read(1)
        st = path.stat()
    except OSError as err:
        raise ConfigError(key, f"cannot read {str(path)!r} ({err.strerror or err}). Fix its permissions or "
                               "leave it out of the inputs.") from err
    return InputFile(path, kind_of(path), st.st_size, st.st_mtime_ns)


def collect_inputs(
    items: Sequence[str | os.PathLike], key: str = "INPUT"
) -> tuple[list[InputFile], list[Path]]:
    """Expand files, directories and globs into input files, in order; also the skipped binary files."""
    files: list[InputFile] = []
    skipped: list[Path] = []
    for item in items:
        text = os.fspath(item)
        if any(c in text for c in "*?["):
            matches = sorted(Path(m).absolute() for m in glob.glob(os.path.expanduser(text), recursive=True))
            matches = [m for m in matches if m.is_file()]
            if not matches:
                raise ConfigError(key, f"the pattern {text!r} matches no file. Check the pattern (quote it "
                                       "so the "
                                       "shell does not expand it) or name the files.")
            files.extend(_input_file(m, key) for m in matches)
            continue
        path = Path(text).expanduser().absolute()
        if path.is_dir():
            members = sorted(
                (p for p in path.rglob("*") if p.is_file()
                 and not any(part.startswith(".") for part in p.relative_to(path).parts)),
                key=lambda p: p.relative_to(path).as_posix(),
            )
            for member in members:
                if kind_of(member) == "text" and _looks_binary(member):
                    skipped.append(member)
                else:
                    files.append(_input_file(member, key))
        elif path.is_file():
            files.append(_input_file(path, key))
        else:
            fix = (
                "Give an existing text file, a directory of text files, or a token file written by "
                "ntp-preprocess; leave data.path empty to train on the built-in corpus."
                if key == "data.path"
                else "Give existing files, directories or glob patterns."
            )
            raise ConfigError(key, f"{text!r} does not exist (resolved to {str(path)!r}). {fix}")
    return files, skipped


def plan_units(files: Sequence[InputFile], unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    """Cut the inputs into independently tokenizable units, in output order."""
    units: list[Unit] = []
    for f in files:
        if f.kind == "jsonl" and f.size > unit_bytes:
            for start in range(0, f.size, unit_bytes):
                end = min(start + unit_bytes, f.size)
                units.append(Unit(f, start, end, size=end - start))
        elif f.kind == "parquet":
            groups = _parquet_row_groups(f)
            for g in range(groups):
                units.append(Unit(f, row_group=g, size=f.size // groups + (g < f.size % groups)))
        else:
            units.append(Unit(f, size=f.size))
    return units


def _import_optional(module: str, package: str, what: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as err:
        raise InputError("INPUT", f"reading {what} needs the `{package}` package, which is not installed. "
                                  f"Install it with `pip install {package}`.") from err


def _parquet_row_groups(f: InputFile) -> int:
    pq = _import_optional("pyarrow.parquet", "pyarrow", f"{str(f.path)!r} (Parquet)")
    try:
        return max(1, pq.ParquetFile(f.path).metadata.num_row_groups)
    except Exception as err:  # noqa: BLE001 - pyarrow raises several unrelated types on bad files
        raise InputError("INPUT", f"{str(f.path)!r} is not a readable Parquet file ({err}).") from err


_SPACE = frozenset(b" \t\r\n\x0b\x0c")
_BREAKS = (b"\n", b"\r", b" ")  # where a "line" cut is looked for, in order of preference


def _char_before(data: bytes, end: int) -> str:
    """The character that ends at byte `end` as the tokenizer sees it (bytes that are not UTF-8 decode
    to U+FFFD, as `HFTokenizer` decodes them)."""
    return data[max(0, end - 8):end].decode("utf-8", errors="replace")[-1]


def _line_cut(data: bytes) -> int:
    """The start of the whitespace run around the last line break (else the last space) that follows
    a non-space character; 0: none. Whitespace is judged by characters (`str.isspace`: U+00A0, U+3000
    ... count, as in GPT-2's pre-tokenizer, whose regex treats Unicode spaces as whitespace): the
    byte-level pre-tokenizer never joins a non-space to the whitespace after it, and from the first
    character of a whitespace run its pre-tokens do not depend on the text before, so the pieces
    encode to the whole text's ids."""
    for sep in _BREAKS:
        pos = data.rfind(sep, 1)
        if pos <= 0:
            continue
        start = pos
        while start > 0:
            ch = _char_before(data, start)
            if not ch.isspace():
                return start
            start -= len(ch.encode("utf-8"))
    return 0


def _cut(data: bytes, cut: str) -> int:
    """Where to end a piece of a long text, 0: nowhere. "line": before the whitespace run of a line
    break (`_line_cut`); "space": just before a single space with a non-space on both sides (see
    `tokenizer.text_cut_of` for why each is exact)."""
    if cut == "line":
        return _line_cut(data)
    pos = data.rfind(b" ", 1, len(data) - 1)
    while pos > 0 and (data[pos - 1] in _SPACE or data[pos + 1] in _SPACE):
        pos = data.rfind(b" ", 1, pos)
    return pos if pos > 0 else 0


def _too_large_whole(path: Path, size: int) -> InputError:
    gib = size * 200 / 2**30
    return InputError("INPUT", f"{str(path)!r} has no place where the tokenizer can be cut exactly in its "
                               f"first {size / 2**20:.1f} MiB (byte-level: whitespace after a non-space; "
                               "Metaspace: a single space between non-spaces), so it would be "
                               f"encoded whole, which needs about {gib:.1f} GiB of memory or "
                               f"more; the limit is {MAX_WHOLE_TEXT_BYTES >> 20} MiB. Split it into several "
                               "documents (files, or a .jsonl file with one document per line).")


def text_pieces(path: Path, cut: str | None, chunk: int | None = None) -> Iterator[bytes]:
    """A file's bytes in pieces of about `chunk` bytes cut the `cut` way (whole when None or when the
    file is smaller); the pieces concatenate to the file. A piece that would grow past
    `MAX_WHOLE_TEXT_BYTES` for want of a place to cut is refused (InputError): the size guard of
    `check_whole_texts` for every document encoded whole."""
    chunk = chunk or CHUNK_BYTES
    with open(path, "rb") as fh:
        if cut is None:
            yield fh.read()
            return
        data = fh.read(chunk)
        while data:
            more = fh.read(chunk)
            if not more:
                yield data
                return
            at = _cut(data, cut)
            if at:
                yield data[:at]
                data = data[at:]
            elif len(data) + len(more) > MAX_WHOLE_TEXT_BYTES:
                raise _too_large_whole(path, len(data) + len(more))
            data += more


def check_whole_texts(files: Sequence[InputFile], cut: str | None, tokenizer: str, key: str) -> None:
    """Refuse, before tokenizing, a text file that would have to be encoded whole and is too large."""
    if cut is not None:
        return
    big = [f for f in files if f.kind == "text" and f.size > MAX_WHOLE_TEXT_BYTES]
    if big:
        f = big[0]
        gib = f.size * 200 / 2**30
        raise ConfigError(key, f"{str(f.path)!r} is one document of {f.size / 2**20:.1f} MiB, and the "
                               f"tokenizer {tokenizer!r} cannot encode it in pieces exactly (it has a "
                               "normalizer, or a pre-tokenizer other than GPT-2 byte-level or Metaspace), "
                               f"so it would be encoded whole, which needs about {gib:.1f} GiB of memory; "
                               f"the limit is {MAX_WHOLE_TEXT_BYTES >> 20} MiB. Split it into several "
                               "documents (files, or a .jsonl file with one document per line), or use a "
                               "tokenizer that can be cut.")


def _json_lines(unit: Unit) -> Iterator[tuple[int, bytes]]:
    """(line number or byte offset, line) of the JSON lines a unit covers."""
    f = unit.file
    if f.kind == "jsonl":
        with open(f.path, "rb") as fh:
            if unit.start > 0:
                fh.seek(unit.start - 1)
                fh.readline()  # finish the line that began before the range (or the "\n" just before it)
            end = f.size if unit.end < 0 else unit.end
            while True:
                pos = fh.tell()
                if pos >= end:
                    return
                line = fh.readline()
                if not line:
                    return
                yield pos, line
        return
    if f.kind == "jsonl.gz":
        raw = gzip.open(f.path, "rb")
    else:
        zstd = _import_optional("zstandard", "zstandard", f"{str(f.path)!r} (zstd)")
        raw = zstd.ZstdDecompressor().stream_reader(open(f.path, "rb"), closefd=True)
    with io.BufferedReader(raw, 1 << 20) as fh:
        for n, line in enumerate(fh, start=1):
            yield n, line


def _field(value: object, field: str, f: InputFile, where: str) -> str:
    if not isinstance(value, dict) or field not in value:
        keys = ", ".join(sorted(value)[:8]) if isinstance(value, dict) else type(value).__name__
        raise InputError("--field", f"{str(f.path)!r} ({where}) has no field {field!r} (it has: {keys}). "
                                    "Name the "
                                    "field holding the text with --field NAME (data.path input: use "
                                    "ntp-preprocess --field NAME).")
    text = value[field]
    if not isinstance(text, str):
        raise InputError("--field", f"{str(f.path)!r} ({where}): field {field!r} holds a "
                                    f"{type(text).__name__}, not text. Name a text field with --field NAME.")
    return text


def documents(
    unit: Unit, field: str = "text", text_cut: str | None = "line"
) -> Iterator[str | bytes | Iterator[bytes]]:
    """The documents of a unit: a text file as an iterator of byte pieces (cut the `text_cut` way;
    consume it before the next document), JSON/Parquet documents as str."""
    f = unit.file
    if f.kind == "text":
        yield text_pieces(f.path, text_cut)
        return
    if f.kind == "parquet":
        pq = _import_optional("pyarrow.parquet", "pyarrow", f"{str(f.path)!r} (Parquet)")
        pf = pq.ParquetFile(f.path)
        if field not in pf.schema_arrow.names:
            raise InputError("--field", f"{str(f.path)!r} has no column {field!r} (it has: "
                                        f"{', '.join(pf.schema_arrow.names[:8])}). Name the text column with "
                                        "--field NAME.")
        if pf.metadata.num_row_groups == 0:
            return
        column = pf.read_row_group(unit.row_group or 0, columns=[field]).column(0)
        for i, text in enumerate(column.to_pylist()):
            if text is None:
                continue
            if not isinstance(text, str):
                raise InputError("--field", f"{str(f.path)!r} row {i}: column {field!r} holds "
                                            f"{type(text).__name__}, not text. Name a text column with "
                                            "--field.")
            yield text
        return
    try:
        for where, line in _json_lines(unit):
            if not line.strip():
                continue
            label = f"byte {where}" if f.kind == "jsonl" else f"line {where}"
            try:
                value = json.loads(line)
            except ValueError as err:
                raise InputError("INPUT", f"{str(f.path)!r} ({label}) is not valid JSON ({err}). Each line "
                                          "of a "
                                          ".jsonl file must be one JSON object.") from err
            yield _field(value, field, f, label)
    except InputError:
        raise
    except Exception as err:  # noqa: BLE001 - gzip, zlib and zstd each raise their own error types
        raise InputError("INPUT", f"cannot read {str(f.path)!r} ({type(err).__name__}: {err}); the file is "
                                  f"damaged or not {f.kind}.") from err
