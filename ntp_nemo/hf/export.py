"""Write a Hugging Face model directory from a checkpoint (`ntp-export`: `ntp_nemo/cli/export.py`).

    ntp-export outputs/llama_tiny/2025-01-01_12-00-00 hf_out
    ntp-export RUN_DIR/checkpoints/step_000150 hf_out --dtype bfloat16 --vocab-size 50257

Reads a sharded checkpoint of any layout one logical tensor at a time (GPT-2's fused `c_attn`:
its three parts), converts it to HF's layout and hands it to a writer that flushes a shard
whenever it reaches `--max-shard-size`; so at most one output shard is ever held in memory, never
the model twice.  Writes `config.json`, `generation_config.json` and `model.safetensors` (or
shards with `model.safetensors.index.json`), and the tokenizer the run trained with: its
`tokenizer.json` with the files beside it (`tokenizer_config.json`, ...), and a `tokenizer_config.json`
naming the end-of-document token when there is none (or `data.eos_token` chose another), so that
`AutoTokenizer.from_pretrained(OUT_DIR)` encodes as the run did. A run on the byte tokenizer has no
tokenizer files to write (said on the console); a run whose tokenizer file is gone is refused unless
`--no-tokenizer`. Files get the user's umask.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ntp_nemo.errors import ConfigError
from ntp_nemo.hf.config_map import generation_config, hf_config, read_hf_config
from ntp_nemo.hf.mapping import weight_map
from ntp_nemo.hf.safetensors_files import INDEX_FILE, HFWeightsWriter
from ntp_nemo.models.model_config import ModelConfig

Fetch = Callable[[Sequence[str]], list[torch.Tensor]]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json")
BYTE_EOS_ID = 256  # ntp_nemo's byte tokenizer: ids 0..255 are bytes, 256 ends a document


@dataclass(frozen=True)
class ExportReport:
    out_dir: Path
    files: list[str]
    tensors: int
    bytes_written: int
    note: str = ""  # what was not exported and why


@dataclass(frozen=True)
class RunTokenizer:
    """The tokenizer a run trained with, as its record names it."""

    spec: str | None  # byte | bpe | a tokenizer.json / directory; None: unknown (no record)
    eos_token: str | None = None  # data.eos_token
    eos_id: int | None = None  # recorded by the token file


def run_tokenizer(ckpt: Path) -> RunTokenizer:
    """From the run's record: `data.tokenizer` (chosen at start-up), else the token file's own."""
    from ntp_nemo.hf.checkpoint_source import run_record

    data = run_record(ckpt, "data")
    if data is None:
        return RunTokenizer(None)
    eos_token = data.get("eos_token") or None
    if data.get("tokenizer"):
        return RunTokenizer(str(data.get("tokenizer")), eos_token)
    path = data.get("path") or (data.get("blend") or [[None, None]])[0][1]
    if not path:
        return RunTokenizer("byte")  # the built-in corpus' default tokenizer
    from ntp_nemo.data.tokens import read_sidecar

    meta = read_sidecar(Path(str(path)).expanduser()) or {}
    source = (meta.get("tokenizer_identity") or {}).get("source") or meta.get("tokenizer")
    return RunTokenizer(None if source is None else str(source), eos_token, meta.get("eos_id"))


def _tokenizer_json(spec: str) -> Path | None:
    from ntp_nemo.data.tokenizer import bpe_tokenizer_path, tokenizer_json_of

    if spec == "bpe":
        return bpe_tokenizer_path()
    return tokenizer_json_of(spec)


def write_tokenizer_files(run_tok: RunTokenizer, out: Path) -> tuple[list[str], str]:
    """Write the run's tokenizer files into `out`: (the file names, a note on what was not written)."""
    if run_tok.spec == "byte":
        return [], ("no tokenizer files: the run trained on the byte tokenizer (ids 0..255 are UTF-8 bytes, "
                    "256 ends a document), which has no Hugging Face tokenizer")
    found = _tokenizer_json(run_tok.spec) if run_tok.spec else None
    if found is None or not found.is_file():
        raise ConfigError("RUN_DIR_OR_CHECKPOINT", f"the run trained with the tokenizer {run_tok.spec!r}, "
                                                   "which no longer exists, so the export would have no "
                                                   "tokenizer. Put the tokenizer back where it was, or pass "
                                                   "--no-tokenizer to export the weights alone.")
    from ntp_nemo.data.tokenizer import build_tokenizer

    tok = build_tokenizer(str(found), eos_token=run_tok.eos_token)
    names = []
    siblings = TOKENIZER_FILES if found.name == "tokenizer.json" and run_tok.spec != "bpe" else ()
    for name in siblings:
        if name != "tokenizer.json" and (found.parent / name).is_file():
            shutil.copyfile(found.parent / name, out / name)
            names.append(name)
    shutil.copyfile(found, out / "tokenizer.json")
    names.insert(0, "tokenizer.json")
    config_path = out / "tokenizer_config.json"
    config = _tokenizer_config(config_path, found.parent / "tokenizer_config.json") if config_path.is_file() \
        else {"tokenizer_class": "PreTrainedTokenizerFast"}
    eos = tok.id_to_token(tok.eos_id)
    if "tokenizer_config.json" not in names or run_tok.eos_token:
        config["eos_token"] = eos
        prefix = [int(i) for i in tok.prefix]
        if prefix and "bos_token" not in config:
            config["bos_token"] = tok.id_to_token(prefix[0])
        config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        if "tokenizer_config.json" not in names:
            names.append("tokenizer_config.json")
    return names, ""


