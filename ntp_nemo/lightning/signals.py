"""The stop signals a worker answers with a checkpoint, and how a freshly forked worker holds them."""

from __future__ import annotations

STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")


def hold_stop_signals() -> None:
    """Hold stop signals in a freshly forked worker until `PreemptionCheckpoint` answers them at the
    start of training: a Ctrl-C during the rendezvous or the setup then neither interrupts a
    TCPStore call ("Interrupted system call") nor raises KeyboardInterrupt there."""
    import signal

    signal.pthread_sigmask(signal.SIG_BLOCK, [getattr(signal, n) for n in STOP_SIGNALS])
