"""The built-in default corpus (Python standard library text), tokenized once and cached.

See `stdlib_text` for what text is used. The token file lives under the cache directory
(`$NTP_NEMO_CACHE`, default `~/.cache/ntp_nemo/corpus/`), named by a hash of the Python version,
the selected files and sizes, the byte cap and the tokenizer; concurrent first use is safe.
"""

from __future__ import annotations

from pathlib import Path

from ntp_nemo.data.cache import cache_dir, fingerprint
from ntp_nemo.data.stdlib_text import DEFAULT_MAX_BYTES, corpus_identity, stdlib_documents
from ntp_nemo.data.tokenizer import build_tokenizer
from ntp_nemo.data.tokens import TokenFileWriter, sidecar_path
from ntp_nemo.errors import ConfigError

MIN_CORPUS_BYTES = 64 * 1024


def default_corpus_tokens(
    tokenizer_name: str = "byte", max_bytes: int = DEFAULT_MAX_BYTES, eos_token: str | None = None
) -> Path:
    """Path of the built-in corpus' token file for a tokenizer spec, building it on first use."""
    tokenizer = build_tokenizer(tokenizer_name, eos_token=eos_token)
    identity = corpus_identity(max_bytes)
    key = fingerprint({"corpus": identity, "tokenizer": tokenizer.identity, "v": 2})
    out = cache_dir("corpus") / f"stdlib-py{identity['python']}-{tokenizer.name}-{key}.bin"
    if sidecar_path(out).exists():
        return out
    if sum(size for _, size in identity["files"]) < min(MIN_CORPUS_BYTES, max_bytes):
        raise ConfigError(
            "data.path",
            f"the built-in corpus needs the Python standard library sources, but only "
            f"{len(identity['files'])} .py files were found under {identity['stdlib']!r} (this Python "
            "installation ships without them). Set data.path to a text file or a token file instead.",
        )
    eos = tokenizer.eos_id
    extra = {"tokenizer_identity": dict(tokenizer.identity, eos_id=eos), "eos_id": eos}
    with TokenFileWriter(out, tokenizer.name, tokenizer.vocab_size, extra) as writer:
        for doc in stdlib_documents(max_bytes):
            writer.append(getattr(tokenizer, "prefix", []))
            writer.append(tokenizer.encode(doc))
            writer.append([tokenizer.eos_id])
            writer.end_document()
    return out
