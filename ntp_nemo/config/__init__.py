"""ntp_nemo.config."""
