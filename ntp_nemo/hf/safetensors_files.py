"""Reading and writing the safetensors files of a Hugging Face model directory.

The reader opens the files lazily (memory-mapped by safetensors) and returns only the requested
box of a tensor, so a rank reads the bytes of its own shards and nothing else; it counts those
bytes.  The writer splits its output into shards of bounded size with the HF index file, so an
export never holds more than one shard in memory.
"""

from __future__ import annotations

import json
import os
import stat
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ntp_nemo.data.bounded_json import read_json
from ntp_nemo.errors import ConfigError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class HFWeightsReader:
    """Lazy access to the tensors of a HF directory (`model.safetensors`, or shards listed in an index)."""

    def __init__(self, path: str | os.PathLike, key: str = "model.init_from") -> None:
        self.path = Path(path).expanduser()
        self.key = key
        self.bytes_read = 0
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                doc = read_json(index, 64 << 20)
                self.weight_map: dict[str, str] = dict(doc["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise ConfigError(key, f"{str(index)!r} is not a valid safetensors index ({err!r}).") from err
        elif (self.path / SINGLE_FILE).is_file():
            self.weight_map = {name: SINGLE_FILE for name in self._open(SINGLE_FILE).keys()}  # type: ignore[attr-defined]
        else:
            found = sorted(p.name for p in self.path.glob("*.bin")) if self.path.is_dir() else []
            hint = (f" It holds {', '.join(found)}: convert it with transformers' save_pretrained(dir, "
                    "safe_serialization=True)." if found else "")
            raise ConfigError(key, f"{str(self.path)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}.{hint}")

    def _open(self, file: str):
        if file not in self._handles:
            if not isinstance(file, str) or os.path.basename(file) != file or file in ("", ".", ".."):
                raise ConfigError(self.key, f"{INDEX_FILE} of {str(self.path)!r} names {str(file)[:80]!r}, "
                                            "which is not a file of that directory.")
            target = self.path / file
            if target.exists() and not stat.S_ISREG(os.stat(target).st_mode):
                raise ConfigError(self.key, f"{str(target)!r}, listed in {INDEX_FILE}, is not a regular "
                                            "file.")
            if not target.is_file():
                raise ConfigError(self.key, f"{str(target)!r}, listed in {INDEX_FILE}, does not exist.")
            try:
                self._handles[file] = self._stack.enter_context(safe_open(str(target), framework="pt"))
            except (SafetensorError, OSError) as err:
                raise self._refused(target, err) from None
        return self._handles[file]

    def _refused(self, target: Path, err: Exception) -> ConfigError:
        reason = " ".join(str(err).split())[:200]
        return ConfigError(self.key, f"{str(target)!r} is not a safetensors file this project can read: the "
                                     f"safetensors library refuses it ({reason}). The file is damaged or was "
                                     "not written by safetensors; save the model again with transformers' "
                                     "save_pretrained(dir, safe_serialization=True).")

    def check_headers(self) -> None:
        """Open every weight file's header (what safetensors checks before any tensor is read): a crafted
        or damaged header is a ConfigError naming the file, before any worker starts."""
        for file in sorted(set(self.weight_map.values())):
            self._open(file)

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> HFWeightsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def resolve(self, name: str, base_prefix: str) -> str:
        """The stored key of tensor `name`; a bare base model's files lack `base_prefix`."""
        if name in self.weight_map:
            return name
        if name.startswith(base_prefix) and name[len(base_prefix):] in self.weight_map:
            return name[len(base_prefix):]
        raise ConfigError(self.key, f"{str(self.path)!r} has no tensor {name!r} although its config.json "
                                    "describes a model that needs it; the directory is incomplete or of "
                                    "another model.")

    def shape(self, key: str) -> tuple[int, ...]:
        file = self.weight_map[key]
        try:
            return tuple(self._open(file).get_slice(key).get_shape())
        except SafetensorError as err:
            raise self._refused(self.path / file, err) from None

    def read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The box `index` (one slice per dim) of stored tensor `key`; only that box is read."""
        file = self.weight_map[key]
        try:
            out = self._open(file).get_slice(key)[index]
        except SafetensorError as err:
            raise self._refused(self.path / file, err) from None
        self.bytes_read += out.numel() * out.element_size()
        return out


def user_file_mode() -> int:
    """The mode a new file gets under the process umask (safetensors writes its files 0600)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def shard_file_name(i: int, n: int) -> str:
    return SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


class HFWeightsWriter:
    """Writes tensors as `model.safetensors`, or as shards of at most `max_shard_bytes` plus the index."""

    def __init__(self, out_dir: str | os.PathLike, max_shard_bytes: int = 5 * 10**9) -> None:
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        part = self.out_dir / f".part-{len(self._written):05d}.safetensors"
        save_file(self._pending, str(part), metadata={"format": "pt"})
        self._written.append((part, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Finish: name the shards, write the index when there are several; returns the file names."""
        if self._pending or not self._written:
            self._flush()
        n = len(self._written)
        names, weight_map = [], {}
        mode = user_file_mode()
        for i, (part, tensors) in enumerate(self._written):
            final = shard_file_name(i, n)
            os.chmod(part, mode)
            os.replace(part, self.out_dir / final)
            names.append(final)
            weight_map.update({t: final for t in tensors})
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": dict(sorted(weight_map.items()))}
            (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
            names.append(INDEX_FILE)
        return names
