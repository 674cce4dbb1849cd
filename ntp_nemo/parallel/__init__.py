"""ntp_nemo.parallel."""
