"""ntp_nemo.planner."""