def _tokenizer_config(copied: Path, source: Path) -> dict:
    """The `tokenizer_config.json` copied beside the export, read with the bounds of every JSON input
    (`data.bounded_json`); one that is not a bounded JSON object is a config error naming `source`."""
    from ntp_nemo.data.bounded_json import JSONInputError, read_json

    try:
        config = read_json(copied)
    except JSONInputError as err:
        why = str(err)
    else:
        if isinstance(config, dict):
            return config
        why = "not a JSON object"
    raise ConfigError("RUN_DIR_OR_CHECKPOINT", f"{source} cannot be exported with the tokenizer: {why}. "
                                               "Repair or remove that file, or pass --no-tokenizer to "
                                               "export the weights alone.")


def hf_tensors(cfg: ModelConfig, fetch: Fetch, vocab_size: int | None = None,
               dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors of a model, each assembled from whole logical tensors fetched on demand."""
    vocab = vocab_size or cfg.vocab_size
    for t in weight_map(cfg).tensors:
        parts = fetch(t.parts)
        full = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if t.vocab:
            full = full[:vocab]
        if t.transposed:
            full = full.t()
        yield t.name, full.to(dtype or full.dtype).contiguous()


def _prepare_out_dir(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError("OUT_DIR", f"{str(out_dir)!r} exists and is not a directory; name a new directory.")
    out_dir.mkdir(parents=True, exist_ok=True)
    old = sorted(out_dir.glob("model*.safetensors*")) + sorted(out_dir.glob("config.json"))
    if old and not force:
        raise ConfigError("OUT_DIR", f"{str(out_dir)!r} already holds a model ({old[0].name}). Name a new "
                                     "directory or pass --force to replace it.")
    for f in old:
        f.unlink()


def write_hf_dir(cfg: ModelConfig, fetch: Fetch, out_dir: str | os.PathLike, *, vocab_size: int | None = None,
                 dtype: torch.dtype | None = None, bos_token_id: int | None = None,
                 eos_token_id: int | None = None, max_shard_bytes: int = 5 * 10**9,
                 tokenizer_from: str | os.PathLike | None = None, force: bool = False,
                 run_tok: RunTokenizer | None = None) -> ExportReport:
    """Write `cfg`'s weights (read through `fetch`) as a HF model directory, with the tokenizer files of
    `run_tok` (the run's tokenizer), else those of the directory `tokenizer_from`."""
    if vocab_size is not None and not 0 < vocab_size <= cfg.vocab_size:
        raise ConfigError("--vocab-size", f"must lie in [1, {cfg.vocab_size}] (the model's vocabulary), got "
                                          f"{vocab_size}; it drops padded vocabulary rows.")
    out = Path(out_dir).expanduser()
    _prepare_out_dir(out, force)
    writer = HFWeightsWriter(out, max_shard_bytes)
    count = 0
    stored_dtype = None
    for name, tensor in hf_tensors(cfg, fetch, vocab_size, dtype):
        writer.add(name, tensor)
        stored_dtype = stored_dtype or tensor.dtype
        count += 1
    files = writer.close()
    dtype_name = str(stored_dtype).removeprefix("torch.")
    doc = hf_config(cfg, vocab_size, dtype_name, bos_token_id, eos_token_id)
    (out / "config.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config(bos_token_id, eos_token_id),
                                                           indent=2) + "\n")
    files += ["config.json", "generation_config.json"]
    note = ""
    if run_tok is not None and run_tok.spec is not None:
        names, note = write_tokenizer_files(run_tok, out)
        files += names
    elif tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_from) / name
            if src.is_file():
                shutil.copyfile(src, out / name)
                files.append(name)
    return ExportReport(out, files, count, writer.total_bytes, note)


