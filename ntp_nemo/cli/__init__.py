"""ntp_nemo.cli: command-line entry points that sit above every package."""
