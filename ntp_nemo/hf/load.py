"""Fill a (possibly sharded) ntp_nemo model with the weights of a Hugging Face directory.

Each rank reads, for each of its parameters, exactly the box of the HF tensor its `ntp_spec`
covers (`safe_open(...).get_slice(name)[box]`): no rank loads a whole tensor it shards, on any
layout, uniform or degraded, uneven shards included.  The box is computed in our coordinates and
then mapped to HF's: shifted by the part's offset inside a fused tensor (GPT-2 `c_attn`) and
transposed for Conv1D weights, so a column-parallel GPT-2 weight reads a column block of the HF
`[in, out]` matrix.  Vocabulary rows beyond the HF vocabulary (padding) are set to zero.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from ntp_nemo.errors import ConfigError
from ntp_nemo.hf.config_map import check_matches, read_hf_config
from ntp_nemo.hf.mapping import HFTensor, weight_map
from ntp_nemo.hf.safetensors_files import HFWeightsReader
from ntp_nemo.topology.shard import ShardSpec


@dataclass(frozen=True)
class LoadReport:
    """What one rank read: tensors filled and bytes taken from the safetensors files."""

    parameters: int
    bytes_read: int
    padded_rows: int  # vocabulary rows (of this rank's slices) beyond the HF vocabulary


def _our_box(spec: ShardSpec) -> list[tuple[int, int]]:
    return [(spec.start, spec.start + spec.length) if d == spec.dim else (0, n)
            for d, n in enumerate(spec.global_shape)]


def read_slice(reader: HFWeightsReader, source: HFTensor, key: str, part: str, spec: ShardSpec,
               hf_rows: int | None) -> tuple[torch.Tensor, int]:
    """This rank's slice of parameter `part` from HF tensor `key`; returns (tensor, padded rows)."""
    box = _our_box(spec)
    valid = box
    if source.vocab and hf_rows is not None:
        lo, hi = box[0]
        valid = [(lo, max(lo, min(hi, hf_rows))), *box[1:]]
    off = source.offset(part)
    hf_box = [(valid[0][0] + off, valid[0][1] + off), *valid[1:]]
    if source.transposed:
        hf_box = hf_box[::-1]
    data = reader.read(key, tuple(slice(a, b) for a, b in hf_box))
    if source.transposed:
        data = data.t()
    padded = (box[0][1] - box[0][0]) - (valid[0][1] - valid[0][0])
    if padded:
        full = torch.zeros(spec.local_shape, dtype=data.dtype)
        full[: data.shape[0]] = data
        data = full
    return data, padded


@torch.no_grad()
def load_hf_into(model: nn.Module, path: str | os.PathLike) -> LoadReport:
    """Copy the HF weights in `path` into this rank's slices of `model` (a `DecoderLM` or stage).

    The model must have been built from the config `resolve_model_config` derives from the same
    directory (checked; a contradiction raises ConfigError("model.init_from", ...)).  Works on a
    single process or on every rank independently (no collectives).
    """
    cfg = model.cfg
    hf = read_hf_config(path)
    check_matches(cfg, hf, str(path))
    hf_vocab = int(hf["vocab_size"])
    wmap = weight_map(cfg)
    sources = wmap.source_of()
    padded_rows = count = 0
    with HFWeightsReader(path) as reader:
        for name, p in model.named_parameters():
            source = sources[name]
            key = reader.resolve(source.name, wmap.base_prefix)
            stored = reader.shape(key)
            expected = hf_shape(source, p.ntp_spec.global_shape, hf_vocab)
            if stored != expected:
                raise ConfigError("model.init_from", f"tensor {key!r} in {str(path)!r} has shape "
                                  f"{list(stored)}, but its config.json implies {list(expected)}; the files "
                                  "do not match it.")
            data, padded = read_slice(reader, source, key, name, p.ntp_spec, hf_vocab)
            p.copy_(data)
            padded_rows += padded
            count += 1
        return LoadReport(count, reader.bytes_read, padded_rows)


def hf_shape(source: HFTensor, part_shape: tuple[int, ...], hf_vocab: int) -> tuple[int, ...]:
    """Shape of HF tensor `source`, given the logical shape of one of its parts."""
    rows = hf_vocab if source.vocab else sum(source.part_rows)
    shape = (rows, *part_shape[1:])
    return shape[::-1] if source.transposed else shape
