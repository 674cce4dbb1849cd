"""Turning user text (files or directories of files) into token files.

Each input file is one document, followed by the tokenizer's end-of-document id. Files are read in
chunks ending at a line break, so a large file is never held in memory as ids all at once.
Directories contribute their non-hidden files in sorted relative-path order; binary files
(a NUL byte near the start) are skipped.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ntp_nemo.data.cache import cache_dir, fingerprint
from ntp_nemo.data.tokenizer import Tokenizer
from ntp_nemo.data.tokens import TokenFileWriter, sidecar_path
from ntp_nemo.errors import ConfigError

CHUNK_CHARS = 1 << 22
_SNIFF_BYTES = 8192


@dataclass(frozen=True)
class TextInputs:
    """The text files an input list expands to, and the binary files that were left out."""

    files: list[Path]
    skipped: list[Path]


def _looks_binary(path: Path) -> bool:
    with open(path, "rb") as fh:
        return b"\x00" in fh.read(_SNIFF_BYTES)


def expand_inputs(inputs: Sequence[str | os.PathLike], key: str = "data.path") -> TextInputs:
    """Files named by `inputs` (directories expanded), in order; ConfigError for a missing input."""
    files: list[Path] = []
    skipped: list[Path] = []
    for item in inputs:
        path = Path(item).expanduser().absolute()
        if path.is_dir():
            members = sorted(
                (p for p in path.rglob("*") if p.is_file()
                 and not any(part.startswith(".") for part in p.relative_to(path).parts)),
                key=lambda p: p.relative_to(path).as_posix(),
            )
            for member in members:
                (skipped if _looks_binary(member) else files).append(member)
        elif path.is_file():
            (skipped if _looks_binary(path) else files).append(path)
        else:
            fix = (
                "Give an existing text file, a directory of text files, or a token file written by "
                "ntp-preprocess; leave data.path empty to train on the built-in corpus."
                if key == "data.path"
                else "Give existing text files or directories of text files."
            )
            raise ConfigError(key, f"{str(item)!r} does not exist (resolved to {str(path)!r}). {fix}")
    return TextInputs(files, skipped)


def read_chunks(path: Path, chunk_chars: int = CHUNK_CHARS) -> Iterator[str]:
    """Successive pieces of a text file, each ending at a line break where one exists."""
    with open(path, encoding="utf-8", errors="replace", newline="") as fh:
        carry = ""
        while True:
            block = fh.read(chunk_chars)
            if not block:
                break
            block = carry + block
            cut = block.rfind("\n") + 1
            if cut == 0:
                carry = block
                continue
            carry = block[cut:]
            yield block[:cut]
        if carry:
            yield carry


def tokenize_files(files: Sequence[Path], tokenizer: Tokenizer, out: Path) -> int:
    """Tokenize `files` (one document each) into the token file `out`; returns the token count."""
    with TokenFileWriter(out, tokenizer.name, tokenizer.vocab_size) as writer:
        for path in files:
            for chunk in read_chunks(path):
                writer.append(tokenizer.encode(chunk))
            writer.append([tokenizer.eos_id])
    return writer.num_tokens


def cached_text_tokens(path: str | os.PathLike, tokenizer: Tokenizer) -> Path:
    """Token file for a text file or directory, built on first use and cached.

    The cache key covers each file's absolute path, size and modification time, and the tokenizer,
    so editing a file retokenizes it.
    """
    inputs = expand_inputs([path])
    if not inputs.files:
        raise ConfigError(
            "data.path",
            f"{str(path)!r} contains no text files (binary files are skipped). Point data.path at a "
            "UTF-8 text file or a directory holding some.",
        )
    if all(p.stat().st_size == 0 for p in inputs.files):
        raise ConfigError(
            "data.path",
            f"{str(path)!r} is empty: there is no text to train on. Point data.path at a non-empty text "
            "file, or leave it empty to use the built-in corpus.",
        )
    stats = [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in inputs.files]
    key = fingerprint({"files": stats, "tokenizer": tokenizer.name, "vocab": tokenizer.vocab_size, "v": 1})
    out = cache_dir("tokens") / f"text-{tokenizer.name}-{key}.bin"
    if not sidecar_path(out).exists():
        tokenize_files(inputs.files, tokenizer, out)
    return out
