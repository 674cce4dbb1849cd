"""ntp_nemo.launch: the launcher environments a run starts in.

`cluster`: the ranks and node placement torchrun or SLURM give a process; `devices`: counting and
binding CUDA devices from the launching parent without initialising CUDA; `loopback`: stores and
sockets of a one-machine run bound to 127.0.0.1; `workers`: forking N local workers joined in one
process group (tests and benchmarks).
"""
