"""Tokenizing throughput: `ntp-preprocess --workers 1` and `--workers 2` against a plain loop of the
`tokenizers` library's `encode_batch` over the same .jsonl files, side by side.

    python bench/preprocess.py [--mb 16] [--vocab 8192] [--repeats 3]

The input is paragraphs of the built-in corpus (the Python standard library's sources) written as
.jsonl files of about `--mb` MB in all; the tokenizer a byte-level BPE trained on the same text and
saved as tokenizer.json. The plain loop reads each line, `json.loads` it and calls
`Tokenizer.encode_batch` on batches of 256 documents; both sides run the library single-threaded
(`TOKENIZERS_PARALLELISM=false`), so "per worker" compares one process with one process. Each side
runs `--repeats` times, alternating; the table shows the median wall time, the CPU time (user+system
of the process and its workers), MB/s of input and the ratios. Both sides must produce the same
token count (ntp-preprocess adds one end-of-document id per document).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["TOKENIZERS_PARALLELISM"] = "false"


def make_inputs(work: Path, mb: float, vocab: int) -> tuple[Path, list[Path]]:
    from ntp_nemo.data.stdlib_text import stdlib_documents
    from ntp_nemo.data.tokenizer import train_bpe

    paragraphs = [p for doc in stdlib_documents(4 * 1024 * 1024) for p in doc.split("\n\n") if p.strip()]
    tok = work / "tokenizer.json"
    train_bpe(paragraphs, vocab).save(str(tok))
    files, written, i = [], 0, 0
    target = int(mb * 1e6)
    for part in range(4):
        path = work / "corpus" / f"part{part}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            while written < target * (part + 1) / 4:
                line = json.dumps({"text": paragraphs[i % len(paragraphs)], "n": i}) + "\n"
                fh.write(line)
                written += len(line.encode())
                i += 1
        files.append(path)
    return tok, files


def cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def plain_loop(tok_path: Path, files: list[Path]) -> tuple[float, float, int, int]:
    """(wall s, cpu s, tokens, documents) of the plain encode_batch loop, in a fresh process (timed from
    outside, interpreter start included, as for ntp-preprocess)."""
    code = f"""
import json, os
os.environ["TOKENIZERS_PARALLELISM"] = "false"
from tokenizers import Tokenizer
tok = Tokenizer.from_file({str(tok_path)!r})
n = docs = 0
for path in {[str(f) for f in files]!r}:
    batch = []
    with open(path, "rb") as fh:
        for line in fh:
            batch.append(json.loads(line)["text"])
            if len(batch) == 256:
                n += sum(len(e.ids) for e in tok.encode_batch(batch, add_special_tokens=False))
                docs += len(batch)
                batch = []
    if batch:
        n += sum(len(e.ids) for e in tok.encode_batch(batch, add_special_tokens=False))
        docs += len(batch)
print(json.dumps([n, docs]))
"""
    c0, t0 = cpu_children(), time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    wall, cpu = time.perf_counter() - t0, cpu_children() - c0
    n, docs = json.loads(out.stdout.strip().splitlines()[-1])
    return wall, cpu, n, docs


def preprocess(tok_path: Path, corpus: Path, out: Path, workers: int) -> tuple[float, float, int, int]:
    for p in out.parent.glob(out.name + "*"):
        p.unlink()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    c0, t0 = cpu_children(), time.perf_counter()
    cmd = [sys.executable, "-m", "ntp_nemo.cli.preprocess", str(corpus), "--tokenizer", str(tok_path),
           "--out", str(out), "--workers", str(workers), "--no-progress"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall, cpu = time.perf_counter() - t0, cpu_children() - c0
    if res.returncode != 0:
        raise SystemExit(res.stderr)
    meta = json.loads(Path(f"{out}.json").read_text())
    return wall, cpu, int(meta["num_tokens"]), int(meta["num_documents"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=16.0)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok, files = make_inputs(work, args.mb, args.vocab)
        mb = sum(f.stat().st_size for f in files) / 1e6
        runs: dict[str, list[tuple[float, float, int, int]]] = {"plain": [], "w1": [], "w2": []}
        for _ in range(args.repeats):
            runs["plain"].append(plain_loop(tok, files))
            runs["w1"].append(preprocess(tok, work / "corpus", work / "w1.bin", 1))
            runs["w2"].append(preprocess(tok, work / "corpus", work / "w2.bin", 2))
        load = os.getloadavg()
    plain_tokens, docs = runs["plain"][0][2], runs["plain"][0][3]
    for name in ("w1", "w2"):
        assert runs[name][0][2] == plain_tokens + docs, (name, runs[name][0][2], plain_tokens, docs)
        assert runs[name][0][3] == docs
    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v))
           for k, v in runs.items()}
    print(f"input: {len(files)} .jsonl files, {mb:.1f} MB, {docs} documents, {plain_tokens} tokens "
          f"(BPE vocab {args.vocab}); median of {args.repeats} runs each; load average "
          f"{load[0]:.1f}/{load[1]:.1f} (1/5 min) on {os.cpu_count()} CPUs")
    print(f"{'side':<34}{'wall s':>8}{'CPU s':>8}{'MB/s':>8}{'vs plain':>10}")
    labels = {"plain": "plain encode_batch loop (1 proc)", "w1": "ntp-preprocess --workers 1",
              "w2": "ntp-preprocess --workers 2"}
    base = mb / med["plain"][0]
    for k in ("plain", "w1", "w2"):
        wall, cpu = med[k]
        print(f"{labels[k]:<34}{wall:>8.2f}{cpu:>8.2f}{mb / wall:>8.2f}{mb / wall / base:>9.2f}x")
    print(f"per worker vs plain loop: {med['plain'][0] / med['w1'][0]:.2f}x (--workers 1); "
          f"gain from the second worker: {med['w1'][0] / med['w2'][0]:.2f}x wall, "
          f"CPU per MB {med['w2'][1] / med['w1'][1]:.2f}x of --workers 1; per worker by CPU time: "
          f"{med['plain'][1] / med['w1'][1]:.2f}x")


if __name__ == "__main__":
    main()
