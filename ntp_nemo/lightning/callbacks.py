"""Run-directory callbacks: `metrics.jsonl` (one line per optimizer step) and `summary.json`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback


class MetricsJSONL(Callback):
    """Appends `{step, loss, tokens, step_time_s, layout, ...}` per optimizer step (global rank 0 only)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self._t0 = 0.0
        self.history: list[dict[str, Any]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not trainer.is_global_zero:
            return
        dt = time.perf_counter() - self._t0
        rec = dict(pl_module.last_step)
        info = getattr(trainer.strategy, "layout_info", {}) or {}
        rec.update(step_time_s=dt, tokens_per_s=rec["tokens"] / dt if dt > 0 else 0.0,
                   layout=info.get("layout", "single"), capacity=info.get("capacity", 1.0), time=time.time())
        self.history.append(rec)
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")


class RunSummary(Callback):
    """Writes `summary.json` at the end of training (final losses, throughput, goodput, layout)."""

    def __init__(self, run_dir: str | Path, metrics: MetricsJSONL) -> None:
        self.run_dir = Path(run_dir)
        self.metrics = metrics
        self._start = time.time()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.time()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        hist = self.metrics.history
        steady = hist[1:] or hist
        tokens = sum(h["tokens"] for h in steady)
        secs = sum(h["step_time_s"] for h in steady)
        summary: dict[str, Any] = {
            "steps": int(trainer.global_step),
            "steps_this_run": len(hist),
            "first_loss": hist[0]["loss"] if hist else None,
            "final_loss": hist[-1]["loss"] if hist else None,
            "val_loss": getattr(pl_module, "last_val_loss", None),
            "tokens_per_s": tokens / secs if secs > 0 else None,
            "train_wall_s": time.time() - self._start,
            "layout": hist[-1]["layout"] if hist else getattr(trainer.strategy, "layout_info", {}).get("layout"),
            "run_dir": str(self.run_dir),
        }
        goodput_file = self.run_dir / "goodput.jsonl"
        if goodput_file.exists():
            from ntp_nemo.goodput import compute_goodput, load_events

            report = compute_goodput(load_events(goodput_file))
            summary["goodput"] = report.goodput
            summary["capacity_fraction"] = report.capacity_fraction
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
