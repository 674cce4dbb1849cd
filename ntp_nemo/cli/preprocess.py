"""`ntp-preprocess`: tokenize text, JSON lines or Parquet files into a token file for `data.path=`.

    ntp-preprocess corpus/*.jsonl.zst --out data/tokens.bin --tokenizer hf_model_dir/ --workers 8

Inputs: files, directories and glob patterns; `.txt` (and any other text file: one document per
file), `.jsonl` / `.jsonl.gz` / `.jsonl.zst` (one document per line, its `--field`, default `text`)
and `.parquet` (one per row). Each document is followed by the tokenizer's end-of-document id (or
the one `--eos-token` names, which then is part of the token file's tokenizer identity). Documents
whose bytes were replaced (not UTF-8, under a tokenizer.json), empty documents and a tokenizer that
makes implausibly few tokens per byte are counted, reported and recorded in the sidecar's
`quality`; `--strict` makes any of them an error (exit 2, nothing written).
Writes `OUT` (uint16 or uint32 ids), `OUT.idx` (document index) and `OUT.json` (the sidecar: the
tokenizer's identity and hash, counts, the inputs), each under a temporary name renamed into place,
the sidecar last: an interrupted run leaves nothing that loads. Running again on the same inputs
with the same tokenizer does nothing; an `OUT` written with another tokenizer is refused.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ntp_nemo.data.readers import InputError, collect_inputs
from ntp_nemo.data.text_files import tokenize_to_file
from ntp_nemo.data.tokenizer import build_tokenizer
from ntp_nemo.data.tokens import index_path, read_sidecar, sidecar_path
from ntp_nemo.errors import ConfigError, cli_main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ntp-preprocess", description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="files (.txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet), directories or glob patterns")
    p.add_argument("--out", required=True, help="token file to write (plus OUT.idx and the sidecar OUT.json)")
    p.add_argument("--tokenizer", default="byte",
                   help="byte, bpe, a Hugging Face tokenizer.json or a model directory holding one "
                        "(default: byte)")
    p.add_argument("--eos-token", default=None, metavar="TOKEN",
                   help="token ending each document, e.g. '</s>' (default: the tokenizer's own)")
    p.add_argument("--strict", action="store_true",
                   help="exit 2 (writing nothing) on replaced bytes, empty documents or implausibly "
                        "few tokens")
    p.add_argument("--field", default="text", help="JSON / Parquet field holding the text (default: text)")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes (default: 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (the summary line stays)")
    return p


def run(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # One tokenizing thread per process: --workers decides the parallelism.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.workers < 1:
        raise ConfigError("--workers", f"must be >= 1, got {args.workers}. Use e.g. --workers "
                                       f"{os.cpu_count()}.")
    out = Path(args.out).expanduser().absolute()
    if out.is_dir():
        raise ConfigError("--out", f"{args.out!r} is a directory; name a file, e.g. {out / 'tokens.bin'}.")
    # A bad tokenizer or end-of-document token answers before reading anything.
    tok = build_tokenizer(args.tokenizer, key="--tokenizer", eos_token=args.eos_token)
    files, skipped = collect_inputs(args.inputs, key="INPUT")
    if not files or all(f.size == 0 for f in files):
        raise ConfigError("INPUT", f"the inputs {' '.join(args.inputs)!r} hold no data: "
                                   f"{'no files' if not files else 'every file is empty'}"
                                   f"{f' ({len(skipped)} binary files skipped)' if skipped else ''}. "
                                   "Give non-empty text, .jsonl(.gz/.zst) or .parquet files.")
    try:
        s = tokenize_to_file(files, args.tokenizer, out, args.field, args.workers,
                             progress=not args.no_progress and sys.stderr.isatty(),
                             eos_token=args.eos_token, strict=args.strict)
    except InputError as err:
        raise err.config_error() from err
    meta = read_sidecar(out) or {}
    names = f"{out} (+ {index_path(out).name}, {sidecar_path(out).name})"
    problems = s.quality.problems(tok.name) if s.quality is not None else []
    for problem in problems:
        print(f"warning: {problem} (recorded in {sidecar_path(out).name}; --strict refuses this)",
              file=sys.stderr)
    if s.up_to_date:
        print(f"up to date: {names} already holds {s.num_tokens} tokens in {s.num_documents} documents from "
              f"these {s.num_files} files with this tokenizer; nothing to do")
        return 0
    skipped_note = f", skipped {len(skipped)} binary" if skipped else ""
    rate = s.seconds if s.seconds > 0 else float("nan")
    print(
        f"wrote {s.num_tokens} tokens in {s.num_documents} documents ({meta.get('tokenizer')}, vocab "
        f"{meta.get('vocab_size')}, {meta.get('dtype')}) from {s.num_files} files{skipped_note} "
        f"({s.input_bytes / 1e6:.1f} MB) to {names} in {s.seconds:.2f}s: "
        f"{s.num_documents / rate:,.0f} docs/s, "
        f"{s.input_bytes / 1e6 / rate:.2f} MB/s, {args.workers} worker(s)"
    )
    return 0


main = cli_main(run)

if __name__ == "__main__":
    main()
