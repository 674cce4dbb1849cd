"""Checks of the memory and overlap options (`model.recompute`, `model.recompute_every`,
`optim.distributed`, `ntp.overlap_grad_sync`, `ntp.sequence_parallel`, `ntp.tp_overlap`, `ntp.tp_chunks`)
before anything is launched: the config layer's, so that `parallel/` never reads a config.  Imports
nothing heavy."""

from __future__ import annotations

from typing import Any

from ntp_nemo.errors import ConfigError

RECOMPUTE = ("none", "selective", "full")


def _get(node: Any, key: str, default: Any = None) -> Any:
    if node is None:
        return default
    return node.get(key, default) if hasattr(node, "get") else getattr(node, key, default)


def validate_memory_options(cfg: Any) -> None:
    """Raise ConfigError naming the key and the fix for an impossible value (`cfg`: the root config)."""
    model = _get(cfg, "model")
    mode = _get(model, "recompute", "none")
    if mode not in RECOMPUTE:
        raise ConfigError("model.recompute", f"unknown recomputation mode {mode!r}; use model.recompute="
                          "none, selective (attention core only, no communication redone) or full (whole "
                          "layers).")
    every = _get(model, "recompute_every", 1)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError("model.recompute_every", f"must be a positive integer (recompute every k-th layer "
                          f"with model.recompute=full), got {every!r}; e.g. model.recompute_every=2.")
    ntp = _get(cfg, "ntp")
    for key, node in (("optim.distributed", _get(cfg, "optim")), ("ntp.overlap_grad_sync", ntp),
                      ("ntp.sequence_parallel", ntp), ("ntp.tp_overlap", ntp)):
        value = _get(node, key.split(".")[1], False)
        if not isinstance(value, bool):
            raise ConfigError(key, f"must be true or false, got {value!r}.")
    _validate_tp_chunks(cfg, mode)
    fmt = _get(_get(cfg, "quant"), "format", "none")
    if _get(ntp, "sequence_parallel", False) and fmt not in (None, "none"):
        # Not made exact yet: an untied head's input quantiser would see one rank's sequence slice.
        raise ConfigError("ntp.sequence_parallel", f"sequence parallelism is not supported with quantisation-"
                          f"aware training (quant={fmt}) yet; use ntp.sequence_parallel=false with QAT, or "
                          "quant=none.")
    if _get(_get(cfg, "optim"), "distributed", False) and _get(_get(cfg, "fault"), "recovery") == "live":
        raise ConfigError("optim.distributed", "the distributed optimizer keeps each rank's share of the "
                          "AdamW state on that rank only, so a lost rank's share cannot be recovered in "
                          "memory; use fault.recovery=restart (resume from the last checkpoint) or "
                          "optim.distributed=false.")


def _validate_tp_chunks(cfg: Any, recompute: str) -> None:
    """`ntp.tp_chunks`: a positive integer, at most the micro-batch's sequences, not with whole layers
    recomputed (a layer's checkpoint reruns the whole layer, which the chunked schedule splits)."""
    chunks = _get(_get(cfg, "ntp"), "tp_chunks", 1)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ConfigError("ntp.tp_chunks", f"must be a positive integer (chunks of each micro-batch whose "
                          f"row-parallel collectives overlap the next chunk's compute; 1 = unchunked), got "
                          f"{chunks!r}; e.g. ntp.tp_chunks=2.")
    if chunks == 1:
        return
    micro = _get(_get(cfg, "data"), "micro_batch_size", None)
    if isinstance(micro, int) and not isinstance(micro, bool) and chunks > micro:
        raise ConfigError("ntp.tp_chunks", f"{chunks} chunks of a micro-batch of {micro} sequences "
                          f"(data.micro_batch_size={micro}) would leave chunks empty: the batch is split "
                          f"along its sequences; use ntp.tp_chunks<={micro}, or a larger "
                          "data.micro_batch_size.")
    if recompute == "full":
        raise ConfigError("ntp.tp_chunks", f"ntp.tp_chunks={chunks} does not run with model.recompute=full: "
                          "a recomputed layer reruns as one piece, while the chunked schedule interleaves "
                          "the chunks' sublayers; use model.recompute=selective or none with ntp.tp_chunks, "
                          "or ntp.tp_chunks=1.")
