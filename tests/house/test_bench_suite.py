"""bench/suite.py without running a benchmark: its table in docs/benchmarks.md has one row per figure of
the suite, a run fills only the cells it measured, every comparison names a bench script, each figure's
pattern reads the line its bench prints, and `--list` lists every script, new ones included."""

from __future__ import annotations

import re

import bench.suite as suite
from bench.suite import DOC, SUITE, current_rows, render, table, write_doc

# A line each bench prints, in the format of its print statement (one per figure pattern).
PRINTED = {
    ("throughput", "ntp TP2 / DTensor TP2 (goal >= 2.0)"):
        " ntp TP2 / dtensor TP2: tokens/s ratio 2.379 (goal >= 2.0), by CPU time 2.014; loss curves agree",
    ("throughput", "ntp TP1 / plain loop (goal >= 1.0)"):
        " ntp TP1 / plain TP1: tokens/s ratio 0.988 (goal >= 1.0), by CPU time 0.987; loss curves agree",
    ("throughput", "ntp TP2 / DTensor TP2, by CPU time"):
        " ntp TP2 / dtensor TP2: tokens/s ratio 1.227 (goal >= 2.0), by CPU time 2.121; loss curves agree",
    ("checkpoint", "save: torch.save s / ntp s (goal >= 1.0)"):
        "ratio save=1.76 load=1.64 reshard_load=0.94 async_blocking=0.025",
    ("checkpoint", "load: torch.load s / ntp s (goal >= 1.0)"):
        "ratio save=1.76 load=1.64 reshard_load=0.94 async_blocking=0.025",
    ("checkpoint", "TP 2x2 -> TP 3 load: torch.load s / ntp s (goal >= 0.8)"):
        "ratio save=1.76 load=1.64 reshard_load=0.94 async_blocking=0.025",
    ("failover", "live recovery s / restart recovery s"): "\nlive recovery / restart recovery: 0.16",
    ("spares", "loss -> full layout, without / with fault.spares=1"):
        "spares: loss -> full layout, mean without 60.17 s, with 10.54 s: ratio 5.71",
    ("failure_trace", "simulator's worst error on time to step 200"):
        "simulator: every policy's time to step 200 predicted within 1.4% (inside the 10% bound)",
    ("fault_campaign", "scenarios held"): "\nfault campaign: 30/30 scenarios held (seed 5)",
    ("integrity_campaign", "trials right"):
        "integrity campaign: 120/120 trials right (classified, attributed, and the curve after recovery "
        "equal to the failure-free run where compared)",
    ("hostile", "attacks withstood"): "hostile clients: 23/23 attacks withstood",
    ("memory", "saved bytes, none / full recompute"):
        "gpt2   default  full             7.03         9.56             True",
    ("dry_run", "per rank CPU / grouped CPU"):
        "   whole stages / short builds: 1.9x wall, 2.0x CPU; per rank / short builds: 2.1x wall, 2.4x CPU; "
        "identical per-rank results: True",
    ("gpu_check", "parts ok, CPU rehearsal"): "gpu_check rehearsal: 4/4 parts ok",
    ("block_sharding", "largest deviation from the model (goal <= 5%)"):
        "largest deviation of measured from predicted: 0.00% (within 5%)",
}
EXPECTED = {"throughput": ["2.379", "0.988", "2.121"], "checkpoint": ["1.76", "1.64", "0.94"],
            "failover": ["0.16"], "spares": ["5.71"], "failure_trace": ["1.4%"], "fault_campaign": ["30/30"],
            "integrity_campaign": ["120/120"], "hostile": ["23/23"], "memory": ["9.56"], "dry_run": ["2.4x"],
            "gpu_check": ["4/4"], "block_sharding": ["0.00%"]}


def test_the_doc_holds_one_row_per_figure_of_the_suite():
    rows = current_rows(DOC.read_text())
    assert set(rows) == {(c.bench, f.name) for c in SUITE for f in c.figures}


def test_every_comparison_names_a_bench_script_and_its_patterns_read_its_lines():
    for c in SUITE:
        assert (suite.BENCH / f"{c.bench}.py").is_file(), c.bench
        got = [re.search(f.pattern, PRINTED[c.bench, f.name]).group(1) for f in c.figures]
        assert got == EXPECTED[c.bench], c.bench
        assert all(f.command.startswith(f"python bench/{c.bench}.py") for f in c.figures)


def test_a_run_fills_the_cells_it_measured_and_keeps_the_others():
    first = table({}, {}, "abc1234", {})
    memory = next(r for r in first if r[0] == "`memory`")
    assert memory[2:5] == ["9.56", "`python bench/memory.py` (0d8310c)", "-"]
    text = "intro\n" + suite.BEGIN + "\nold\n" + suite.END + "\nafter\n"
    doc = write_doc(text, render(first))
    assert doc.startswith("intro\n") and doc.endswith("\nafter\n")
    key = ("memory", "saved bytes, none / full recompute")
    second = table({}, {key: ("5.96", "53 s")}, "def5678", current_rows(doc))
    memory = next(r for r in second if r[0] == "`memory`")
    assert memory[2] == "9.56" and memory[4] == "5.96" and "def5678" in memory[5] and "53 s" in memory[5]
    throughput = [r for r in second if r[0] == "`throughput`"]
    assert [r[2] for r in throughput] == ["2.379", "0.988", "2.014"] and {r[4] for r in throughput} == {"-"}
    third = table({key: ("9.60", "20 min")}, {}, "0fedcba", current_rows(write_doc(doc, render(second))))
    memory = next(r for r in third if r[0] == "`memory`")
    assert memory[2] == "9.60" and "0fedcba" in memory[3] and memory[4] == "5.96"  # the quick cell kept


def test_list_shows_every_script_the_suite_marked(tmp_path, monkeypatch):
    for name in ("throughput", "soak", "_common", "suite"):
        (tmp_path / f"{name}.py").write_text(f'"""{name}: what it measures.\n\nMore."""\n')
    monkeypatch.setattr(suite, "BENCH", tmp_path)
    assert suite.listing() == [("soak", False, "soak: what it measures."),
                               ("throughput", True, "throughput: what it measures.")]
