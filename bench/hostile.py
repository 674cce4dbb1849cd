"""Hostile clients against a live cluster coordinator, rehearsed on this machine.

    python bench/hostile.py [--heartbeat 2] [--hold 3] [--quick]

`ntp-coordinator` runs as the README's batch script starts it (its own process, its own store on
MASTER_PORT, `ntp_nemo.resilience.rehearsal.start_coordinator`), layout (2,2).  Its four tasks are
*lightweight*: threads of this process speaking the real link protocol (`cluster_protocol`: the hello,
sealed heartbeats every 0.1 s whose step moves, the goodbye), without training; the attacks come from an
outsider that does not hold the job's secret, on the link port and the store port, and from something
on the path of one task's link.  Two attacks go at a generation's rendezvous on the coordinator's store,
with two real ranks (spawned processes running `rendezvous.join`, as a task's recovery does): an outsider
that learnt the job's key prefix joins as a rank, and the keys torch's rendezvous wrote for one generation
are copied under the next one's prefix before it forms.  A task that dies while the job forms is
rehearsed against a second coordinator.  Two attacks the job cannot train through (every key of the store
deleted; a flood of values on the store, which the coordinator hosts) each go at a job of their own: the
job must stop at once, naming the attack (exit 75, every task told why, nobody declared lost).  The stored
inputs (a checkpoint naming /etc/passwd, a data file linked to /dev/zero, corrupt.json through a link, a
negative offset and a 1 TiB record, a FIFO in a checkpoint, out-of-range token ids, deeply nested JSON in a
sidecar and a tokenizer_config.json, a FIFO among a local job's heartbeat files, a full disk during a
save) go at the real checks in this process, on a real checkpoint, token file, tokenizer directory and
heartbeat directory (`stored_input_attacks`).

An attack is withstood when, after it, the coordinator still runs, every task still holds its place and
none was told it was lost, woken for a failure or told to stop, plus the check of the attack itself.
At the end the tasks finish and the coordinator must exit 0.  One row per attack; last line
`hostile clients: N/N attacks withstood`.  `--quick` leaves out the two rows with real ranks (spawned
processes, minutes on a loaded machine).
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ntp_nemo.resilience.cluster_protocol import LINK_KEY, Line, task_claim, task_hello
from ntp_nemo.resilience.rehearsal import free_port, start_coordinator
from ntp_nemo.resilience.store_auth import JobStore

SECRET = "bench-hostile-secret-0123456789"
LAYOUT = ["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,2]", "trainer.max_steps=100000"]


class Task:
    """A lightweight task: the real hello and heartbeats, a reader that keeps what the coordinator says."""

    def __init__(self, host: str, link_port: int, want: int, ntasks: int, *, via: int | None = None) -> None:
        self.line = Line(socket.create_connection((host, via or link_port), timeout=10))
        task_claim(self.line, SECRET.encode())  # as a real task does, the moment it connects
        nonce = self._next()["nonce"]
        task_hello(self.line, SECRET.encode(), nonce, want=want, ntasks=ntasks, host="bench", pid=0)
        self.reply = self._next()
        self.heard: list[dict] = []
        self.closed = False
        self.step, self.tick = 0, 0
        self._halt = threading.Event()
        self.line.sock.settimeout(None)
        if "place" in self.reply:
            threading.Thread(target=self._beat, daemon=True).start()
        threading.Thread(target=self._read, daemon=True).start()

    def _next(self) -> dict:
        while True:
            msgs = self.line.receive()
            if msgs is None:
                raise RuntimeError(f"the coordinator closed the link during the hello ({self.line.error})")
            if msgs:
                return msgs[0]

    def _beat(self) -> None:
        while not self._halt.wait(0.1):
            self.step += 1
            self.tick += 1
            if not self.line.send({"beat": [self.step, "step_start"], "tick": self.tick}):
                return

    def _read(self) -> None:
        while True:
            msgs = self.line.receive()
            if msgs is None:
                self.closed = True
                return
            self.heard.extend(msgs)

    def bye(self) -> None:
        self._halt.set()
        self.line.send({"bye": "done"})
        try:
            self.line.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass


class Proxy:
    """Something on the path of one task's link: forwards both ways, and can write to the task's side."""

    def __init__(self, host: str, port: int) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.target = (host, port)
        self.to_task: socket.socket | None = None
        self.up: socket.socket | None = None
        self.last_up = b""  # the last complete line the task sent (a sealed heartbeat, once it beats)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        task, _ = self.server.accept()
        up = socket.create_connection(self.target)
        self.to_task, self.up = task, up
        for a, b in ((task, up), (up, task)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        pending = b""
        try:
            while data := a.recv(65536):
                b.sendall(data)
                if a is self.to_task:
                    pending += data
                    if b"\n" in pending:
                        *lines, pending = pending.split(b"\n")
                        self.last_up = lines[-1] + b"\n"
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Drip:
    """`clients` strangers on the link port, each sending a byte of a hello every `every_s` and connecting
    again the moment it is dropped (the slow-drip attack that crowds the unproven connections)."""

    def __init__(self, port: int, clients: int, every_s: float = 2.0) -> None:
        self.port, self.every_s = port, every_s
        self.stop, self.connects = threading.Event(), 0
        self.threads = [threading.Thread(target=self._one, daemon=True) for _ in range(clients)]
        for th in self.threads:
            th.start()

    def _one(self) -> None:
        while not self.stop.is_set():
            try:
                sock = socket.create_connection(("127.0.0.1", self.port), timeout=self.every_s)
            except OSError:
                time.sleep(0.01)
                continue
            self.connects += 1
            with sock:
                while not self.stop.is_set():
                    try:
                        sock.sendall(b"{")
                        if sock.recv(4096) == b"":
                            break  # dropped: connect again at once
                    except TimeoutError:
                        continue
                    except OSError:
                        break

    def close(self) -> None:
        self.stop.set()
        for th in self.threads:
            th.join(timeout=10)


def hellos_under_drip(link_port: int, n: int, want: int, ntasks: int) -> tuple[int, int]:
    """`n` legitimate hellos (replacements: `ntasks` differs from the job's) while strangers drip:
    (answered, cut mid-hello)."""
    answered = cut = 0
    for _ in range(n):
        try:
            spare = Task("127.0.0.1", link_port, want, ntasks)
            answered += 1
            spare.bye()
            spare.line.close()
        except (RuntimeError, OSError):
            cut += 1
    return answered, cut


def _drain(sock: socket.socket) -> None:
    sock.settimeout(10)
    try:
        while sock.recv(65536):
            pass
    except OSError:
        pass
    sock.close()


def _rank(port: int, rank: int, secret: bytes, generation: int, timeout_s: float, out) -> None:
    """A rank forming `generation` on the coordinator's store through the project's rendezvous
    (`rendezvous.join`: signed keys, then the proof of the secret), then one all-reduce and one pickled
    object from rank 0.  An outsider is a rank that signs with a secret it guessed (it learnt the job's
    key prefix by listing the store)."""
    import torch

    from ntp_nemo.resilience.rendezvous import join

    torch.set_num_threads(1)
    job = JobStore(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)),
                   SECRET.encode())
    job._secret = secret  # the job's secret, or an outsider's guess under the job's listed prefix
    try:
        join(job, generation, rank, 2, timeout_s=timeout_s)
        t = torch.ones(1)
        dist.all_reduce(t)
        box = [{"from": "rank 0"}] if rank == 0 else [None]
        dist.broadcast_object_list(box, src=0)
        out.put((rank, "formed", f"sum {t.item():g}, object {box[0]}"))
        dist.destroy_process_group()
    except Exception as err:  # noqa: BLE001 - reported as the row's outcome
        out.put((rank, type(err).__name__, str(err).splitlines()[0][:160]))


def _ranks(port: int, secrets: list[bytes], generation: int, timeout_s: float = 30.0
           ) -> dict[int, tuple[str, str]]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # a fork would share the lightweight tasks' link sockets
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(port, r, secrets[r], generation, timeout_s, out))
             for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, kind, detail = out.get(timeout=120)
        got[rank] = (kind, detail)
    for p in procs:
        p.join(10)
    return got


# ---- stored inputs: what a crafted checkpoint, token file or tokenizer directory can make a load do -------
def _attempt(fn, *args, seconds: float = 20.0):
    """`fn(*args)` in a thread: what it raised (None when it returned); AssertionError when it blocked."""
    box: dict = {}

    def run() -> None:
        try:
            fn(*args)
            box["err"] = None
        except Exception as err:  # noqa: BLE001 - handed to the caller
            box["err"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} blocked for more than {seconds:g} s"
    return box["err"]


def stored_input_attacks(work: Path) -> list[tuple[str, object]]:
    """The stored-input attacks, each a (row name, function returning the row's detail) pair, on a real
    checkpoint (two saves of a small GPT, `save_checkpoint`), a real token file, a real tokenizer
    directory and a local job's heartbeat files (what its monitors read), rewritten the way an attacker
    would (digests in the manifest kept right).  Withstood: the real check refuses it before anything is
    read (a ConfigError naming the file and the problem), within 20 s, revealing nothing of the file
    outside; a heartbeat file reads as not reported; a save onto a full disk keeps the last checkpoint."""
    import errno
    import os
    import shutil

    import numpy as np

    import ntp_nemo.checkpoint.storage as storage
    from ntp_nemo.checkpoint import (
        CheckpointWriteError,
        checkpoint_name,
        latest_valid_checkpoint,
        require_valid_checkpoint,
        save_checkpoint,
    )
    from ntp_nemo.checkpoint.manifest import CORRUPT_MARKER, file_digest, mark_corrupt
    from ntp_nemo.data.tokenizer import load_tokenizer_json
    from ntp_nemo.data.tokens import open_token_file, sidecar_path, write_token_file
    from ntp_nemo.errors import ConfigError
    from ntp_nemo.models.model_config import ModelConfig
    from ntp_nemo.runtime.runtime import RankPlace
    from ntp_nemo.topology import ResolvedLayout, Topology

    work.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig(arch="gpt2", vocab_size=67, hidden_size=40, num_layers=2, num_heads=5,
                      ffn_hidden_size=84, max_seq_len=16, tie_embeddings=True)
    model = RankPlace(ResolvedLayout.make(Topology(1, [1], [1] * 4)), 0).build_model(cfg, 1234)
    pristine = work / "pristine"
    for step in (1, 2):
        save_checkpoint(pristine / checkpoint_name(step), model, None, {"n": step}, step=step)
    copies = iter(range(1000))

    def fresh() -> Path:
        directory = work / f"ckpts{next(copies)}"
        shutil.copytree(pristine, directory)
        return directory / checkpoint_name(2)

    def manifest(ckpt: Path) -> dict:
        return json.loads((ckpt / "manifest.json").read_text())

    def rewrite_index(ckpt: Path, change) -> None:
        doc = json.loads((ckpt / "index.json").read_text())
        change(next(r for t in doc["tensors"].values() if t["records"] and t["shape"] for r in t["records"]))
        (ckpt / "index.json").write_text(json.dumps(doc))
        man = manifest(ckpt)
        size, digest = file_digest(ckpt / "index.json")
        man["files"]["index.json"] = {"size": size, "xxh3_64": digest}
        (ckpt / "manifest.json").write_text(json.dumps(man))

    def refused(ckpt: Path, *words: str) -> str:
        err = _attempt(require_valid_checkpoint, ckpt)
        assert isinstance(err, ConfigError) and err.key == "resume", repr(err)
        assert all(w in str(err) for w in words), str(err)
        return str(err)

    def outside_file() -> str:
        ckpt, size = fresh(), str(os.stat("/etc/passwd").st_size)
        man = manifest(ckpt)
        man["files"]["../../../../etc/passwd"] = {"size": int(size)}
        (ckpt / "manifest.json").write_text(json.dumps(man))
        msg = refused(ckpt, "names a file outside the checkpoint directory")
        assert size not in msg.replace("/etc/passwd", ""), msg
        ckpt = fresh()
        rewrite_index(ckpt, lambda r: r.update(file="/etc/passwd"))
        msg2 = refused(ckpt, "names a file the manifest does not list")
        assert size not in msg2, msg2
        return "manifest and index naming /etc/passwd: both refused, nothing read"

    def dev_zero() -> str:
        ckpt = fresh()
        victim = sorted(ckpt.glob("data_*.bin"))[0]
        victim.unlink()
        victim.symlink_to("/dev/zero")
        refused(ckpt, victim.name, "symbolic link")
        return f"{victim.name} -> /dev/zero: refused (a symbolic link)"

    def corrupt_marker() -> str:
        ckpt = fresh()
        link = work / "elsewhere"
        link.symlink_to(ckpt, target_is_directory=True)
        mark_corrupt(link, "file x fails")
        outside = work / "outside.txt"
        outside.write_text("keep me")
        (ckpt / CORRUPT_MARKER).symlink_to(outside)
        mark_corrupt(ckpt, "file x fails")
        assert outside.read_text() == "keep me", "corrupt.json was written through a link"
        assert not (ckpt / CORRUPT_MARKER).is_file() or (ckpt / CORRUPT_MARKER).is_symlink()
        return "marker not written through a linked directory nor through a linked corrupt.json"

    def record_bounds() -> str:
        ckpt = fresh()
        rewrite_index(ckpt, lambda r: r.update(offset=-64))
        refused(ckpt, "index.json", "negative")
        ckpt = fresh()
        rewrite_index(ckpt, lambda r: r.update(nbytes=1 << 40))
        refused(ckpt, "index.json", "1099511627776 bytes")
        return "offset -64 and a 1 TiB record: refused before reading"

    def fifo() -> str:
        ckpt = fresh()
        victim = sorted(ckpt.glob("data_*.bin"))[0]
        victim.unlink()
        os.mkfifo(victim)
        t = time.time()
        refused(ckpt, victim.name, "not a regular file")
        return f"{victim.name} a FIFO: refused in {1000 * (time.time() - t):.0f} ms, never opened"

    def token_ids() -> str:
        ids = np.random.default_rng(0).integers(0, 257, 20_000)
        path = write_token_file(ids, work / "tokens.bin", "byte", 257)
        raw = bytearray(path.read_bytes())
        raw[2 * 12_345:2 * 12_345 + 2] = (65_000).to_bytes(2, "little")  # the sidecar still says 256
        path.write_bytes(bytes(raw))
        err = _attempt(open_token_file, path)
        assert isinstance(err, ConfigError) and err.key == "data.path" and "65000" in str(err), repr(err)
        return "id 65000 in a 257-id file: refused at open, naming the file and the id"

    def deep_json() -> str:
        path = write_token_file(np.arange(1000) % 257, work / "deep.bin", "byte", 257)
        sidecar_path(path).write_text("[" * 100_000 + "]" * 100_000)
        err = _attempt(open_token_file, path)
        assert isinstance(err, ConfigError) and "levels deep" in str(err), repr(err)
        import tokenizers

        tok = work / "tok"
        tok.mkdir()
        tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "<eos>": 1}, unk_token="a")).save(
            str(tok / "tokenizer.json"))
        (tok / "tokenizer_config.json").write_text('{"eos_token": ' + "[" * 100_000 + "]" * 100_000 + "}")
        err = _attempt(load_tokenizer_json, str(tok / "tokenizer.json"))
        assert isinstance(err, ConfigError) and "tokenizer_config.json" in str(err), repr(err)
        assert "levels deep" in str(err), str(err)
        return "sidecar and tokenizer_config.json 100,000 levels deep: config errors naming them"

    def heartbeat_files() -> str:
        from ntp_nemo.resilience.beats import beat_path, read_beats

        beats = work / "heartbeats"
        beats.mkdir()
        beat_path(beats, 0).write_text(json.dumps({"step": 3, "phase": "step_start", "t": 1.0, "pid": 1}))
        os.mkfifo(beat_path(beats, 1))
        beat_path(beats, 2).write_text("[" * 100_000 + "]" * 100_000)
        beat_path(beats, 3).symlink_to("/dev/zero")
        box: dict = {}
        assert _attempt(lambda: box.setdefault("beats", read_beats(beats, 4))) is None
        assert set(box["beats"]) == {0}, box
        return "a FIFO, 100,000 levels and a link to /dev/zero as rank files: read as not reported, at once"

    def full_disk() -> str:
        directory = fresh().parent
        real, written = storage._write_all, []

        def full(fd, mv):
            if written:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            written.append(len(mv))
            real(fd, mv)

        storage._write_all = full
        try:
            err = _attempt(lambda: save_checkpoint(directory / checkpoint_name(3), model, None, {"n": 3},
                                                   step=3, keep_last=1))
        finally:
            storage._write_all = real
        assert isinstance(err, CheckpointWriteError) and "No space left on device" in str(err), repr(err)
        assert "\n" not in str(err) and "kept" in str(err), str(err)
        assert sorted(p.name for p in directory.iterdir()) == [checkpoint_name(1), checkpoint_name(2)]
        assert latest_valid_checkpoint(directory) == directory / checkpoint_name(2)
        return "the save failed in one line naming it; step 2 kept and still the latest valid"

    return [("checkpoint naming /etc/passwd", outside_file),
            ("checkpoint file linked to /dev/zero", dev_zero),
            ("corrupt.json through a link", corrupt_marker),
            ("record offset -64 / 1 TiB record size", record_bounds), ("FIFO in a checkpoint", fifo),
            ("out-of-range token ids", token_ids),
            ("deep JSON in a sidecar/tokenizer_config.json", deep_json),
            ("a local job's heartbeat files (FIFO, deep, /dev/zero)", heartbeat_files),
            ("full disk during a save", full_disk),
            *second_round_stored_attacks(work / "second", fresh)]


ADVERSARIAL_JSON = {  # 10 MB each: the shapes a depth check or a parser may take long on
    "unterminated escaped string": '"\\' * (5 << 20),
    "unclosed arrays": "[" * (10 << 20),
    "a long number": "1" * (10 << 20),
    "a million empty arrays": "[" + "[]," * (3 << 20) + "[]]",
    "1e999": '{"vocab_size": 1e999, "num_tokens": 1e999, "num_documents": 1e999}',
}


def second_round_stored_attacks(work: Path, fresh) -> list[tuple[str, object]]:
    """The second round's stored inputs: each adversarial JSON shape against each reader of untrusted
    JSON (a token file's sidecar, a checkpoint's manifest, an HF config.json, a tokenizer.json, a local
    job's heartbeat file, a run's summary.json as `ntp-coordinator` and the launcher read it), an index
    whose records overlap while their counts add up, and overflowing sidecar counts. Withstood: refused
    (or, for a valid shape, read) within 5 s, never hung, never an uncaught exception."""
    import shutil

    import numpy as np

    from ntp_nemo.checkpoint import require_valid_checkpoint
    from ntp_nemo.checkpoint.manifest import file_digest
    from ntp_nemo.data.bounded_json import JSONInputError, read_json
    from ntp_nemo.data.tokenizer import load_tokenizer_json
    from ntp_nemo.data.tokens import open_token_file, sidecar_path, write_token_file
    from ntp_nemo.errors import ConfigError
    from ntp_nemo.hf.config_map import read_hf_config

    work.mkdir(parents=True, exist_ok=True)

    def sidecar(text: str) -> None:
        path = write_token_file(np.arange(100) % 50, work / "tokens.bin", "byte", 257)
        sidecar_path(path).write_text(text)
        open_token_file(path)

    def manifest(text: str) -> None:
        ckpt = fresh()
        (ckpt / "manifest.json").write_text(text)
        require_valid_checkpoint(ckpt)

    def hf_config(text: str) -> None:
        d = work / "hf"
        d.mkdir(exist_ok=True)
        (d / "config.json").write_text(text)
        read_hf_config(d)

    def tokenizer(text: str) -> None:
        d = work / "tok"
        d.mkdir(exist_ok=True)
        (d / "tokenizer.json").write_text(text)
        load_tokenizer_json(str(d / "tokenizer.json"))

    def plain(name: str):
        def read(text: str) -> None:
            (work / name).write_text(text)
            read_json(work / name, 16 << 20)  # heartbeat files and summary.json go through this reader
        return read

    readers = {"sidecar": sidecar, "manifest.json": manifest, "HF config.json": hf_config,
               "tokenizer.json": tokenizer, "heartbeat file": plain("beat.json"),
               "summary.json": plain("summary.json")}

    def shapes() -> str:
        slowest, cells = 0.0, 0
        for shape, text in ADVERSARIAL_JSON.items():
            for reader, read in readers.items():
                t = time.time()
                outcome = _attempt(read, text, seconds=30)
                took = time.time() - t
                slowest = max(slowest, took)
                cells += 1
                assert took < 5, f"{reader} took {took:.1f} s on {shape}"
                assert outcome is None or isinstance(outcome, (ConfigError, JSONInputError, ValueError)), \
                    f"{reader} on {shape}: {type(outcome).__name__}: {outcome}"
        return f"{cells} reader x shape pairs answered; slowest {slowest:.2f} s"

    def overlapping_index() -> str:
        ckpt = fresh()

        def overlap(doc):
            t = next(t for t in doc["tensors"].values() if len(t["shape"]) == 2 and t["shape"][0] >= 4)
            (rows, cols), whole = t["shape"], t["records"][0]
            item, half = whole["nbytes"] // (rows * cols), rows // 2
            t["records"] = [dict(whole, offsets=[0, 0], sizes=[half, cols], nbytes=half * cols * item,
                                 blocks=[]),
                            dict(whole, offsets=[half - 1, 0], sizes=[rows - half, cols],
                                 offset=whole["offset"] + (half - 1) * cols * item,
                                 nbytes=(rows - half) * cols * item, blocks=[])]

        doc = json.loads((ckpt / "index.json").read_text())
        overlap(doc)
        (ckpt / "index.json").write_text(json.dumps(doc))
        man = json.loads((ckpt / "manifest.json").read_text())
        size, digest = file_digest(ckpt / "index.json")  # the digests kept right, as an attacker would
        man["files"]["index.json"] = {"size": size, "xxh3_64": digest}
        (ckpt / "manifest.json").write_text(json.dumps(man))
        err = _attempt(require_valid_checkpoint, ckpt)
        assert isinstance(err, ConfigError) and "overlap" in str(err), repr(err)
        return "refused before any read: records 0 and 1 overlap"

    def overflow_sidecar() -> str:
        refused = []
        for key in ("num_tokens", "vocab_size", "num_documents"):
            for literal in ("1e999", "Infinity"):
                path = write_token_file(np.arange(100) % 50, work / f"o_{key}.bin", "byte", 257)
                doc = json.loads(sidecar_path(path).read_text())
                text = json.dumps(doc).replace(f'"{key}": {json.dumps(doc[key])}', f'"{key}": {literal}')
                sidecar_path(path).write_text(text)
                err = _attempt(open_token_file, path)
                assert isinstance(err, ConfigError) and "\n" not in str(err), repr(err)
                refused.append(key)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True, exist_ok=True)
        return f"{len(refused)} sidecars refused in one paragraph (exit 2), no OverflowError"

    return [("adversarial JSON shapes x every reader", shapes),
            ("overlapping checkpoint index records", overlapping_index),
            ("1e999 / Infinity in sidecar counts", overflow_sidecar)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heartbeat", type=float, default=2.0, help="fault.heartbeat_timeout_s")
    ap.add_argument("--hold", type=float, default=3.0, help="seconds each lasting attack is held")
    ap.add_argument("--quick", action="store_true",
                    help="leave out the two rows with real ranks (spawned processes: minutes on a loaded "
                         "machine) and hold each lasting attack 1 s")
    args = ap.parse_args()
    if args.quick:
        args.hold = 1.0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
    over = [*LAYOUT, f"fault.heartbeat_timeout_s={args.heartbeat:g}", "fault.collective_timeout_s=60",
            "fault.step_timeout_s=120"]
    work = Path(tempfile.mkdtemp(prefix="hostile-"))
    port = free_port()
    t0 = time.time()
    coordinator = start_coordinator(over, port, SECRET, work)
    print(f"coordinator ready in {time.time() - t0:.1f} s (pid {coordinator.pid}); heartbeat timeout "
          f"{args.heartbeat:g} s; each lasting attack held {args.hold:g} s")
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    job = JobStore(store, SECRET.encode())
    link_port = int(job.read(LINK_KEY))
    proxy = Proxy("127.0.0.1", link_port)
    tasks = [Task("127.0.0.1", link_port, i, 4, via=proxy.port if i == 3 else None) for i in range(4)]
    time.sleep(0.5)

    def healthy() -> str | None:
        if coordinator.popen.poll() is not None:
            return f"the coordinator exited ({coordinator.popen.returncode})"
        for i, t in enumerate(tasks):
            if t.closed:
                return f"task {i}'s link closed"
            if t.heard:
                return f"task {i} was told {t.heard}"
        return None

    def hold(fn, *a) -> None:
        stop = time.time() + args.hold
        while time.time() < stop:
            fn(*a)

    def deep_line() -> str:
        s = socket.create_connection(("127.0.0.1", link_port))
        s.sendall(b"[" * 100000 + b"\n")
        _drain(s)
        return "refused: the connection closed"

    def endless_line() -> str:
        s = socket.create_connection(("127.0.0.1", link_port))
        sent = 0
        try:
            for _ in range(200):
                s.sendall(b"a" * 65536)
                sent += 65536
        except OSError:
            pass
        s.close()
        assert sent < 13_000_000, "the coordinator read 13 MB of one line"
        return f"cut off after {sent // 1024} KiB sent"

    def garbage() -> str:
        for data in (b"\xff\xfe\x00garbage\n", b"[1,2,3]\n", b'{"auth": 5, "nonce": [], "want": "x"}\n',
                     b"{" * 5 + b"\n"):
            s = socket.create_connection(("127.0.0.1", link_port))
            s.sendall(data)
            _drain(s)
        return "4 connections refused"

    def forged_hello() -> str:
        s = Line(socket.create_connection(("127.0.0.1", link_port), timeout=10))
        nonce = s.receive()[0]["nonce"]
        task_hello(s, b"a guess at the job's secret!", nonce, want=0, ntasks=4, host="x", pid=0)
        s.sock.settimeout(10)
        while s.receive() is not None:
            pass
        assert "refused" in (s.last_rejected or {}), s.last_rejected
        return "refused (no place taken)"

    def idle_1200() -> str:
        idle = [socket.create_connection(("127.0.0.1", link_port)) for _ in range(1200)]
        spare = Task("127.0.0.1", link_port, 0, 1)  # a replacement connecting meanwhile is served
        assert "wait" in spare.reply, spare.reply
        time.sleep(args.hold)
        spare.bye()
        for s in idle:
            s.close()
        return "held; a spare connecting meanwhile was answered"

    def churn() -> str:
        n = 0
        stop = time.time() + args.hold
        while time.time() < stop:
            for s in [socket.create_connection(("127.0.0.1", link_port)) for _ in range(50)]:
                s.close()
            n += 50
        t = time.time()
        spare = Task("127.0.0.1", link_port, 0, 1)
        took = time.time() - t
        spare.bye()
        return f"{n} connections opened and dropped; a spare's hello then took {took * 1000:.0f} ms"

    def replayed_beat() -> str:
        outsider = JobStore(store, b"a guess at the job's secret!")
        raw = b"0" * 64 + b":" + json.dumps({"step": 1, "phase": "step_start", "tick": 1}).encode()

        def once() -> None:
            for pid in range(4):
                job.store.set(f"beat/{pid}", raw)
                outsider.put(f"beat/{pid}", json.dumps({"step": 1, "phase": "step_start", "tick": 1}))

        hold(once)
        return "beat/{0..3} overwritten in a loop: nobody evicted"

    def on_path() -> str:
        before = len(tasks[3].heard)
        proxy.to_task.sendall(b'{"declared": "lost"}\n{"end": "forged"}\n{"look": 0}\n'
                              b'{"m": {"declared": "lost"}, "n": 0, "mac": "00"}\n')
        time.sleep(0.5)
        assert tasks[3].line.rejected >= 4 and len(tasks[3].heard) == before
        return f"{tasks[3].line.rejected} unsealed lines dropped by the task"

    def replayed_link_beat() -> str:
        captured = proxy.last_up
        assert b'"beat"' in captured, captured
        for _ in range(20):
            proxy.up.sendall(captured)  # the task's own sealed heartbeat, sent again on its connection
        coordinator.wait_for("did not seal (forged or replayed) were ignored", 10)
        return "a captured sealed beat sent 20 times more: dropped (its counter is spent), nobody evicted"

    def outsider_rank() -> str:
        got = _ranks(port, [SECRET.encode(), b"an outsider's guess at the secret"], 900, timeout_s=10)
        assert got[0][0] != "formed" and got[1][0] != "formed", got
        return f"rank 0 never formed a group with it: {got[0][0]}: {got[0][1][:110]}"

    def prewritten_keys() -> str:
        first = _ranks(port, [SECRET.encode()] * 2, 901)
        assert all(k == "formed" for k, _ in first.values()), first
        from ntp_nemo.resilience.store_auth import key_prefix

        # the outsider copies generation 901's rendezvous keys (stale gloo addresses) to generation 902's

        outsider = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        prefix = key_prefix(SECRET.encode()) + "/gen901/"
        keys = [k for k in outsider.list_keys() if k.startswith(prefix)]
        for k in keys:
            outsider.set(k.replace("/gen901/", "/gen902/"), outsider.get(k))
        second = _ranks(port, [SECRET.encode()] * 2, 902)
        assert all(k == "formed" for k, _ in second.values()), second
        return (f"{len(keys)} gloo address key(s) pre-written for the next generation; it formed between "
                f"the job's ranks ({second[0][1]})")

    def store_flood() -> str:
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
        time.sleep(args.hold)
        for s in idle:
            s.close()
        return "200 idle connections to the store held: nobody evicted"

    def drip_training() -> str:
        drip = Drip(link_port, 300)
        try:
            time.sleep(max(args.hold, 2.0))
            answered, cut = hellos_under_drip(link_port, 40, 0, 1)
        finally:
            drip.close()
        assert cut == 0, f"{cut} of 40 legitimate hellos were cut"
        return f"{drip.connects} stranger connections; {answered}/40 replacement hellos answered, none cut"

    attacks = [("deep JSON line (100,000 '[')", deep_line), ("endless line (no newline)", endless_line),
               ("garbage and malformed hellos", garbage), ("hello with a guessed secret", forged_hello),
               ("1,200 idle link connections", idle_1200), ("connection churn on the link", churn),
               ("replayed heartbeats on the store", replayed_beat),
               ("a sealed heartbeat replayed on a task's link (on path)", replayed_link_beat),
               ("unsealed lines on a task's link (on path)", on_path),
               ("200 idle store connections", store_flood),
               ("300 slow-drip strangers reconnecting, during training", drip_training)]
    if not args.quick:
        attacks += [("an outsider joins a generation's rendezvous", outsider_rank),
                    ("gloo address keys pre-written on the store", prewritten_keys)]
    rows: list[tuple[str, bool, str]] = []
    for name, attack in attacks:
        t = time.time()
        try:
            detail = attack()
            time.sleep(0.3)
            wrong = healthy()
            ok = wrong is None
            detail = detail if ok else wrong
        except Exception as err:  # noqa: BLE001 - a failed check is a row, not a crash of the bench
            ok, detail = False, f"{type(err).__name__}: {err}"
        rows.append((name, ok, f"{detail} ({time.time() - t:.1f} s)"))

    # The job ends: the tasks finish; the coordinator must exit 0.
    for t in tasks:
        t.bye()
    code = coordinator.wait(30)
    checks = [("after the attacks the job ends", code == 0, f"coordinator exit {code}")]

    # A task that dies while the job forms (not an attack: issue of the forming job), second coordinator.
    port2 = free_port()
    second = start_coordinator(over, port2, SECRET, work)
    try:
        job2 = JobStore(dist.TCPStore("127.0.0.1", port2, is_master=False, timeout=timedelta(seconds=30)),
                        SECRET.encode())
        lp2 = int(job2.read(LINK_KEY))
        first, doomed = Task("127.0.0.1", lp2, 0, 4), Task("127.0.0.1", lp2, 1, 4)
        t = time.time()
        doomed.line.sock.shutdown(socket.SHUT_RDWR)  # its process died before the other places were taken
        code2 = second.wait(30)
        took = time.time() - t
        told = first.heard[0].get("end", "") if first.heard else ""
        checks.append(("a task dies while the job forms", code2 == 75 and "while the job formed" in told
                       and took < 5, f"coordinator exit {code2} after {took:.1f} s; the other task was "
                       f"told: {told[:100]}..."))
    finally:
        second.kill()
    coordinator.kill()

    # The job forms while 300 slow-drip strangers reconnect on its link port: every task gets its place
    # at its first hello.
    t = time.time()
    port4 = free_port()
    fourth = start_coordinator(over, port4, SECRET, work)
    try:
        job4 = JobStore(dist.TCPStore("127.0.0.1", port4, is_master=False, timeout=timedelta(seconds=30)),
                        SECRET.encode())
        lp4 = int(job4.read(LINK_KEY))
        drip = Drip(lp4, 300)
        time.sleep(1.0)
        formed, cut = [], 0
        for i in range(4):
            try:
                formed.append(Task("127.0.0.1", lp4, i, 4))
            except (RuntimeError, OSError):
                cut += 1
        drip.close()
        placed = sorted(x.reply.get("place", -1) for x in formed)
        for x in formed:
            x.bye()
        code4 = fourth.wait(30)
        ok = placed == [0, 1, 2, 3] and cut == 0 and code4 == 0
        rows.append(("300 slow-drip strangers reconnecting, at formation", ok,
                     f"{drip.connects} stranger connections; places {placed}, {cut} hellos cut; coordinator "
                     f"exit {code4} ({time.time() - t:.1f} s)"))
    except Exception as err:  # noqa: BLE001 - a failed check is a row
        rows.append(("300 slow-drip strangers reconnecting, at formation", False,
                     f"{type(err).__name__}: {err} ({time.time() - t:.1f} s)"))
    finally:
        fourth.kill()

    # Attacks the job cannot train through: it must stop, naming them (exit 75, every task told why,
    # nobody declared lost).  Each against a job of its own.
    def stops(attack, words: tuple[str, ...]) -> tuple[bool, str]:
        port3 = free_port()
        third = start_coordinator(over, port3, SECRET, work)
        try:
            client = dist.TCPStore("127.0.0.1", port3, is_master=False, timeout=timedelta(seconds=30))
            lp3 = int(JobStore(client, SECRET.encode()).read(LINK_KEY))
            four = [Task("127.0.0.1", lp3, i, 4) for i in range(4)]
            time.sleep(1.5)  # every task trains; the coordinator has checked its store at least once
            outsider = dist.TCPStore("127.0.0.1", port3, is_master=False, timeout=timedelta(seconds=30))
            t = time.time()
            did = attack(outsider, third)
            code3 = third.wait(60)
            took = time.time() - t
            time.sleep(0.3)
            ends = [next((m["end"] for m in x.heard if "end" in m), "") for x in four]
            blamed = [m for x in four for m in x.heard if "declared" in m]
            ok = code3 == 75 and all(all(w in e for w in words) for e in ends) and not blamed
            return ok, f"{did}; exit {code3} after {took:.1f} s, every task told: {ends[0][:150]}..."
        finally:
            third.kill()

    def wipe(outsider, _proc) -> str:
        keys = outsider.list_keys()
        for k in keys:
            outsider.delete_key(k)
        return f"all {len(keys)} keys deleted"

    def flood(outsider, proc) -> str:
        sent = 0
        try:
            while proc.popen.poll() is None and sent < 2048:
                outsider.set(f"flood/{sent}", b"x" * 2**20)
                sent += 1
        except Exception:  # noqa: BLE001 - the store went away with the coordinator
            pass
        return f"{sent} MiB written"

    for name, attack, words in (("a store wipe (every key deleted)", wipe, ("wiped or overwritten",)),
                                ("a store flood (1 MiB values)", flood, ("flooded", "bound 512 MiB"))):
        t = time.time()
        try:
            ok, detail = stops(attack, words)
        except Exception as err:  # noqa: BLE001 - a failed check is a row
            ok, detail = False, f"{type(err).__name__}: {err}"
        rows.append((name, ok, f"{detail} ({time.time() - t:.1f} s)"))

    # Stored inputs, against the real checks in this process.
    for name, attack in stored_input_attacks(work / "stored"):
        t = time.time()
        try:
            ok, detail = True, attack()
        except Exception as err:  # noqa: BLE001 - a failed check is a row
            ok, detail = False, f"{type(err).__name__}: {err}"
        rows.append((name, ok, f"{detail} ({time.time() - t:.1f} s)"))

    width = max(len(r[0]) for r in rows)
    print(f"\n| {'attack':<{width}} | withstood | what happened |")
    print(f"|{'-' * (width + 2)}|-----------|---------------|")
    for name, ok, detail in rows:
        print(f"| {name:<{width}} | {'yes' if ok else 'NO':<9} | {detail} |")
    print()
    for name, ok, detail in checks:
        print(f"{name}: {'ok' if ok else 'FAILED'} ({detail})")
    print("coordinator said:\n" + "\n".join("  " + line for line in coordinator.output.splitlines()[-12:]))
    held = sum(ok for _, ok, _ in rows)
    print(f"hostile clients: {held}/{len(rows)} attacks withstood")
    return 0 if held == len(rows) and all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
