"""The `integrity` config group, checked before anything starts (no torch, no Lightning): how often the
replicas' parameter fingerprints are compared, the loss-spike detector, the verified copy kept for
rollbacks and the training samples skipped as bad data (`ntp_nemo.resilience.integrity` uses them)."""

from __future__ import annotations

from ntp_nemo.config.schema import IntegrityConfig
from ntp_nemo.errors import ConfigError


def validate_integrity_config(cfg: IntegrityConfig) -> None:
    """ConfigError (exit 2) naming the key on a bad value of the `integrity` group."""
    if int(cfg.every_n_steps) < 0:
        raise ConfigError("integrity.every_n_steps", f"must be >= 0 steps between comparisons of the "
                          f"replicas' parameter fingerprints (0: never), got {cfg.every_n_steps}; e.g. 50.")
    if not float(cfg.spike_zscore) >= 0:
        raise ConfigError("integrity.spike_zscore", f"must be >= 0 standard deviations above the recent mean "
                          f"that make a loss or gradient-norm spike (0: no spike detection), got "
                          f"{cfg.spike_zscore}; e.g. 8.")
    if int(cfg.spike_window) < 3:
        raise ConfigError("integrity.spike_window", f"must be >= 3 recent steps for the spike detector's "
                          f"mean and deviation, got {cfg.spike_window}; e.g. 20.")
    ratio = float(cfg.outlier_ratio)
    if not (ratio == 0 or ratio > 1):
        raise ConfigError("integrity.outlier_ratio", f"must be 0 (no per-step check) or > 1: how many times "
                          f"every other rank's value a rank's own largest gradient element or activation "
                          f"must be to hold the step suspect, got {cfg.outlier_ratio}; e.g. 1000.")
    bad = [s for s in cfg.skip_samples or [] if int(s) < 0]
    if bad:
        raise ConfigError("integrity.skip_samples", f"training sample ids are >= 0, got {bad}; list the ids "
                          "`ntp-incidents RUN_DIR` reports as skipped, e.g. integrity.skip_samples=[1234].")


__all__ = ["validate_integrity_config"]
