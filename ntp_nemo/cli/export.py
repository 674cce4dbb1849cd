"""`ntp-export RUN_DIR_OR_CHECKPOINT OUT_DIR`: write a Hugging Face model directory.

    ntp-export outputs/llama_tiny/2025-01-01_12-00-00 hf_out
    ntp-export RUN_DIR/checkpoints/step_000150 hf_out --dtype bfloat16 --vocab-size 50257

What is written and how: `ntp_nemo/hf/export.py` (`export_checkpoint`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ntp_nemo.errors import cli_main
from ntp_nemo.hf.export import DTYPES, export_checkpoint, parse_size


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ntp-export", description=__doc__.split("\n\n")[0])
    p.add_argument("source", metavar="RUN_DIR_OR_CHECKPOINT",
                   help="a run directory (its latest valid checkpoint) or a checkpoint directory")
    p.add_argument("out_dir", metavar="OUT_DIR", help="Hugging Face model directory to write")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="dtype of the written weights (default: stored)")
    p.add_argument("--vocab-size", type=int, help="keep only the first N vocabulary rows (drop padding)")
    p.add_argument("--bos-id", type=int, help="bos_token_id of the exported config")
    p.add_argument("--eos-id", type=int, help="eos_token_id of the exported config")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    p.add_argument("--force", action="store_true", help="replace a model already in OUT_DIR")
    p.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer files")
    return p


def run(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    report = export_checkpoint(args.source, args.out_dir, vocab_size=args.vocab_size,
                               dtype=DTYPES[args.dtype] if args.dtype else None, bos_token_id=args.bos_id,
                               eos_token_id=args.eos_id, max_shard_bytes=parse_size(args.max_shard_size),
                               force=args.force, tokenizer=not args.no_tokenizer)
    print(f"wrote {report.tensors} tensors ({report.bytes_written / 1e6:.1f} MB) to {report.out_dir}: "
          f"{', '.join(report.files)}")
    if report.note:
        print(f"note: {report.note}")
    return 0


main = cli_main(run)

if __name__ == "__main__":
    main()
