"""`ntp-dashboard RUN_DIR [--port N] [--host 127.0.0.1]`: serve a read-only live page of a run.

RUN_DIR is a run directory (running, finished, or not started yet: the page waits for it), or a sweep
directory (a table of its jobs, each linking to its page).  The URL, with its random token, is printed
once; the page polls every second.  Ctrl-C stops it.  A path that is neither: exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import os
import resource
import signal
import sys
from pathlib import Path

from ntp_nemo.errors import ConfigError, cli_main


def _raise_open_files_limit() -> None:
    """Idle connections each hold a descriptor: take the hard limit, so a thousand cannot exhaust it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ntp-dashboard", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run directory (or a sweep directory) written by ntp-train")
    parser.add_argument("--port", type=int, default=0, help="TCP port (default 0: any free port)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only)")
    # started beside a run by ntp-train (dashboard.port): the run directory may not exist yet, and the
    # dashboard stops once that process is gone
    parser.add_argument("--parent", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        raise ConfigError("--port", f"{args.port} is not a TCP port; give 0 (any free port) to 65535.")
    return args


async def _watch_parent(parent: int, stop: asyncio.Event) -> None:
    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    stop.set()


async def _serve_until_stopped(root: Path, host: str, port: int, token: str,
                               parent: int | None = None) -> None:
    from ntp_nemo.dashboard.server import serve

    try:
        runner, bound = await serve(root, token, host, port, allow_missing=parent is not None)
    except OSError as err:
        raise ConfigError("--port", f"cannot listen on {host}:{port} ({err.strerror or err}); choose another "
                                    "--port, or 0 for any free one.") from None
    shown = f"[{host}]" if ":" in host else host
    print(f"ntp-dashboard: http://{shown}:{bound}/{token}/  (read-only; Ctrl-C stops it)", flush=True)
    if not is_loopback(host):
        print(f"ntp-dashboard: note: listening on {host}, beyond this machine: anyone who can reach it "
              "and has the URL above can read the run", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watch = asyncio.create_task(_watch_parent(parent, stop)) if parent is not None else None
    try:
        await stop.wait()
    finally:
        if watch is not None:
            watch.cancel()
        await runner.cleanup()


def _main() -> int:
    from ntp_nemo.dashboard.page_state import classify
    from ntp_nemo.dashboard.server import new_token

    args = parse_args()
    root = Path(args.run_dir).resolve()
    if args.parent is None or root.exists():
        classify(root)  # exit 2 on a path that is not a run or sweep directory
    _raise_open_files_limit()
    # aiohttp logs a malformed request (answered 400) with its parser's traceback: one line per request
    # would flood the console; the client gets its 400 and that is all there is to say
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    asyncio.run(_serve_until_stopped(root, args.host, args.port, new_token(), args.parent))
    return 0


main = cli_main(_main)

if __name__ == "__main__":
    main()
