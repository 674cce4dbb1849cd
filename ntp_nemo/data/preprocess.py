"""`ntp-preprocess`: tokenize text files into a memory-mappable token file for `data.path=`.

    ntp-preprocess notes.txt books/ --out data/tokens.bin --tokenizer byte

Each input file becomes one document followed by the end-of-document id; directories contribute
their non-hidden text files in sorted order. Writes `OUT` and its sidecar `OUT.json`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

from ntp_nemo.data.text_files import expand_inputs, tokenize_files
from ntp_nemo.data.tokenizer import TOKENIZER_NAMES, build_tokenizer
from ntp_nemo.data.tokens import dtype_for_vocab, sidecar_path
from ntp_nemo.errors import ConfigError, cli_main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ntp-preprocess", description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="text files or directories of text files")
    p.add_argument("--out", required=True, help="token file to write (its sidecar is OUT.json)")
    p.add_argument("--tokenizer", default="byte", choices=TOKENIZER_NAMES, help="tokenizer (default: byte)")
    return p


def run(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    t0 = time.perf_counter()
    inputs = expand_inputs(args.inputs, key="INPUT")
    if not inputs.files:
        raise ConfigError("INPUT", "no text files found in the inputs (binary files are skipped).")
    out = Path(args.out).expanduser()
    if out.is_dir():
        raise ConfigError("--out", f"{args.out!r} is a directory; name a file, e.g. {out / 'tokens.bin'}.")
    tokenizer = build_tokenizer(args.tokenizer)
    n = tokenize_files(inputs.files, tokenizer, out)
    skipped = f", skipped {len(inputs.skipped)} binary" if inputs.skipped else ""
    print(
        f"wrote {n} tokens ({tokenizer.name}, vocab {tokenizer.vocab_size}, "
        f"{dtype_for_vocab(tokenizer.vocab_size)}) from {len(inputs.files)} files{skipped} to {out} "
        f"(+ {sidecar_path(out).name}) in {time.perf_counter() - t0:.2f}s"
    )
    return 0


main = cli_main(run)

if __name__ == "__main__":
    main()
