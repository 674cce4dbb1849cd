"""Tokenizers: raw bytes, a byte-level BPE trained locally, or any Hugging Face `tokenizer.json`.

All follow one small protocol (`name`, `vocab_size`, `eos_id`, `identity`, `encode`,
`encode_batch`, `decode`) so the rest of the data pipeline never asks which one it has.

- `byte`: ids 0..255 are the bytes of the input, 256 ends a document. Input given as `bytes` is
  taken as is, so any file (valid UTF-8 or not) round-trips exactly.
- `bpe`: trained once on the built-in corpus with the `tokenizers` package and cached; training is
  deterministic, so every process of a run gets the same vocabulary.
- a path to a `tokenizer.json`, or a directory holding one (a Hugging Face model directory): loaded
  with the `tokenizers` package. The end-of-document id is the token named by `eos_token`
  (`--eos-token`, `data.eos_token`) when given, else the directory's `tokenizer_config.json` /
  `config.json` / `generation_config.json` when present, else the usual end-of-text special tokens. A
  beginning-of-sequence token the tokenizer itself adds on encoding (Llama's) starts every document.

A tokenizer's `identity` (name, kind, SHA-256 of its definition, end-of-document id) is written into
token files, so a run can tell whether a token file was made with its tokenizer.

`text_cut` says where a long text may be cut into pieces that encode, one after the other, to exactly
the ids of the whole text (`readers.text_pieces`): "line" (before the whitespace run of a line break,
after a non-space character, judged by characters: raw bytes, and GPT-2-style byte-level BPE without a
normalizer), "space" (before a single space between
non-spaces: a Metaspace pre-tokenizer without a normalizer, as SentencePiece-style Unigram/BPE
tokenizer.json files) or None (the text is encoded whole: anything else, e.g. a normalizer).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from ntp_nemo.data.bounded_json import parse_json, read_regular
from ntp_nemo.data.cache import atomic_write_text, cache_dir, fingerprint
from ntp_nemo.errors import ConfigError

TOKENIZER_NAMES = ("byte", "bpe")
BPE_VOCAB_SIZE = 4096
BPE_EOS = "<|endoftext|>"
BYTE_HASH = "byte-v1"
# End-of-text tokens of common tokenizers (GPT-2, Llama 3, Llama 2 / Mistral, Gemma), in order of preference.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int
    text_cut: str | None
    lossless: bool

    @property
    def identity(self) -> dict: ...

    def encode(self, text: str | bytes) -> np.ndarray: ...

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...


class ByteTokenizer:
    """Bytes as tokens: ids 0..255 are bytes, 256 is end-of-document. Lossless for any input."""

    name = "byte"
    vocab_size = 257
    eos_id = 256
    text_cut = "line"
    lossless = True  # bytes that are not UTF-8 are kept, never replaced

    @property
    def identity(self) -> dict:
        return {"name": self.name, "kind": "byte", "hash": BYTE_HASH, "source": "byte"}

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text if isinstance(text, (bytes, bytearray, memoryview)) else text.encode("utf-8")
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64)

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode_bytes(self, ids: Sequence[int] | np.ndarray) -> bytes:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() > self.eos_id):
            raise ValueError(f"byte tokenizer ids must lie in [0, {self.eos_id}]")
        return arr[arr != self.eos_id].astype(np.uint8).tobytes()

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer` (a `tokenizer.json`): the BPE trained here or a Hugging Face model's."""

    lossless = False  # text that is not UTF-8 is decoded with U+FFFD replacing the bad bytes

    def __init__(self, backend, name: str, digest: str, source: str, eos_id: int | None = None,
                 text_cut: str | None = None) -> None:
        self._backend = backend
        self.name = name
        self.vocab_size = int(backend.get_vocab_size(with_added_tokens=True))
        self.eos_id = int(eos_id) if eos_id is not None else _eos_from_vocab(backend, source)
        self.text_cut = text_cut
        self._hash = digest
        self._source = source
        with_special = backend.encode("a").ids
        plain = backend.encode("a", add_special_tokens=False).ids
        cut = len(with_special) - len(plain)
        # Special tokens the tokenizer puts before a text (Llama's <|begin_of_text|>) start each document.
        self.prefix = np.asarray(with_special[:cut] if cut > 0 and with_special[cut:] == plain else [],
                                 dtype=np.int64)

    @property
    def identity(self) -> dict:
        return {"name": self.name, "kind": "tokenizers", "hash": self._hash, "source": self._source,
                "eos_id": self.eos_id}

    @staticmethod
    def _text(text: str | bytes) -> str:
        return text if isinstance(text, str) else bytes(text).decode("utf-8", errors="replace")

    def encode(self, text: str | bytes) -> np.ndarray:
        ids = self._backend.encode(self._text(text), add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int64)

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        out = self._backend.encode_batch([self._text(t) for t in texts], add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in out]

    def encode_documents(
        self, texts: Sequence[str | bytes], dtype: str = "int64"
    ) -> tuple[np.ndarray, list[int]]:
        """Documents as one id array (each: the tokenizer's prefix, its ids, end-of-document) and
        their lengths; one conversion to numpy for the whole batch."""
        out = self._backend.encode_batch([self._text(t) for t in texts], add_special_tokens=False)
        prefix, eos = self.prefix.tolist(), self.eos_id
        flat: list[int] = []
        lengths: list[int] = []
        for e in out:
            ids = e.ids
            flat += prefix
            flat += ids
            flat.append(eos)
            lengths.append(len(prefix) + len(ids) + 1)
        return np.asarray(flat, dtype=dtype), lengths

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._backend.decode([int(i) for i in np.asarray(ids).reshape(-1)])

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))


