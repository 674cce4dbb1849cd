"""`ntp-eval CHECKPOINT TOKENS`: the loss and perplexity of a checkpoint's weights on a token file.

The checkpoint (or the latest valid one of a run directory) is read whole, whatever layout wrote it,
into the unsharded model in one process, and scored on windows of `--seq-len + 1` tokens of a token
file written by `ntp-preprocess` (the same windows training cuts: sample i starts at token
i * seq_len). The loss is the mean per-token cross-entropy, as training reports it (summed per-token
losses over the predicted tokens), so the weights of step k scored on the samples of step k + 1's
global batch give the loss training recorded for step k + 1. Perplexity is exp(loss).

    ntp-eval outputs/gpt_tiny/RUN tokens.bin               # every window of the file
    ntp-eval RUN/checkpoints/step_000050 tokens.bin --samples 64 --seq-len 128 --json
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ntp_nemo.errors import ConfigError, cli_main
from ntp_nemo.models.families import family_of


@dataclass(frozen=True)
class Evaluation:
    checkpoint: str
    tokens_file: str
    seq_len: int
    samples: int  # windows scored
    tokens: int  # tokens predicted (samples * seq_len)
    loss: float  # mean per-token cross-entropy (nats)
    perplexity: float


def _run_seq_len(ckpt: Path) -> int | None:
    """`data.seq_len` of the run that wrote `ckpt` (its `.hydra/config.yaml`), if it is found."""
    from omegaconf import OmegaConf

    for d in (ckpt.parent.parent, ckpt.parent, ckpt):
        record = d / ".hydra" / "config.yaml"
        if record.is_file():
            value = OmegaConf.select(OmegaConf.load(record), "data.seq_len", default=None)
            return int(value) if value is not None else None
    return None


def load_checkpoint_model(path: str | os.PathLike):
    """(checkpoint directory, the unsharded model holding its weights, in float32, in eval mode)."""
    import torch

    from ntp_nemo.hf.checkpoint_source import CheckpointTensors, checkpoint_model_config, find_checkpoint
    from ntp_nemo.models.transformer import DecoderLM

    ckpt = find_checkpoint(path)
    cfg = checkpoint_model_config(ckpt)
    source = CheckpointTensors(ckpt)
    source.check_model(cfg)
    model = DecoderLM(cfg)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p, tensor in zip(params.values(), source(list(params)), strict=True):
            p.copy_(tensor.to(torch.float32))
    return ckpt, model.float().eval()


def evaluate(path: str | os.PathLike, tokens_path: str | os.PathLike, seq_len: int | None = None,
             samples: int | None = None, batch_size: int = 8) -> Evaluation:
    """Score the first `samples` windows (all when None) of `tokens_path` with the checkpoint's weights."""
    import numpy as np
    import torch

    from ntp_nemo.data.dataset import TokenDataset
    from ntp_nemo.data.tokens import open_token_file

    if batch_size < 1:
        raise ConfigError("--batch-size", f"must be >= 1, got {batch_size}.")
    ckpt, model = load_checkpoint_model(path)
    cfg = model.cfg
    seq_len = seq_len or _run_seq_len(ckpt)
    if seq_len is None:
        raise ConfigError("--seq-len", f"no run record (.hydra/config.yaml) beside {str(ckpt)!r} says the "
                                       "run's data.seq_len: pass --seq-len N.")
    if seq_len < 1 or (family_of(cfg).learned_positions and seq_len > cfg.max_seq_len):
        raise ConfigError("--seq-len", f"{seq_len} is not a sequence length this model takes (1 to "
                                       f"model.max_seq_len={cfg.max_seq_len}).")
    try:
        tf = open_token_file(tokens_path)
    except ConfigError as err:
        problem = str(err).split(": ", 1)[-1].split(". Rewrite it with", 1)[0]
        raise ConfigError("TOKENS", f"{problem}. Write one with `ntp-preprocess TEXT_FILES --out tokens.bin "
                                    "--tokenizer TOKENIZER` (the run's tokenizer).") from None
    if tf.vocab_size > cfg.vocab_size:
        raise ConfigError("TOKENS", f"{str(tokens_path)!r} holds ids of a {tf.vocab_size}-token vocabulary "
                                    f"({tf.tokenizer}), more than the checkpoint's {cfg.vocab_size} rows: it "
                                    "was written with another tokenizer. Tokenize with the run's tokenizer.")
    data = TokenDataset(tf.tokens, seq_len)
    count = len(data) if samples is None else int(samples)
    if not 1 <= count <= len(data):
        raise ConfigError("--samples", f"{str(tokens_path)!r} holds {len(data)} windows of {seq_len}+1 "
                                       f"tokens; ask for 1 to {len(data)} (got {count}).")
    total = 0.0  # float64: many batches' sums without losing digits
    with torch.no_grad():
        for first in range(0, count, batch_size):
            ids = np.arange(first, min(count, first + batch_size), dtype=np.int64)
            total += float(model.loss_sum(data.batch(ids)).double())
    predicted = count * seq_len
    loss = total / predicted
    return Evaluation(str(ckpt), str(tokens_path), seq_len, count, predicted, loss,
                      math.exp(loss) if loss < 700 else math.inf)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ntp-eval", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("checkpoint", metavar="RUN_DIR_OR_CHECKPOINT",
                   help="a checkpoint directory (step_XXXXXX) or a run directory (its latest valid one)")
    p.add_argument("tokens", metavar="TOKENS",
                   help="a token file written by ntp-preprocess (with its sidecar)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="window length (default: the run's data.seq_len)")
    p.add_argument("--samples", type=int, default=None, help="score the first N windows (default: all)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass (default 8)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def run(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    result = evaluate(args.checkpoint, args.tokens, args.seq_len, args.samples, args.batch_size)
    if args.json:
        print(json.dumps(asdict(result), indent=2))
    else:
        print(f"checkpoint {result.checkpoint}\ntokens     {result.tokens_file}: {result.samples} windows of "
              f"{result.seq_len} tokens ({result.tokens} predicted)\nloss       {result.loss:.6f}\n"
              f"perplexity {result.perplexity:.4f}")
    return 0


main = cli_main(run)

if __name__ == "__main__":
    main()
