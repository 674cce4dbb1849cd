"""Logical tensors of an ntp_nemo sharded checkpoint, one at a time, in one process.

An exporter needs each parameter whole, but never the whole model twice: `CheckpointTensors`
reads only the requested logical tensors (every stored chunk of them, whatever layout wrote the
checkpoint) into fresh buffers through the checkpoint package's DCP reader.  The model config
comes from the checkpoint's `extra["model_config"]` when the run recorded it, else from the run
directory's record of the resolved run (`.hydra/run_spec.json`, `checkpoint/run_record.py`), else (a run
directory written before that record existed) from its Hydra record (`.hydra/config.yaml`), resolved
through `model.init_from` like the run.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from ntp_nemo.checkpoint.manifest import (
    MANIFEST,
    checkpoint_problem,
    invalid_checkpoint_error,
    latest_valid_checkpoint,
)
from ntp_nemo.checkpoint.run_record import read_run_spec, run_spec_path
from ntp_nemo.checkpoint.sharded import META_FILE, read_meta
from ntp_nemo.checkpoint.state import MODEL_PREFIX
from ntp_nemo.checkpoint.storage import Chunk, read_chunks, stored_tensors
from ntp_nemo.errors import ConfigError
from ntp_nemo.hf.config_map import resolve_model_config
from ntp_nemo.models.model_config import ModelConfig

ARG = "RUN_DIR_OR_CHECKPOINT"


def find_checkpoint(path: str | os.PathLike) -> Path:
    """`path` itself if it is a checkpoint, else the latest valid one of the run directory `path`."""
    p = Path(path).expanduser()
    if (p / MANIFEST).is_file():
        problem = checkpoint_problem(p)
        if problem is not None:
            raise invalid_checkpoint_error(p, problem, key=ARG)
        return p
    # A run directory's checkpoints live in checkpoints/ (its logs/, failover/ ... are not checkpoints).
    ckpt_dirs = [p / "checkpoints"] if (p / "checkpoints").is_dir() else [p]
    for d in ckpt_dirs:
        found = latest_valid_checkpoint(d, key=ARG)
        if found is not None:
            return found
    raise ConfigError(ARG, f"{str(path)!r} is neither a checkpoint (a directory holding {MANIFEST}) nor "
                           "a run directory with a valid checkpoint under checkpoints/. Pass RUN_DIR or "
                           "RUN_DIR/checkpoints/step_XXXXXX of a run that saved a checkpoint.")


def _run_dir_of(ckpt: Path) -> Path | None:
    for d in (ckpt.parent.parent, ckpt.parent, ckpt):
        if run_spec_path(d).is_file() or (d / ".hydra" / "config.yaml").is_file():
            return d
    return None


def run_record(ckpt: Path, group: str) -> dict | None:
    """Group `group` (`model`, `data`) of the run that wrote `ckpt`: from its resolved record
    (`run_spec.json`, derived values included), else its `.hydra/config.yaml`; None without either."""
    run_dir = _run_dir_of(ckpt)
    if run_dir is None:
        return None
    spec = read_run_spec(run_dir, key=ARG)
    if spec is not None:
        value = spec.get(group)
        return value if isinstance(value, dict) else {}
    from omegaconf import OmegaConf

    value = OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "config.yaml").get(group, {}),
                                   resolve=True)
    return value if isinstance(value, dict) else {}


def _model_config_from(fields: dict) -> ModelConfig:
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in fields.items() if k in known})


def checkpoint_model_config(ckpt: Path) -> ModelConfig:
    """The (resolved) model config a checkpoint was trained with."""
    if (ckpt / META_FILE).is_file():
        extra = read_meta(ckpt, key=ARG).get("extra") or {}  # weights_only; a pickled object: exit 2
        if isinstance(extra.get("model_config"), dict):
            return _model_config_from(extra["model_config"])
    model = run_record(ckpt, "model")
    if model is None:
        raise ConfigError(ARG, f"cannot tell which model {str(ckpt)!r} holds: it records no model config "
                               "and no run directory with .hydra/run_spec.json or .hydra/config.yaml "
                               "encloses it. Export from inside the run directory the checkpoint was "
                               "written to.")
    cfg = _model_config_from(model)
    if cfg.init_from and Path(cfg.init_from).expanduser().is_dir():
        return resolve_model_config(cfg)
    return dataclasses.replace(cfg, init_from=None)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Logical shape of every parameter of the unsharded model (built on the meta device: no memory)."""
    from ntp_nemo.models.transformer import DecoderLM

    with torch.device("meta"):
        model = DecoderLM(cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


class CheckpointTensors:
    """Reads whole logical parameters from checkpoint `ckpt`; `bytes_read` counts what was loaded."""

    def __init__(self, ckpt: str | os.PathLike) -> None:
        self.ckpt = Path(ckpt)
        self.stored = stored_tensors(self.ckpt)
        self.bytes_read = 0

    def check_model(self, cfg: ModelConfig) -> None:
        """Refuse a config whose parameters the checkpoint does not hold with the same shapes."""
        problems = []
        for name, shape in expected_shapes(cfg).items():
            st = self.stored.get(MODEL_PREFIX + name)
            if st is None:
                problems.append(f"{name} is missing")
            elif tuple(st.shape) != shape:
                problems.append(f"{name} has shape {list(st.shape)}, the model config implies {list(shape)}")
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise ConfigError(ARG, f"{str(self.ckpt)!r} does not hold the model its run config describes: "
                                   f"{'; '.join(problems[:3])}{more}.")

    def __call__(self, names: Sequence[str]) -> list[torch.Tensor]:
        """The logical tensors `names`, whole, read in one pass over the checkpoint files."""
        chunks = []
        for name in names:
            st = self.stored[MODEL_PREFIX + name]
            buf = torch.empty(st.shape, dtype=st.dtype)
            chunks.append(Chunk(MODEL_PREFIX + name, tuple(st.shape), (0,) * len(st.shape), buf))
        with warnings.catch_warnings():  # a single-process read is the intent here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            try:
                read_chunks(self.ckpt, chunks)
            except ValueError as err:  # a record that fails its digest or lies outside its file
                raise ConfigError(ARG, f"{err}. Export from an intact copy of the checkpoint (or an "
                                       "earlier one of the run).") from None
        self.bytes_read += sum(c.tensor.numel() * c.tensor.element_size() for c in chunks)
        return [c.tensor for c in chunks]


def iter_logical_tensors(ckpt: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """Every model parameter of checkpoint `ckpt` as (name, whole tensor), one at a time."""
    source = CheckpointTensors(ckpt)
    for key in sorted(source.stored):
        if key.startswith(MODEL_PREFIX):
            name = key[len(MODEL_PREFIX):]
            yield name, source([name])[0]
