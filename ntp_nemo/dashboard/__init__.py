"""`ntp-dashboard RUN_DIR`: a read-only live page of a run (or a sweep) served on loopback.

`state.py` turns the files a run writes (metrics.jsonl, goodput.jsonl through the goodput calculator,
heartbeats, checkpoints) into one JSON document; `server.py` serves it and the page (`static/`, with
the vendored uPlot charting library) behind a random token; `cli.py` is the console entry point and
`launch.py` starts it beside a run (`dashboard.port=N`), in its own process, off the workers.
"""
