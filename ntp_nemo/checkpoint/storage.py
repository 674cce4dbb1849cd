"""The on-disk format of a sharded checkpoint: raw tensor bytes plus an index, digested as written.

Every rank writes its chunks (disjoint boxes of logical tensors, see `ownership.py`) as *records*:
the chunk's bytes in row-major order, straight from the tensor's memory (a `memoryview` of a
contiguous CPU tensor: no serialisation, no intermediate copy), 64-byte aligned, into a few
`data_<rank>_<k>.bin` files written in parallel by a thread pool (one file per thread, balanced
by bytes).  Each record is digested per `HASH_BLOCK` (1 MiB) block with xxh3-64, each block just
before it is written (still in cache), so integrity costs no second read; the record's digest is
the xxh3-64 of its block digests.  The records of all ranks form the index (`index.json`: per
tensor its global shape, dtype and records with file, byte offset, length, digest, block digests),
written by rank 0.

Reading fills target boxes in place: for each stored record that intersects a target, the rank
reads only the byte range it needs (`os.preadv` straight into the target when the box is
contiguous on both sides, else the record's rows holding the box into a scratch buffer) on a
thread pool.  Verification is per block: the caller assigns every block a rank reads to exactly one
of its readers (`assign_verifiers`), which reads that block whole (at most one extra block at each
end of its range) and checks it, so each stored byte a load needs is hashed once, by a rank that reads
it, and a rank that needs a third of a record reads about a third of it.  Records without block
digests are verified whole.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash

from ntp_nemo.checkpoint.files import DIGEST, INDEX_FILE, REQUIRED_FILES, read_index_doc, read_manifest

ALIGN = 64
HASH_BLOCK = 1 << 20  # bytes per block digest: hashed then written while still in cache
MAX_RECORDS = 1 << 16  # records of one tensor: writers make one per piece a rank owns (thousands at most)


@dataclass(frozen=True)
class Chunk:
    """A box of the logical tensor `key`: `tensor` sits at `offsets` inside `global_shape`."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor


