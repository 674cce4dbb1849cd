"""Names of the goodput events and badput categories.

The recorder writes these names into `goodput.jsonl` and the calculator reads them back,
so both sides (and every component that records an event) share one vocabulary.
Each event line holds `t` (Unix time, seconds), `event`, `pid` and the fields listed here.
"""

from __future__ import annotations

GOODPUT_FILENAME = "goodput.jsonl"

# Process lifetime. A run directory's file spans several lifetimes (restarts append).
JOB_START = "job_start"
JOB_END = "job_end"  # status: "ok" | "failed"
INIT_DONE = "init_done"

# Training steps. step_end carries the layout that ran it and its capacity
# (active ranks / nominal ranks, in (0, 1]) and the tokens it consumed.
STEP_START = "step_start"  # step
STEP_END = "step_end"  # step, layout, capacity, tokens

# Checkpoints. blocking_s on ckpt_save_end: the part of an asynchronous save that blocked training.
# Every ckpt_save_start gets a ckpt_save_end or a ckpt_save_abort (the save failed or was cut short by
# a lost peer); an asynchronous save's files are committed later, in the background: ckpt_commit.
CKPT_SAVE_START = "ckpt_save_start"  # step
CKPT_SAVE_END = "ckpt_save_end"  # step, blocking_s (optional)
CKPT_SAVE_ABORT = "ckpt_save_abort"  # step, reason
CKPT_COMMIT = "ckpt_commit"  # step, ok (false: the background write failed; nothing was committed)
CKPT_RESTORE_START = "ckpt_restore_start"
CKPT_RESTORE_END = "ckpt_restore_end"  # step (the step restored)

# Faults.
FAILURE_DETECTED = "failure_detected"  # rank, reason
# recovery_done: layout (the new one), mode ("live" | "restart"); a live recovery or rejoin also carries
# recovery_s, the seconds from detection (or the rejoin's start) to the resharded state, ending at `t`.
RECOVERY_DONE = "recovery_done"

# Input pipeline stalls, recorded after the wait; the wait ends at `t`.
DATA_WAIT = "data_wait"  # seconds

# Stragglers (ntp_nemo.resilience.straggler_watch). A straggler records its own straggler and
# straggler_recovered events; straggler_wait carries the seconds the steps (from_step, step] lost waiting
# for slow ranks, ending at `t`; rebalance a new batch split by measured speed.
STRAGGLER = "straggler"  # rank, host, speed, step, policy
STRAGGLER_RECOVERED = "straggler_recovered"  # rank, speed, step
STRAGGLER_WAIT = "straggler_wait"  # seconds, from_step, step
# rebalance: predicted_compute_s, the work model's compute time of a step on the new split at the measured
# speeds; nominal_compute_s, on the nominal split at full speed (both from unit_s, seconds per unit of work)
REBALANCE = "rebalance"  # step, speeds, microbatches, predicted_compute_s, nominal_compute_s, rank_speeds

# Silent-corruption checks (ntp_nemo.resilience.integrity): the seconds a replica-fingerprint check, or a
# finding's attribution and action (replay, rollback, skipped sample), took, ending at `t`.
INTEGRITY_CHECK = "integrity"  # seconds
# Hot spares (ntp_nemo.resilience.spares), recorded by the launching process: a spare ready (seconds from
# its start), taken (in the place of `process`) or dead before it was used
SPARE = "spare"  # action (ready | taken | died), spare, spare_pid, seconds, process

EVENTS: frozenset[str] = frozenset(
    {
        JOB_START,
        JOB_END,
        INIT_DONE,
        STEP_START,
        STEP_END,
        CKPT_SAVE_START,
        CKPT_SAVE_END,
        CKPT_SAVE_ABORT,
        CKPT_COMMIT,
        CKPT_RESTORE_START,
        CKPT_RESTORE_END,
        FAILURE_DETECTED,
        RECOVERY_DONE,
        DATA_WAIT,
        STRAGGLER,
        STRAGGLER_RECOVERED,
        STRAGGLER_WAIT,
        REBALANCE,
        INTEGRITY_CHECK,
        SPARE,
    }
)

STATUS_OK = "ok"
STATUS_FAILED = "failed"

# Badput categories, in the order reports show them.
INITIALIZATION = "initialization"
CHECKPOINT_SAVE = "checkpoint_save"
CHECKPOINT_RESTORE = "checkpoint_restore"
WASTED_PROGRESS = "wasted_progress"
RECOVERY_DOWNTIME = "recovery_downtime"
# A live recovery's (or rejoin's) reshard: the survivors rebuild their shards in place (`recovery_s`).
RESHARD = "reshard"
# Steps run on a degraded layout make progress below the job's full capacity: of a step of length d
# run at capacity c (step_end's `capacity`), c*d counts as productive and (1-c)*d as degraded
# throughput, the time the full layout would not have needed.
DEGRADED_THROUGHPUT = "degraded_throughput"
DATA_LOADING = "data_loading"
# Time the steps lost waiting for slow ranks (`straggler_wait` events): per step, how much longer the
# slowest straggler computed than the work model's longest share at the job's measured speed.
STRAGGLERS = "stragglers"
# Fingerprint checks and the attribution and repair of corruption and non-finite steps (`integrity` events).
INTEGRITY = "integrity"
OTHER = "other"

BADPUT_CATEGORIES: tuple[str, ...] = (
    INITIALIZATION,
    CHECKPOINT_SAVE,
    CHECKPOINT_RESTORE,
    WASTED_PROGRESS,
    RECOVERY_DOWNTIME,
    RESHARD,
    DEGRADED_THROUGHPUT,
    DATA_LOADING,
    STRAGGLERS,
    INTEGRITY,
    OTHER,
)

PRODUCTIVE = "productive"
