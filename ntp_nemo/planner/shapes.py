"""Value objects the cost model reads: model shape, device speed, link speeds.

They are plain frozen dataclasses so the planner, the cluster simulator and the training
config can build them from YAML (`from_dict`) and share them without importing each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ntp_nemo.errors import ConfigError


def _from_mapping(cls: type, data: Mapping[str, Any], key: str) -> Any:
    """Build dataclass `cls` from a mapping, naming `key` in the error for unknown or bad fields."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(key, f"unknown field(s) {unknown}; known fields are {sorted(names)}.")
    try:
        return cls(**dict(data))
    except TypeError as err:
        raise ConfigError(key, f"{err}; give every required field of {cls.__name__}.") from err


def _positive(key: str, value: Any, kind: type = int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) or value <= 0:
        raise ConfigError(key, f"must be a positive {kind.__name__}, got {value!r}.")


# The integer sizes of a model (each a positive `model.*` key).
SIZE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size")


@dataclass(frozen=True)
class ModelShape:
    """Shape of a GPT-style decoder: everything the FLOP, byte and memory counts depend on.

    `num_kv_heads` (GQA groups) defaults to `num_heads`, `ffn_hidden_size` to 4 x hidden.
    `gated_mlp` marks a SwiGLU MLP (three FFN matrices instead of two).  A training model config's
    shape comes from its architecture family (`models.families.model_shape`).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None
    ffn_hidden_size: int | None = None
    seq_len: int | None = None
    tie_embeddings: bool = False
    gated_mlp: bool = False
    name: str = "model"

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        for field in SIZE_FIELDS:
            _positive(f"model.{field}", getattr(self, field))
        if self.seq_len is not None:
            _positive("model.seq_len", self.seq_len)
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                "model.num_heads",
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; "
                "choose num_heads dividing hidden_size.",
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                "model.num_kv_heads",
                f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}; "
                "each GQA group must hold the same number of query heads.",
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], key: str = "model") -> ModelShape:
        return _from_mapping(cls, data, key)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def attention_params(self) -> int:
        """q and o projections (h x h each) plus k and v (h x kv_dim each)."""
        h = self.hidden_size
        return 2 * h * h + 2 * h * self.num_kv_heads * self.head_dim

    @property
    def mlp_params(self) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden_size * self.ffn_hidden_size

    @property
    def layer_params(self) -> int:
        """Sharded parameters of one transformer layer (norms are replicated and ignored)."""
        return self.attention_params + self.mlp_params

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        head = 0 if self.tie_embeddings else self.embedding_params
        return self.embedding_params + self.num_layers * self.layer_params + head


@dataclass(frozen=True)
class DeviceModel:
    """Per-GPU compute speed and the bytes each parameter and activation occupies.

    `efficiency` is the fraction of peak that matmul kernels sustain (model FLOPs utilisation
    of a well-tuned run). `state_bytes_per_param`: 16 = bf16 weight and gradient, fp32 master
    weight and two Adam moments.
    """

    name: str = "H100"
    peak_tflops: float = 989.0
    efficiency: float = 0.45
    memory_gb: float = 80.0
    act_bytes: int = 2
    grad_bytes: int = 2
    state_bytes_per_param: int = 16

    def __post_init__(self) -> None:
        _positive("hardware.peak_tflops", self.peak_tflops, float)
        if not 0 < self.efficiency <= 1:
            raise ConfigError("hardware.efficiency", f"must be in (0, 1], got {self.efficiency!r}.")
        _positive("hardware.memory_gb", self.memory_gb, float)
        for field in ("act_bytes", "grad_bytes", "state_bytes_per_param"):
            _positive(f"hardware.{field}", getattr(self, field))

    @property
    def flops_per_s(self) -> float:
        return self.peak_tflops * 1e12 * self.efficiency

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], key: str = "hardware") -> DeviceModel:
        return _from_mapping(cls, data, key)


@dataclass(frozen=True)
class LinkModel:
    """alpha-beta link model: per-GPU, per-direction bandwidth and per-hop latency.

    Scale-up (NVLink inside a domain) carries TP collectives; scale-out (the NIC) carries
    pipeline sends and data-parallel gradient sync.
    """

    scale_up_gbps: float = 450.0
    scale_up_latency_us: float = 5.0
    scale_out_gbps: float = 50.0
    scale_out_latency_us: float = 10.0

    def __post_init__(self) -> None:
        _positive("links.scale_up_gbps", self.scale_up_gbps, float)
        _positive("links.scale_out_gbps", self.scale_out_gbps, float)
        for field in ("scale_up_latency_us", "scale_out_latency_us"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"links.{field}", f"must be a non-negative number, got {value!r}.")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], key: str = "links") -> LinkModel:
        return _from_mapping(cls, data, key)

    def allreduce_time(self, nbytes: float, ranks: int, scale_up: bool = True) -> float:
        """Ring all-reduce: 2(n-1) steps of latency and 2(n-1)/n of the payload per rank."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        bw, lat = self._link(scale_up)
        return 2 * (ranks - 1) * lat + 2 * (ranks - 1) / ranks * nbytes / bw

    def send_time(self, nbytes: float, scale_up: bool = False) -> float:
        """Point-to-point transfer of `nbytes` (pipeline stage boundary)."""
        bw, lat = self._link(scale_up)
        return lat + nbytes / bw

    def _link(self, scale_up: bool) -> tuple[float, float]:
        if scale_up:
            return self.scale_up_gbps * 1e9, self.scale_up_latency_us * 1e-6
        return self.scale_out_gbps * 1e9, self.scale_out_latency_us * 1e-6
