"""ntp_nemo.runtime: what a rank trains with (the runtime, its assembly) and the dry run of any world size."""
