"""ntp_nemo.checkpoint."""
