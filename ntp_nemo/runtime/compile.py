"""`trainer.compile`: regional compilation of a model slice's transformer blocks.

Each `Block` of the slice is compiled on its own (`nn.Module.compile`, in place: parameter names, the
state dict and the optimizer's references do not change), as torchtitan does, not the whole model: the
blocks share one code object, so a stage of many layers compiles it once per distinct set of shapes and
TP context, and the embedding, the head and the vocabulary-parallel cross entropy stay eager.  The first
call of each block compiles (lazily, on every rank at the same point of the step).

What runs inside a compiled block with TP > 1: the region collectives of `parallel/comm.py`
(`_CopyToTP`, `_ReduceFromTP`: `dist.all_reduce` inside `torch.autograd.Function`s) are traced by Dynamo
into the block's graph as functional collectives (forward and backward), one graph per block, no break
(tests/runtime/test_compiled_blocks.py, `torch._dynamo.explain`; gloo on CPU).  Two options would break
the graph and
are refused (`compile_refusal`): sequence parallelism (the `ReplicatedGradReducer` backward asks autograd
for its graph task id, which Dynamo cannot trace) and `ntp.tp_overlap` (`async_op=True` collectives,
which Dynamo does not trace): 4 and 8 graph breaks in a block of gpt_tiny at TP 2
(docs/performance.md, compile).  Quantisation-aware training
is refused as well: its modelopt quantisers were not run under compilation.

The first step compiles (15 to 50 s for the models of the tests and benchmarks on 2 shared cores, cold
cache). The ranks of a TP group compile the same graphs side by side, so no collective waits long on a
peer still compiling: forked TP-2 workers with a 15 s collective timeout passed a 43 s first step. No
phase is reported during that step, so the heartbeat of a compiled run calls it start-up (`setup`,
bounded by `fault.startup_timeout_s`, `resilience/heartbeat.py`): a cold TP-2 run with
`fault.heartbeat_timeout_s=10` was taken for a hang and restarted until `fault.max_restarts` ran out
before.  Not covered: blocks recompiled after a live reshard (new shapes) in a later step.

Inductor draws random numbers with its own generator unless told otherwise; `fallback_random` makes a
compiled dropout draw the eager masks from the same generator state, so every TP rank of a replica
still draws the same mask and a compiled run matches the uncompiled one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ntp_nemo.errors import ConfigError

BACKEND = "inductor"


def compile_refusal(*, sequence_parallel: bool, tp_overlap: bool,
                    quant: str | None, tp_chunks: int = 1) -> tuple[str, str] | None:
    """(key, reason) when `trainer.compile=true` cannot run with these options, else None; the config
    layer raises it as a ConfigError before anything is launched."""
    if sequence_parallel:
        return ("ntp.sequence_parallel", "trainer.compile=true does not support sequence parallelism: the "
                "replicated parameters' deferred gradient sum (ReplicatedGradReducer) breaks each compiled "
                "block's graph into pieces. Use ntp.sequence_parallel=false "
                "with trainer.compile=true, or trainer.compile=false.")
    if tp_overlap:
        return ("ntp.tp_overlap", "trainer.compile=true does not support ntp.tp_overlap: its asynchronous "
                "(async_op=True) collectives are not traced by torch.compile and break each block's graph. "
                "Use ntp.tp_overlap=false with trainer.compile=true, or trainer.compile=false.")
    if tp_chunks != 1:
        return ("ntp.tp_chunks", f"trainer.compile=true does not support ntp.tp_chunks={tp_chunks}: the "
                "chunked schedule runs each block's sublayers apart, around asynchronous (async_op=True) "
                "collectives, so no compiled block would run. Use ntp.tp_chunks=1 with "
                "trainer.compile=true, or trainer.compile=false.")
    if quant not in (None, "none"):
        return ("quant.format", f"trainer.compile=true has not been run with quantisation-aware training "
                f"(quant={quant}): its quantisers wrap the layers' forwards. Use quant=none with "
                "trainer.compile=true, or trainer.compile=false.")
    return None


def compile_blocks(model: Any, *, backend: str = BACKEND, options: Mapping[str, Any] | None = None) -> int:
    """Compile every transformer block of `model` (a `DecoderLM` slice: its `blocks`) in place; returns
    how many were compiled (0 for a slice without blocks).  `backend`: torch.compile's (`inductor`; the
    tests also trace with `aot_eager`); `options`: inductor options on top of `fallback_random`."""
    blocks = getattr(model, "blocks", None) or {}
    opts = {"fallback_random": True, **(options or {})} if backend == "inductor" else None
    for block in blocks.values():
        block.compile(backend=backend, options=opts)
    return len(blocks)


def validate_compile(cfg: Any) -> None:
    """Raise ConfigError for `trainer.compile` that is not a bool, or true with an option it refuses
    (`cfg`: the root config, a DictConfig or a mapping)."""
    def get(node: Any, key: str, default: Any = None) -> Any:
        if node is None:
            return default
        return node.get(key, default) if hasattr(node, "get") else getattr(node, key, default)

    on = get(get(cfg, "trainer"), "compile", False)
    if not isinstance(on, bool):
        raise ConfigError("trainer.compile", f"must be true or false, got {on!r}; trainer.compile=true "
                          "compiles each transformer block with torch.compile.")
    if not on:
        return
    ntp = get(cfg, "ntp")
    refused = compile_refusal(sequence_parallel=bool(get(ntp, "sequence_parallel", False)),
                              tp_overlap=bool(get(ntp, "tp_overlap", False)),
                              tp_chunks=get(ntp, "tp_chunks", 1),
                              quant=get(get(cfg, "quant"), "format", "none"))
    if refused is not None:
        raise ConfigError(*refused)


__all__ = ["BACKEND", "compile_blocks", "compile_refusal", "validate_compile"]
