"""The stop signals a worker answers with a checkpoint, and how a freshly forked worker holds them."""

from __future__ import annotations

# SIGUSR2 is a Ctrl-C passed on by the launcher (`ForkLauncher.forwarding_signals`): a worker answers it as
# SIGINT, and it never counts as a second Ctrl-C for a worker that got the terminal's SIGINT itself.
FORWARDED_INTERRUPT = "SIGUSR2"
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT", FORWARDED_INTERRUPT)


def hold_stop_signals() -> None:
    """Hold stop signals in a freshly forked worker until `PreemptionCheckpoint` answers them at the
    start of training: a Ctrl-C during the rendezvous or the setup then neither interrupts a
    TCPStore call ("Interrupted system call") nor raises KeyboardInterrupt there."""
    import signal

    signal.pthread_sigmask(signal.SIG_BLOCK, [getattr(signal, n) for n in STOP_SIGNALS])
