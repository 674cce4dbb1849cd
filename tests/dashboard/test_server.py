"""ntp-dashboard's server in process: the token, loopback, 4xx on bad requests, many idle or malformed
connections, the empty state, a directory that is no run (exit 2) and a sweep's table (the test session's
reference sweep: real jobs)."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ntp_nemo.cli.dashboard import _raise_open_files_limit, is_loopback, parse_args
from ntp_nemo.dashboard.server import new_token, serve
from tests.conftest import REFERENCES, read_metrics


@contextmanager
def served(root: Path, host: str = "127.0.0.1") -> Iterator[tuple[int, str, list]]:
    """The dashboard of `root` on a free port, in a thread with its own event loop: (port, token,
    the addresses it listens on)."""
    token, loop = new_token(), asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner, port = asyncio.run_coroutine_threadsafe(serve(root, token, host, 0), loop).result(timeout=30)
    try:
        yield port, token, list(runner.addresses)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def get(port: int, path: str, method: str = "GET") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_token_refused_and_bad_requests_get_4xx(tmp_path):
    with served(tmp_path) as (port, token, _):
        assert get(port, f"/{token}/")[0] == 200
        for path in ("/", "/api/state", f"/{token[:-1]}/api/state", f"/x{token}/", "/favicon.ico"):
            status, body = get(port, path)
            assert status == 403, path
            assert b"token" in body and b"Traceback" not in body
        for path, method, want in [
            (f"/{token}/nothing", "GET", 404),
            (f"/{token}/static/../../pyproject.toml", "GET", 404),
            (f"/{token}/static/%2e%2e/state.py", "GET", 404),
            (f"/{token}/api/state?job=0", "GET", 400),  # not a sweep
            (f"/{token}/api/state?x=1", "GET", 400),
            (f"/{token}/api/state", "POST", 405),
            (f"/{token}/api/state", "DELETE", 405),
        ]:
            status, body = get(port, path, method)
            assert status == want, (path, method, status, body)
            assert b"Traceback" not in body
            assert json.loads(body)["error"]


def test_listens_on_loopback_only_by_default(tmp_path):
    assert parse_args([str(tmp_path)]).host == "127.0.0.1"
    assert is_loopback("127.0.0.1") and is_loopback("::1") and not is_loopback("0.0.0.0")
    with served(tmp_path) as (port, token, addresses):
        assert addresses and all(is_loopback(a[0]) for a in addresses)
        outside = [a for a in _own_addresses() if not is_loopback(a)]
        for address in outside:  # the same port on this machine's other addresses: nothing answers
            with pytest.raises(OSError), socket.create_connection((address, port), timeout=2):
                pass


def _own_addresses() -> list[str]:
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)})
    except OSError:
        return []


def test_a_thousand_idle_or_malformed_connections_do_not_stop_the_page(tmp_path):
    _raise_open_files_limit()
    with served(tmp_path) as (port, token, _):
        held = []
        try:
            for i in range(1000):
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                if i % 2:  # half send garbage (some of it an unfinished request), half stay silent
                    s.sendall(b"\x00\xffNOT HTTP\r\n\r\n" if i % 4 == 1 else b"GET /" + b"a" * 9000)
                held.append(s)
            status, body = get(port, f"/{token}/api/state")
            assert status == 200 and json.loads(body)["status"] == "not_started"
            answered = [s for s in held[1::4] if s.recv(64).split(b" ")[1] == b"400"]
            assert len(answered) == len(held[1::4])  # malformed requests: 400, and the server lives on
        finally:
            for s in held:
                s.close()


def test_empty_state_and_not_a_run(tmp_path, monkeypatch, capsys):
    with served(tmp_path) as (port, token, _):
        status, body = get(port, f"/{token}/api/state")
    doc = json.loads(body)
    assert status == 200 and doc["status"] == "not_started" and doc["loss"]["step"] == []
    assert doc["layout"]["state"] == "starting" and doc["goodput"] is None
    (tmp_path / "notes.txt").write_text("not a run")
    from ntp_nemo.cli.dashboard import main

    for argv in ([str(tmp_path)], [str(tmp_path / "missing")], [str(tmp_path / "notes.txt")],
                 [str(tmp_path), "--port", "70000"]):
        monkeypatch.setattr(sys, "argv", ["ntp-dashboard", *argv])
        with pytest.raises(SystemExit) as exc:
            main()
        assert exc.value.code == 2, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err and ("run directory" in err or "--port" in err), err


def test_sweep_directory_table_links_each_job(reference_losses, tmp_path_factory):
    reference_losses("single-5")  # the session's reference sweep has finished: real jobs of one sweep
    shared = os.environ.get("NTP_TEST_REFERENCES")
    root = Path(shared) if shared else next(tmp_path_factory.getbasetemp().glob("references*"))
    sweep = root / "sweep"
    with served(sweep) as (port, token, _):
        status, body = get(port, f"/{token}/api/state")
        doc = json.loads(body)
        assert status == 200 and doc["kind"] == "sweep"
        jobs = {j["job"]: j for j in doc["jobs"]}
        assert len(jobs) == len(REFERENCES)
        for name, job in jobs.items():
            summary = json.loads((sweep / name / "summary.json").read_text())
            assert job["status"] == "ok"
            assert job["values"]["final_loss"] == pytest.approx(summary["final_loss"])
        name = sorted(jobs)[0]
        status, body = get(port, f"/{token}/api/state?job={name}")
        run = json.loads(body)
        assert status == 200 and run["kind"] == "run" and run["status"] == "finished"
        assert run["loss"]["step"] == [m["step"] for m in read_metrics(sweep / name)]
        assert get(port, f"/{token}/api/state?job=nope")[0] == 404
        assert get(port, f"/{token}/api/state?job=../{name}")[0] == 404