BPETokenizer = HFTokenizer  # the locally trained BPE is a tokenizer.json like any other


def _import_tokenizers(what: str = "this tokenizer"):
    try:
        import tokenizers
    except ImportError as err:
        raise ConfigError(
            "data.tokenizer",
            f"{what} needs the `tokenizers` package, which is not installed. Install it with "
            "`pip install tokenizers`, or use data.tokenizer=byte.",
        ) from err
    return tokenizers


def _eos_from_vocab(backend, source: str) -> int:
    for token in EOS_CANDIDATES:
        tid = backend.token_to_id(token)
        if tid is not None:
            return int(tid)
    raise ConfigError(
        "data.tokenizer",
        f"{source!r} has no end-of-document token: none of {', '.join(EOS_CANDIDATES)} is in its vocabulary "
        "and no tokenizer_config.json / config.json beside it names an eos token. Add one of these tokens "
        "to the tokenizer (as a special token) or put it in a directory whose config.json has eos_token_id.",
    )


def _read_json(path: Path) -> dict:
    """A small JSON file beside a tokenizer ({} when absent or not an object); one nested beyond the
    bound, or not a regular file, is a ConfigError naming it."""
    from ntp_nemo.data.bounded_json import JSONBoundError, read_json

    try:
        value = read_json(path, 16 << 20)
    except JSONBoundError as err:
        raise ConfigError("data.tokenizer", f"{str(path)!r} cannot be used: {err}. Replace it with the file "
                                            "the tokenizer's authors published, or remove it.") from None
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _eos_from_dir(backend, directory: Path) -> int | None:
    """The end-of-document id a HF model directory declares, if any."""
    tok_cfg = _read_json(directory / "tokenizer_config.json")
    token = tok_cfg.get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str) and backend.token_to_id(token) is not None:
        return int(backend.token_to_id(token))
    for name in ("generation_config.json", "config.json"):
        eos = _read_json(directory / name).get("eos_token_id")
        if isinstance(eos, list) and eos:
            eos = eos[0]
        if isinstance(eos, int) and 0 <= eos < backend.get_vocab_size(with_added_tokens=True):
            return eos
    return None