def export_model(model: nn.Module, out_dir: str | os.PathLike, **options) -> ExportReport:
    """Export an unsharded in-memory `DecoderLM` (every parameter whole); options as `write_hf_dir`."""
    params = dict(model.named_parameters())
    sharded = [n for n, p in params.items() if not p.ntp_spec.is_full]
    if sharded:
        raise ValueError(f"export_model needs an unsharded model; {sharded[0]} is a shard. Save a checkpoint "
                         "and export that (export_checkpoint) instead.")
    return write_hf_dir(model.cfg, lambda names: [params[n].detach() for n in names], out_dir, **options)


def _token_ids(cfg: ModelConfig, run_tok: RunTokenizer) -> tuple[int | None, int | None]:
    """(bos, eos) for the exported config: those of the tokenizer the run trained with (its Hydra
    record's `data.tokenizer` and `data.eos_token`; the byte tokenizer's end-of-document id for the
    built-in corpus), else the Hugging Face directory's own when the run started from one, else unknown."""
    tokenizer = run_tok.spec
    if tokenizer == "byte":
        return (BYTE_EOS_ID, BYTE_EOS_ID) if cfg.vocab_size > BYTE_EOS_ID else (None, None)
    if tokenizer is not None:
        from ntp_nemo.data.tokenizer import build_tokenizer
        from ntp_nemo.errors import ConfigError

        try:
            tok = build_tokenizer(str(tokenizer), eos_token=run_tok.eos_token)
        except (ConfigError, OSError):
            tok = None
        if tok is not None:
            prefix = [int(i) for i in getattr(tok, "prefix", [])]
            return (prefix[0] if prefix else None), int(tok.eos_id)
    if cfg.init_from and Path(cfg.init_from).expanduser().is_dir():
        hf = read_hf_config(cfg.init_from)
        return hf.get("bos_token_id"), hf.get("eos_token_id")
    return None, None


def export_checkpoint(path: str | os.PathLike, out_dir: str | os.PathLike, *, cfg: ModelConfig | None = None,
                      vocab_size: int | None = None, dtype: torch.dtype | None = None,
                      bos_token_id: int | None = None, eos_token_id: int | None = None,
                      max_shard_bytes: int = 5 * 10**9, force: bool = False,
                      tokenizer: bool = True) -> ExportReport:
    """Export a run directory's latest valid checkpoint, or the checkpoint directory `path`.

    A run that started from a HF directory (`model.init_from`, still present) exports with that
    directory's vocabulary size, token ids and tokenizer files unless told otherwise.

    Runs in one process without torch.distributed (the checkpoint reader is otherwise collective).
    """
    from ntp_nemo.hf.checkpoint_source import CheckpointTensors, checkpoint_model_config, find_checkpoint

    ckpt = find_checkpoint(path)
    cfg = cfg or checkpoint_model_config(ckpt)
    source = CheckpointTensors(ckpt)
    source.check_model(cfg)
    run_tok = run_tokenizer(ckpt)
    bos, eos = _token_ids(cfg, run_tok)
    tokenizer_from = cfg.init_from if cfg.init_from and Path(cfg.init_from).expanduser().is_dir() else None
    if vocab_size is None and tokenizer_from is not None:  # drop the padding the import added
        vocab_size = int(read_hf_config(tokenizer_from)["vocab_size"])
    return write_hf_dir(cfg, source, out_dir, vocab_size=vocab_size, dtype=dtype,
                        bos_token_id=bos if bos_token_id is None else bos_token_id,
                        eos_token_id=eos if eos_token_id is None else eos_token_id,
                        max_shard_bytes=max_shard_bytes, tokenizer_from=tokenizer_from if tokenizer else None,
                        force=force, run_tok=run_tok if tokenizer else None)


def parse_size(text: str) -> int:
    """'5GB', '500MB', '20KB' or a byte count -> bytes (decimal units, as Hugging Face uses)."""
    units = {"GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    t = text.strip().upper()
    for suffix, mult in units.items():
        if t.endswith(suffix):
            t, scale = t[: -len(suffix)], mult
            break
    else:
        scale = 1
    try:
        value = int(float(t) * scale)
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError("--max-shard-size", f"{text!r} is not a size; use e.g. 5GB, 500MB or a byte count.")
    return value


__all__ = ["INDEX_FILE", "ExportReport", "export_checkpoint", "export_model", "hf_tensors", "parse_size",
           "write_hf_dir"]