@dataclass(frozen=True)
class StoredTensor:
    """What the checkpoint says about one logical tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Record:
    """One stored chunk: the box (`offsets`, `sizes`) of `key`, `nbytes` at `offset` in `file`."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    nbytes: int
    digest: str
    blocks: tuple[str, ...] = ()  # xxh3-64 of each `block_bytes` bytes; () = verified whole by `digest`
    block_bytes: int = 0

    @property
    def rid(self) -> tuple[str, int]:
        return self.file, self.offset

    @property
    def span(self) -> int:
        """Bytes per verification unit."""
        return self.block_bytes if self.blocks else max(1, self.nbytes)

    def units(self, lo: int, hi: int) -> range:
        """Verification units (block indices) overlapping bytes [lo, hi) of the record."""
        if not self.blocks:
            return range(1)
        return range(lo // self.span, max(lo // self.span + 1, -(-hi // self.span)))

    def unit_bytes(self, k: int) -> tuple[int, int]:
        """Byte range [lo, hi) of verification unit `k` in the record."""
        return k * self.span, min((k + 1) * self.span, self.nbytes)

    def unit_digest(self, k: int) -> str:
        return self.blocks[k] if self.blocks else self.digest


@dataclass
class ReadStats:
    """What one rank's read did: bytes read, records whose digest it checked, and failures found."""

    bytes_read: int = 0
    verified: list[tuple[str, int, int]] = field(default_factory=list)  # (file, record offset, block)
    problems: list[str] = field(default_factory=list)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in the checkpoint index")
    return dtype


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying (writable when the tensor is)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _contiguous_cpu(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu" and t.is_contiguous():
        return t
    return t.to("cpu").contiguous()


# ---- write --------------------------------------------------------------------------------------
def _write_all(fd: int, mv: memoryview) -> None:
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]


def _write_file(path: Path, chunks: Sequence[Chunk], sync: bool) -> list[Record]:
    records = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # the umask decides, as for open()
    try:
        pos = 0
        for c in chunks:
            data = byte_view(_contiguous_cpu(c.tensor.detach()))
            blocks = []
            for start in range(0, len(data), HASH_BLOCK):
                block = data[start : start + HASH_BLOCK]
                blocks.append(xxhash.xxh3_64_hexdigest(block))
                _write_all(fd, block)
            digest = xxhash.xxh3_64_hexdigest("".join(blocks).encode())
            records.append(Record(c.key, tuple(c.offsets), tuple(c.tensor.shape), path.name, pos, len(data),
                                  digest, tuple(blocks), HASH_BLOCK))
            pos += len(data)
            pad = -pos % ALIGN
            if pad:
                _write_all(fd, memoryview(bytes(pad)))
                pos += pad
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return records


def _balanced_bins(chunks: Sequence[Chunk], n: int) -> list[list[Chunk]]:
    bins: list[list[Chunk]] = [[] for _ in range(n)]
    load = [0] * n
    for c in sorted(chunks, key=lambda c: -c.tensor.numel() * c.tensor.element_size()):
        i = load.index(min(load))
        bins[i].append(c)
        load[i] += c.tensor.numel() * c.tensor.element_size()
    return [b for b in bins if b]


def write_records(directory: Path, rank: int, chunks: Sequence[Chunk], threads: int = 4,
                  sync: bool = True) -> list[Record]:
    """Write this rank's chunks as records into `directory` (files in parallel); returns the records."""
    bins = _balanced_bins(chunks, max(1, min(threads, len(chunks))))
    paths = [Path(directory) / f"data_{rank:05d}_{k}.bin" for k in range(len(bins))]
    if len(bins) <= 1:
        return [r for p, b in zip(paths, bins, strict=True) for r in _write_file(p, b, sync)]
    with ThreadPoolExecutor(len(bins), thread_name_prefix="ntp-ckpt-write") as pool:
        futures = [pool.submit(_write_file, p, b, sync) for p, b in zip(paths, bins, strict=True)]
        return [r for f in futures for r in f.result()]


def index_doc(records: Iterable[Record], dtypes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict:
    """The index document: key -> shape, dtype, records (sorted by offsets)."""
    tensors: dict[str, dict] = {key: {"shape": list(shape), "dtype": dtype_name(dtype), "records": []}
                                for key, (shape, dtype) in sorted(dtypes.items())}
    for r in records:
        tensors[r.key]["records"].append({"offsets": list(r.offsets), "sizes": list(r.sizes), "file": r.file,
                                          "offset": r.offset, "nbytes": r.nbytes, DIGEST: r.digest,
                                          "block_bytes": r.block_bytes, "blocks": list(r.blocks)})
    for t in tensors.values():
        t["records"].sort(key=lambda r: r["offsets"])
    return {"digest": DIGEST, "tensors": tensors}


def write_index(directory: Path, doc: dict) -> None:
    with open(Path(directory) / INDEX_FILE, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())


# ---- index ----------------------------------------------------------------------------------------
def _ints(value: object, n: int | None = None) -> bool:
    """A list of non-negative ints (of length `n`)."""
    return (isinstance(value, list) and (n is None or len(value) == n)
            and all(type(v) is int and v >= 0 for v in value))


def _record_problem(r: object, shape: list[int], item: int, sizes_of: dict[str, int]) -> str | None:
    if not isinstance(r, dict):
        return "is not an object"
    offsets, sizes = r.get("offsets"), r.get("sizes")
    if not _ints(offsets, len(shape)) or not _ints(sizes, len(shape)):
        return f"has offsets/sizes that are not {len(shape)} non-negative integers"
    if any(o + n > d for o, n, d in zip(offsets, sizes, shape, strict=True)):
        return f"lies outside the tensor's shape {shape}"
    name = r.get("file")
    if name not in sizes_of:
        return f"names a file the manifest does not list ({str(name)[:80]!r})"
    offset, nbytes = r.get("offset"), r.get("nbytes")
    if type(offset) is not int or offset < 0 or type(nbytes) is not int or nbytes < 0:
        return "has a negative or non-integer byte offset or size"
    if nbytes != math.prod(sizes) * item:
        return f"claims {nbytes} bytes for a box of {math.prod(sizes)} elements of {item} bytes"
    if offset + nbytes > sizes_of[name]:
        return f"reaches past the end of file {name} (bytes {offset}..{offset + nbytes})"
    if not isinstance(r.get(DIGEST), str):
        return f"has no {DIGEST} digest"
    blocks, block_bytes = r.get("blocks", []), r.get("block_bytes", 0)
    if (not isinstance(blocks, list) or not all(isinstance(b, str) for b in blocks)
            or type(block_bytes) is not int):
        return "has malformed block digests"
    if blocks and (block_bytes <= 0 or len(blocks) != -(-nbytes // block_bytes)):
        return f"has {len(blocks)} block digests, which do not cover its {nbytes} bytes"
    return None


def index_problem(doc: object, file_sizes: dict[str, int]) -> str | None:
    """What is wrong with an index document, checked against the data files the manifest lists
    (`file_sizes`: name -> size): every record must name one of them and lie inside it, and every
    size and offset must be a non-negative integer that agrees with the tensor's shape and dtype, so a
    load never opens another file or allocates what the checkpoint does not hold; a tensor's records
    must hold as many elements as its shape (the writers store disjoint pieces, each element once: a
    checkpoint that lost a writer's records is refused here, not when a load finds the hole)."""
    if not isinstance(doc, dict) or doc.get("digest") != DIGEST or not isinstance(doc.get("tensors"), dict):
        return f"{INDEX_FILE} is not an ntp_nemo checkpoint index"
    for key, t in doc["tensors"].items():
        what = f"{INDEX_FILE}: tensor {str(key)[:80]!r}"
        if not isinstance(t, dict) or not _ints(t.get("shape")) or not isinstance(t.get("records"), list):
            return f"{what} has no valid shape and records"
        try:
            item = torch.empty((), dtype=dtype_of(str(t.get("dtype")))).element_size()
        except (ValueError, RuntimeError, TypeError):
            return f"{what} has an unknown dtype {str(t.get('dtype'))[:40]!r}"
        for i, r in enumerate(t["records"]):
            problem = _record_problem(r, t["shape"], item, file_sizes)
            if problem is not None:
                return f"{what}, record {i} {problem}"
        if len(t["records"]) > MAX_RECORDS:
            return (f"{what} has {len(t['records'])} records, more than the {MAX_RECORDS} any writer "
                    f"makes")
        held, whole = sum(math.prod(r["sizes"]) for r in t["records"]), math.prod(t["shape"])
        if held != whole:
            return (f"{what} has records of {held} elements in all, not the {whole} of its shape "
                    f"{t['shape']} (a writer's records are missing or doubled)")
        pair = overlapping_records([r["offsets"] for r in t["records"]], [r["sizes"] for r in t["records"]])
        if pair is not None:
            i, j = pair
            return (f"{what} has records {i} and {j} that overlap (offsets {t['records'][i]['offsets']} and "
                    f"{t['records'][j]['offsets']}): some elements would be read twice and others never "
                    f"written")
    return None


def overlapping_records(offsets: Sequence[Sequence[int]],
                        sizes: Sequence[Sequence[int]]) -> tuple[int, int] | None:
    """Two boxes (indices) that share an element, or None. With every box inside the shape and their
    element counts adding up to the shape's, None proves the boxes tile the tensor exactly (no gap, no
    overlap). A sweep along the dimension with the most distinct starts keeps the open boxes few for
    the writers' row or column pieces; `MAX_RECORDS` bounds the worst case."""
    import numpy as np

    if not offsets:
        return None
    lo = np.asarray(offsets, dtype=np.int64).reshape(len(offsets), -1)
    hi = lo + np.asarray(sizes, dtype=np.int64).reshape(lo.shape)
    if lo.shape[1] == 0:  # scalars: any two records hold the one element twice
        return (0, 1) if len(offsets) > 1 else None
    live = np.flatnonzero(np.all(hi > lo, axis=1))  # empty boxes hold nothing
    if live.size < 2:
        return None
    axis = max(range(lo.shape[1]), key=lambda d: np.unique(lo[live, d]).size)
    order = live[np.argsort(lo[live, axis], kind="stable")]
    open_boxes = np.empty(0, dtype=np.int64)
    for i in order:
        open_boxes = open_boxes[hi[open_boxes, axis] > lo[i, axis]]
        if open_boxes.size:
            hit = np.all((lo[open_boxes] < hi[i]) & (lo[i] < hi[open_boxes]), axis=1)
            if hit.any():
                j = int(open_boxes[np.argmax(hit)])
                return (min(i, j), max(i, j))
        open_boxes = np.append(open_boxes, i)
    return None


@dataclass(frozen=True)
class Index:
    tensors: dict[str, StoredTensor]
    records: dict[str, list[Record]]

    @staticmethod
    def from_doc(doc: dict) -> Index:
        tensors, records = {}, {}
        for key, t in doc["tensors"].items():
            tensors[key] = StoredTensor(tuple(t["shape"]), dtype_of(t["dtype"]))
            records[key] = [Record(key, tuple(r["offsets"]), tuple(r["sizes"]), r["file"], r["offset"],
                                   r["nbytes"], r[DIGEST], tuple(r.get("blocks", ())),
                                   int(r.get("block_bytes", 0)))
                            for r in t["records"]]
        return Index(tensors, records)

    @staticmethod
    def read(directory: Path) -> Index:
        """The index of a checkpoint, checked against its manifest (`index_problem`); a damaged or
        foreign one raises `ValueError` naming the checkpoint and the problem."""
        try:
            files = read_manifest(directory).get("files")
            sizes = {name: want["size"] for name, want in files.items() if name not in REQUIRED_FILES}
            doc = read_index_doc(directory)
        except (OSError, ValueError, AttributeError, KeyError, TypeError) as err:
            raise ValueError(f"checkpoint {directory} is damaged: its manifest or index is unreadable "
                             f"({err})") from None
        problem = index_problem(doc, sizes)
        if problem is not None:
            raise ValueError(f"checkpoint {directory} is damaged: {problem}")
        return Index.from_doc(doc)


def stored_tensors(directory: Path) -> dict[str, StoredTensor]:
    """Global shape and dtype of every tensor in a checkpoint (reads only the index)."""
    return Index.read(directory).tensors


def stored_chunks(directory: Path) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """(offsets, sizes) of every stored chunk per tensor: what the files hold, for inspection and tests."""
    return {key: [(r.offsets, r.sizes) for r in recs] for key, recs in Index.read(directory).records.items()}


# ---- read -----------------------------------------------------------------------------------------
def _intersect(a_off, a_size, b_off, b_size) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    lo = tuple(max(x, y) for x, y in zip(a_off, b_off, strict=True))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a_off, a_size, b_off, b_size, strict=True))
    if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(h - lo_ for lo_, h in zip(lo, hi, strict=True))


def _box(t: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    for d, (o, s) in enumerate(zip(offsets, sizes, strict=True)):
        if o != 0 or s != t.shape[d]:
            t = t.narrow(d, o, s)
    return t


def plan_reads(index: Index, targets: Sequence[Chunk]) -> list[tuple[Record, Chunk, tuple, tuple]]:
    """Every (record, target, global box offsets, box sizes) this rank must copy."""
    out = []
    for t in targets:
        for r in index.records.get(t.key, ()):
            hit = _intersect(r.offsets, r.sizes, t.offsets, tuple(t.tensor.shape))
            if hit is not None:
                out.append((r, t, *hit))
    return out


def _read_into(fd: int, mv: memoryview, offset: int) -> int:
    got = 0
    while got < len(mv):
        n = os.preadv(fd, [mv[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def _rows(record: Record, box_off: tuple, box_size: tuple, item: int) -> tuple[int, int, int]:
    """(first row, rows, bytes per row) of the record holding the box (rows of its first dimension)."""
    shape = record.sizes
    if not shape:
        return 0, 1, item
    row = item * math.prod(shape[1:])
    return box_off[0] - record.offsets[0], box_size[0], row


def needed_bytes(record: Record, box_off: tuple, box_size: tuple, dtype: torch.dtype) -> tuple[int, int]:
    """Byte range [lo, hi) of the record a box needs (whole rows of its first dimension)."""
    r0, nrows, row = _rows(record, box_off, box_size, torch.empty((), dtype=dtype).element_size())
    return r0 * row, (r0 + nrows) * row


def _copy(record: Record, target: Chunk, box_off: tuple, box_size: tuple, dtype: torch.dtype,
          directory: Path, verify: Sequence[int], stats: ReadStats) -> None:
    """Copy the box from the record into the target; check the blocks `verify` of the record."""
    rel_rec = tuple(b - o for b, o in zip(box_off, record.offsets, strict=True))
    rel_tgt = tuple(b - o for b, o in zip(box_off, target.offsets, strict=True))
    dst = _box(target.tensor, rel_tgt, box_size)
    shape = record.sizes
    lo, hi = needed_bytes(record, box_off, box_size, dtype)
    elo, ehi = lo, hi  # widened to whole blocks at the ends when this rank checks them
    for k in verify:
        a, b = record.unit_bytes(k)
        elo, ehi = min(elo, a), max(ehi, b)
    rows_only = not shape or tuple(box_size[1:]) == tuple(shape[1:])  # the box is a contiguous byte range
    direct = dst.device.type == "cpu" and dst.is_contiguous() and dst.dtype == dtype
    try:  # a data file the index names, inside the checkpoint; never a link, a FIFO or a device
        fd = os.open(directory / record.file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as err:
        stats.problems.append(f"file {record.file} cannot be opened ({err.strerror})")
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            stats.problems.append(f"file {record.file} is not a regular file")
            return
        if direct and rows_only and (elo, ehi) == (lo, hi):
            mv = byte_view(dst)  # straight into the target: no scratch, no copy
            got = _read_into(fd, mv, record.offset + lo)
            src = None
        else:
            buf = torch.empty(ehi - elo, dtype=torch.uint8)
            mv = byte_view(buf)
            got = _read_into(fd, mv, record.offset + elo)
            src = buf[lo - elo : hi - elo].view(dtype)
            if shape:
                src = _box(src.view((box_size[0], *shape[1:])), (0, *rel_rec[1:]), box_size)
            else:
                src = src.view(())
    except OSError as err:
        stats.problems.append(f"file {record.file} cannot be read ({err.strerror})")
        return
    finally:
        os.close(fd)
    stats.bytes_read += got
    if got < len(mv):
        stats.problems.append(f"file {record.file} is truncated (record of {record.key} at byte "
                              f"{record.offset} needs {len(mv)} bytes, {got} there)")
        return
    for k in verify:
        a, b = record.unit_bytes(k)
        stats.verified.append((*record.rid, k))
        if xxhash.xxh3_64_hexdigest(mv[a - elo : b - elo]) != record.unit_digest(k):
            stats.problems.append(f"file {record.file} fails its {DIGEST} check at byte {record.offset + a} "
                                  f"({record.key}; corrupted)")
            return
    if src is not None:
        dst.copy_(src)


def read_records(directory: Path, index: Index, targets: Sequence[Chunk], verify: set[tuple[str, int, int]],
                 threads: int = 4) -> ReadStats:
    """Fill `targets` in place from the checkpoint's records; check the blocks in `verify` (each one a
    (file, record offset, block index) this rank reads).

    Returns what was read; failures (truncated or corrupted records) are listed in `problems`, not
    raised, so that all ranks can agree on them first.
    """
    directory = Path(directory)
    stats = ReadStats()
    jobs = plan_reads(index, targets)
    claimed: set[tuple[str, int, int]] = set()  # a block two of this rank's boxes touch is checked once
    work = []
    for record, target, off, size in jobs:
        lo, hi = needed_bytes(record, off, size, index.tensors[record.key].dtype)
        mine = [k for k in record.units(lo, hi)
                if (*record.rid, k) in verify and (*record.rid, k) not in claimed]
        claimed.update((*record.rid, k) for k in mine)
        work.append((record, target, off, size, mine))

    def run(job):
        record, target, off, size, mine = job
        local = ReadStats()
        _copy(record, target, off, size, index.tensors[record.key].dtype, directory, mine, local)
        return local

    if threads <= 1 or len(work) <= 1:
        parts = [run(j) for j in work]
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="ntp-ckpt-read") as pool:
            parts = list(pool.map(run, work))
    for p in parts:
        stats.bytes_read += p.bytes_read
        stats.verified += p.verified
        stats.problems += p.problems
    return stats


def assign_verifiers(index: Index, needs: Sequence[Sequence[tuple[tuple[str, int, int], bool]]]) -> list[set]:
    """Which rank checks which block: exactly one of the ranks reading it, balancing bytes hashed.

    `needs[r]` lists (block id, whether rank r reads that block whole).  A rank that reads the block
    whole is preferred (it reads nothing extra to check it).
    """
    records = {r.rid: r for recs in index.records.values() for r in recs}
    readers: dict[tuple[str, int, int], list[tuple[bool, int]]] = {}
    for rank, rank_needs in enumerate(needs):
        for uid, whole in rank_needs:
            readers.setdefault(tuple(uid), []).append((whole, rank))

    def size(uid: tuple[str, int, int]) -> int:
        a, b = records[uid[:2]].unit_bytes(uid[2])
        return b - a

    load = [0] * len(needs)
    out: list[set] = [set() for _ in needs]
    for uid in sorted(readers, key=lambda u: (-size(u), u)):
        rank = min(readers[uid], key=lambda wr: (not wr[0], load[wr[1]], wr[1]))[1]
        load[rank] += size(uid)
        out[rank].add(uid)
    return out


def reads_needed(index: Index, targets: Sequence[Chunk]) -> list[tuple[tuple[str, int, int], bool]]:
    """(block id, whole?) for every block of every record this rank reads."""
    out: dict[tuple[str, int, int], bool] = {}
    for r, _, off, size in plan_reads(index, targets):
        lo, hi = needed_bytes(r, off, size, index.tensors[r.key].dtype)
        for k in r.units(lo, hi):
            a, b = r.unit_bytes(k)
            uid = (*r.rid, k)
            out[uid] = out.get(uid, False) or (lo <= a and b <= hi)
    return list(out.items())


def read_chunks(directory: Path, targets: list[Chunk], threads: int = 4) -> ReadStats:
    """One process: fill each target tensor (in place) with its box of the stored tensor, checking
    the digest of every record it reads; a truncated or corrupted record raises `ValueError`."""
    index = Index.read(directory)
    stats = read_records(directory, index, targets, {uid for uid, _ in reads_needed(index, targets)}, threads)
    if stats.problems:
        raise ValueError(f"checkpoint {directory}: {stats.problems[0]}")
    return stats


def verify_all_records(directory: Path) -> str | None:
    """Check every record's digests (a full read of the data, for offline inspection); the first problem."""
    directory = Path(directory)
    for recs in Index.read(directory).records.values():
        for r in recs:
            with open(directory / r.file, "rb") as f:
                f.seek(r.offset)
                data = f.read(r.nbytes)
            if len(data) < r.nbytes:
                return f"file {r.file} is truncated (record of {r.key} at byte {r.offset})"
            for k in range(len(r.blocks) or 1):
                a, b = r.unit_bytes(k)
                if xxhash.xxh3_64_hexdigest(data[a:b]) != r.unit_digest(k):
                    return (f"file {r.file} fails its {DIGEST} check at byte {r.offset + a} "
                            f"({r.key}; corrupted)")
    return None
