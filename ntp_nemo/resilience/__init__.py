"""ntp_nemo.resilience."""
