"""ntp_nemo.lightning."""
