"""Test inputs for the data pipeline made here, nothing downloaded: documents cut from the built-in
corpus (the Python standard library's sources) and a small BPE `tokenizer.json` trained on them with
the `tokenizers` library."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def corpus_documents(max_bytes: int = 200_000, min_chars: int = 200) -> list[str]:
    """Paragraph-sized documents (blocks between blank lines, merged up to `min_chars`)."""
    from ntp_nemo.data.stdlib_text import stdlib_documents

    docs, current = [], ""
    for text in stdlib_documents(max_bytes):
        for block in text.split("\n\n"):
            current = f"{current}\n\n{block}" if current else block
            if len(current) >= min_chars:
                docs.append(current)
                current = ""
    if current:
        docs.append(current)
    return docs


def make_tokenizer_json(directory: Path, vocab_size: int = 320, eos: str = "<|endoftext|>") -> Path:
    """A byte-level BPE trained on the corpus, saved as `directory/tokenizer.json`."""
    from ntp_nemo.data.tokenizer import train_bpe

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    train_bpe(corpus_documents(100_000), vocab_size, eos).save(str(path))
    return path


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for i, doc in enumerate(docs):
            fh.write(json.dumps({"id": i, field: doc}) + "\n")
    return path


def run_preprocess(*args: str, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.setdefault("NTP_NEMO_CACHE", str(cwd / "cache"))
    return subprocess.run([sys.executable, "-m", "ntp_nemo.cli.preprocess", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def make_unigram_json(directory: Path, prepend_scheme: str = "always",
                      special: tuple[str, ...] = ("<unk>", "</s>", "<eod>")) -> Path:
    """A SentencePiece-style tokenizer (Unigram model, Metaspace pre-tokenizer, no normalizer) trained
    on the corpus, saved as `directory/tokenizer.json`; its end of document is `</s>`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend_scheme)
    tok.decoder = decoders.Metaspace(prepend_scheme=prepend_scheme)
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=list(special), unk_token="<unk>",
                                      show_progress=False)
    tok.train_from_iterator(corpus_documents(60_000), trainer)
    path = directory / "tokenizer.json"
    tok.save(str(path))
    return path
