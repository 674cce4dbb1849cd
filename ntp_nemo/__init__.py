"""ntp_nemo: declarative recipes for GPT-style training with nonuniform tensor parallelism."""

__version__ = "0.1.0"
