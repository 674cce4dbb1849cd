"""ntp_nemo.pipeline."""