def tokenizer_json_of(spec: str | Path) -> Path | None:
    """The `tokenizer.json` a spec names (the file, or a directory holding one), else None."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    return path.resolve() if path.is_file() else None


def looks_like_path(spec: str) -> bool:
    return "/" in spec or spec.endswith(".json") or spec.startswith((".", "~"))


def text_cut_of(definition: dict) -> str | None:
    """Where a `tokenizer.json` lets a long text be cut exactly (see the module doc), else None.

    Only structures whose pieces provably encode like the whole qualify: no normalizer (it may look
    across the cut), no added token that holds whitespace or strips it (it could span or eat the
    cut), and a pre-tokenizer that always splits at the cut without marking the piece's start:
    byte-level with GPT-2's regex and no added prefix space, or Metaspace splitting on spaces (a
    piece that starts with a space gets no second prefix).
    """
    if definition.get("normalizer") is not None:
        return None
    for added in definition.get("added_tokens") or []:
        if added.get("lstrip") or added.get("rstrip") or any(c.isspace() for c in added.get("content", "")):
            return None
    pre = definition.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return "line"
    if pre.get("type") == "Metaspace" and pre.get("split", True) and pre.get("replacement", "▁") != " ":
        return "space"
    return None


def _eos_from_token(backend, token: str, path: str, key: str) -> int:
    tid = backend.token_to_id(token)
    if tid is not None:
        return int(tid)
    try:
        specials = [t.content for t in backend.get_added_tokens_decoder().values() if t.special]
    except AttributeError:  # older `tokenizers`
        specials = []
    hint = f" Its special tokens: {', '.join(specials[:8])}." if specials else ""
    raise ConfigError(key, f"{token!r} is not a token of the tokenizer {path!r}.{hint} Name a token its "
                           "vocabulary holds (e.g. the one that ends a document in its model's training "
                           "data), or leave the end-of-document token out to use the tokenizer's own.")


@functools.lru_cache(maxsize=8)
def load_tokenizer_json(path: str, eos_token: str | None = None,
                        eos_key: str = "data.eos_token") -> HFTokenizer:
    """A tokenizer from a `tokenizer.json` (cached per process: workers reuse it); `eos_token` names
    the end-of-document token instead of the one the directory declares."""
    tk = _import_tokenizers(f"the tokenizer {path!r}")
    p = Path(path)
    try:
        blob = read_regular(p, 1 << 30)  # never blocks on a FIFO
        text = blob.decode("utf-8")
        definition = parse_json(text)  # bounded: a deeply nested file is refused before the library sees it
        backend = tk.Tokenizer.from_str(text)
    except Exception as err:  # noqa: BLE001 - the library raises a bare Exception on bad files
        raise ConfigError(
            "data.tokenizer",
            f"{path!r} is not a readable Hugging Face tokenizer.json ({err}). Point data.tokenizer (or "
            "ntp-preprocess --tokenizer) at a tokenizer.json or at a model directory holding one.",
        ) from err
    name = p.parent.name if p.name == "tokenizer.json" and p.parent.name else p.stem
    if eos_token:
        eos = _eos_from_token(backend, eos_token, path, eos_key)
    else:
        eos = _eos_from_dir(backend, p.parent)
    return HFTokenizer(backend, f"hf:{name}", hashlib.sha256(blob).hexdigest()[:16], str(p), eos,
                       text_cut_of(definition if isinstance(definition, dict) else {}))


def bpe_tokenizer_path(vocab_size: int = BPE_VOCAB_SIZE) -> Path:
    from ntp_nemo.data.stdlib_text import DEFAULT_MAX_BYTES, corpus_identity

    key = fingerprint({"corpus": corpus_identity(DEFAULT_MAX_BYTES), "vocab_size": vocab_size, "v": 1})
    return cache_dir("tokenizers") / f"bpe-{vocab_size}-{key}.json"


def train_bpe(documents, vocab_size: int = BPE_VOCAB_SIZE, eos: str = BPE_EOS):
    """Train a byte-level BPE `tokenizers.Tokenizer` (GPT-2 style pre-tokenisation) on documents."""
    tk = _import_tokenizers("'bpe'")
    backend = tk.Tokenizer(tk.models.BPE())
    backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(documents, trainer=trainer)
    return backend


@functools.lru_cache(maxsize=2)
def load_bpe(vocab_size: int = BPE_VOCAB_SIZE, eos_token: str | None = None,
             eos_key: str = "data.eos_token") -> HFTokenizer:
    """The BPE tokenizer trained on the built-in corpus, training and caching it on first use."""
    path = bpe_tokenizer_path(vocab_size)
    if not path.exists():
        from ntp_nemo.data.stdlib_text import DEFAULT_MAX_BYTES, stdlib_documents

        backend = train_bpe(stdlib_documents(DEFAULT_MAX_BYTES), vocab_size)
        atomic_write_text(path, backend.to_str())
    tok = load_tokenizer_json(str(path), eos_token, eos_key)
    tok.name = "bpe"
    return tok


def eos_key_for(key: str) -> str:
    """The option naming the end-of-document token beside the tokenizer option `key`."""
    return "--eos-token" if key.startswith("--") else "data.eos_token"


def build_tokenizer(
    spec: str, key: str = "data.tokenizer", eos_token: str | None = None
) -> ByteTokenizer | HFTokenizer:
    """Tokenizer by config value: `byte`, `bpe`, a `tokenizer.json` or a directory holding one;
    `eos_token` (a token of its vocabulary) ends each document instead of the tokenizer's own."""
    spec = str(spec).strip()
    eos_token = eos_token or None
    eos_key = eos_key_for(key)
    if spec == "byte":
        if eos_token is not None:
            raise ConfigError(eos_key, f"is {eos_token!r}, but the byte tokenizer has no tokens to name: its "
                                       "end of document is id 256. Leave the end-of-document token out, or "
                                       "use a tokenizer.json tokenizer.")
        return ByteTokenizer()
    if spec == "bpe":
        return load_bpe(BPE_VOCAB_SIZE, eos_token, eos_key)
    found = tokenizer_json_of(spec)
    if found is not None:
        try:
            return load_tokenizer_json(str(found), eos_token, eos_key)
        except ConfigError as err:
            if err.key == eos_key:
                raise
            raise ConfigError(key, str(err).split(": ", 1)[1]) from err
    where = Path(spec).expanduser()
    hint = (f"{str(where)!r} is a directory without a tokenizer.json" if where.is_dir()
            else f"{str(where)!r} does not exist" if looks_like_path(spec) else f"unknown tokenizer {spec!r}")
    raise ConfigError(
        key,
        f"{hint}. Use byte (raw bytes), bpe (trained on the built-in corpus), the path of a Hugging Face "
        "tokenizer.json, or a model directory holding one (e.g. data.tokenizer=byte).",
    )


def tokenizer_identity(spec: str | None, eos_token: str | None = None) -> dict | None:
    """Identity (name, hash, vocab_size, eos_id) of a tokenizer spec without tokenizing anything;
    None for an empty spec; for a bare name (not byte/bpe/a path) just the name."""
    if spec in (None, ""):
        return None
    spec = str(spec)
    if spec in TOKENIZER_NAMES or tokenizer_json_of(spec) is not None or looks_like_path(spec):
        tok = build_tokenizer(spec, eos_token=eos_token)
        return dict(tok.identity, vocab_size=tok.vocab_size, eos_id=tok.eos_id)
    return {"name": spec, "hash": None}
