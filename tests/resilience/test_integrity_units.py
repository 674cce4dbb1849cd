"""Pieces of the integrity watch, in process: bit flips, the spike detector and the outlier rank, the
incident record, `ntp-incidents`, and the goodput category of the checks' time."""

from __future__ import annotations

import sys

import pytest
import torch

from ntp_nemo.config.schema import IntegrityConfig
from ntp_nemo.goodput import compute_goodput
from ntp_nemo.goodput import events as ev
from ntp_nemo.goodput.incident_log import (
    append_incident,
    load_incidents,
    load_skipped,
    record_skipped,
    summary,
    table,
)
from ntp_nemo.resilience.corruption import bit_of, flip_bit_, flipped
from ntp_nemo.resilience.cross_replay import cross_source, cross_verdict, relative_difference, tolerance
from ntp_nemo.resilience.integrity import (
    SLOTS,
    IntegrityWatch,
    LayerInputs,
    Suspect,
    device_evidence,
    find_suspects,
    own_row,
)


def test_bit_flips_in_float32_and_bfloat16():
    t = torch.tensor([1.5, 1e-3], dtype=torch.float32)
    flip_bit_(t, 0, 30)  # 1.5 has exponent 127: the top exponent bit makes it inf/NaN
    assert not torch.isfinite(t[0]) and t[1] == 1e-3
    b = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert bit_of(b, 1, 6) == 0
    flip_bit_(b, 1, 6)  # the top bfloat16 mantissa bit: 2.0 -> 3.0
    assert b.tolist() == [1.0, 3.0] and bit_of(b, 1, 6) == 1
    assert flipped(torch.tensor([1.0]), 0, 31).item() == -1.0  # a copy, sign bit
    x = torch.tensor([0.25])
    flip_bit_(x, 0, 22 + 32)  # a bit beyond the width wraps (22: top float32 mantissa bit)
    assert x.item() == 0.375


def test_spike_detector_on_a_noisy_decline_and_a_spike(tmp_path):
    watch = IntegrityWatch(IntegrityConfig(spike_zscore=8.0, spike_window=20), tmp_path)
    gen = torch.Generator().manual_seed(0)
    noise = (torch.rand(200, generator=gen) - 0.5).tolist()
    losses = [5.5 * 0.995**i + 0.05 * n for i, n in enumerate(noise)]
    alarms = []
    for i, loss in enumerate(losses):
        rec = {"loss": loss, "grad_norm": 1.0 + 0.1 * noise[i]}
        if watch._spike(rec):
            alarms.append(i)
        watch.history["loss"].append(loss)
        watch.history["grad_norm"].append(rec["grad_norm"])
    assert alarms == []
    assert "grad_norm" in watch._spike({"loss": losses[-1], "grad_norm": 1e30})
    assert watch._spike({"loss": losses[-1] + 5.0, "grad_norm": 1.0}).startswith("loss")
    assert IntegrityWatch(IntegrityConfig(spike_zscore=0), tmp_path)._spike({"loss": 1e9}) is None


def test_suspect_ranks_of_the_per_step_check():
    # rows of (slot 0, slot 1): every rank's own largest gradient element of two parameters
    clean = [0.3, 0.02, 0.5, 0.01, 0.4, 0.03]
    assert find_suspects(clean, [0, 0, 0], 1000) == []
    assert find_suspects([0.3, 0.02, 0.5, 40.0, 0.4, 0.03], [0, 0, 0], 1000) == [Suspect(1, 1, 40.0, 0.03)]
    nan = find_suspects([0.3, 0.02, float("nan"), 0.01, 0.4, 0.03], [0, 0, 0], 1000)
    assert [(s.rank, s.slot) for s in nan] == [(1, 0)] and nan[0].others != nan[0].others
    # a parameter whose gradient is 0 everywhere: any value elsewhere stands out (it changes the update)
    assert [(s.rank, s.slot) for s in find_suspects([0.0, 0.0, 2.0], [0, 0, 0], 1000)] == [(2, 0)]
    # -1: not held (another pipeline stage); a rank is compared with its own stage's ranks only
    assert find_suspects([5.0, -1.0, -1.0, 0.001], [0, 1], 1000) == []
    assert find_suspects([5.0, 0.001], [0, 1], 1000) == []
    assert find_suspects([0.3, 600.0], [0, 0], 0) == []  # 0: the check is off
    # one replica (no cross replay): a bad device only beyond what data can give (or not finite)
    assert not device_evidence([Suspect(1, 3, 2.0, 0.00185)])  # 1081x: kept as the data's
    assert device_evidence([Suspect(1, 3, 1.06e35, 0.00147)])  # a flipped top exponent bit
    assert device_evidence([Suspect(1, 3, float("nan"), float("nan"))])


def test_cross_replay_tells_a_bad_device_from_the_data():
    """The replay repeated a suspect value: another replica computing the same micro-batches reproduces
    the data's (within the dtype's rounding, whatever the TP degree) and not a bad device's."""
    # (2,1): ranks 0-1 replica 0 (TP 2), rank 2 replica 1; rows of (slot 0, slot 1, activations)
    stages, replicas = [0, 0, 0], [0, 0, 1]
    tol = tolerance(torch.float32)
    assert tol == pytest.approx(3.45e-4, rel=1e-2)
    assert tolerance(torch.bfloat16) == pytest.approx(0.088, rel=1e-2)
    # replica 1 (rank 2) computed replica 0's micro-batches and replica 0 replica 1's (cross_source)
    assert (cross_source(0, 2), cross_source(1, 2), cross_source(2, 3)) == (1, 0, 0)
    # seed 1 of the persistent campaign: an unused position row's gradient, 0 on every rank, is 2.0 on
    # rank 1 on every step (1081x the others: below the old magnitude rule's 1e6, kept as data then)
    replayed = [0.00185, 0.3, 1.2, 2.0, 0.2, 1.1, 0.0017, 0.25, 1.3]
    # replica 0 computed replica 1's micro-batches (ranks 0-1), replica 1 replica 0's (rank 2)
    crossed = [0.0017, 0.25, 1.2999999, 0.0009, 0.2, 1.1, 0.00185, 0.3000001, 1.2]
    v = cross_verdict([(1, 0)], replayed, crossed, stages, replicas, 2, tol)
    assert v.unreproduced == ((1, 0),) and v.suspect_diff > 0.99 and v.honest_diff < 1e-6
    # seed 5's false alarm: one replica's honest gradient 1028x the other's, reproduced by the other replica
    replayed = [0.00102, 0.3, 1.2, 0.0, 0.2, 1.1, 9.9e-7, 0.25, 1.3]
    crossed = [9.9e-7, 0.25, 1.3, 9.9e-7, 0.25, 1.3, 0.0010200002, 0.3, 1.2]
    v = cross_verdict([(0, 0)], replayed, crossed, stages, replicas, 2, tol)
    assert v.unreproduced == () and v.suspect_diff < 1e-6
    # not finite on the replay and on the other replica too: the data's; on one only: the device's
    nan = float("nan")
    assert cross_verdict([(2, 2)], [1, 1, 1, 1, 1, 1, 1, 1, nan], [1, 1, 1, 1, 1, 1, 1, 1, 1],
                         stages, replicas, 2, tol).unreproduced == ((2, 2),)
    assert cross_verdict([(2, 2)], [1, 1, 1, 1, 1, 1, 1, 1, nan], [1, 1, nan, 1, 1, nan, 1, 1, 1],
                         stages, replicas, 2, tol).unreproduced == ()
    # near zero, honest rounding is judged against the step's gradient scale, not the value itself
    assert relative_difference(1e-9, 3e-9, 0.5) < tol and relative_difference(1e-9, 3e-9, 0.0) > tol


def test_own_row_holds_each_parameters_largest_gradient_and_the_layer_inputs():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleDict({"0": torch.nn.Linear(3, 2), "1": torch.nn.Linear(2, 1)})

        def forward(self, x):
            return self.blocks["1"](self.blocks["0"](x))

    model = Two()
    inputs = LayerInputs()
    inputs.attach(model)  # the hooks sit on the layers (`blocks`) and a final norm, if any
    model(torch.tensor([[1.0, -7.0, 2.0]])).sum().backward()
    w = model.blocks["0"].weight.grad
    w[1, 2] = -9.5  # the largest magnitude is negative
    row = own_row(model, inputs.value, torch.device("cpu"))
    assert row.shape == (SLOTS + 1,) and row[0] == 9.5
    assert row[1] == model.blocks["0"].bias.grad.abs().max() and row[4] == -1.0  # 4 parameters: slot 4 unheld
    assert row[SLOTS] == 7.0  # the largest input entering a layer
    w[0, 0] = float("nan")
    assert torch.isnan(own_row(model, None, torch.device("cpu"))[0])


def test_incident_record_table_and_cli(tmp_path, capsys, monkeypatch):
    from ntp_nemo.cli.incidents import main

    (tmp_path / "metrics.jsonl").write_text("")
    append_incident(tmp_path, {"step": 3, "kind": "nonfinite", "sample": 42, "verdict": "data",
                               "action": "sample skipped", "cost_s": 0.25})
    append_incident(tmp_path, {"step": 8, "kind": "divergence", "replica": 2, "rank": 5, "parameter": "w",
                               "verdict": "bitflip", "action": "rolled back", "cost_s": 1.5})
    assert record_skipped(tmp_path, [42]) == [42] and record_skipped(tmp_path, [7, 42]) == [7, 42]
    assert load_skipped(tmp_path) == [7, 42]
    records = load_incidents(tmp_path)
    assert [r["step"] for r in records] == [3, 8] and records[0]["rank"] is None
    rows = table(records).splitlines()
    assert rows[0].split() == ["step", "kind", "where", "verdict", "action", "cost", "s"]
    assert "sample 42" in rows[1] and "0.250" in rows[1] and "replica 2, rank 5, w" in rows[2]
    assert summary(records) == {"findings": 2, "by_kind": {"nonfinite/data": 1, "divergence/bitflip": 1},
                                "skipped_samples": [42], "cost_s": 1.75}
    monkeypatch.setattr(sys, "argv", ["ntp-incidents", str(tmp_path)])
    with pytest.raises(SystemExit) as done:
        main()
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.splitlines()[1:3] == rows[1:] and "7, 42" in out
    monkeypatch.setattr(sys, "argv", ["ntp-incidents", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit) as done:
        main()
    err = capsys.readouterr().err
    assert done.value.code == 2 and "RUN_DIR" in err and "Traceback" not in err


def test_integrity_time_is_its_own_badput():
    events = [{"t": 0.0, "event": ev.JOB_START, "pid": 1}, {"t": 1.0, "event": ev.INIT_DONE, "pid": 1},
              {"t": 1.0, "event": ev.STEP_START, "pid": 1, "step": 1},
              {"t": 3.0, "event": ev.INTEGRITY_CHECK, "pid": 1, "seconds": 0.5},
              {"t": 3.0, "event": ev.STEP_END, "pid": 1, "step": 1, "layout": "(2,1)", "capacity": 1.0,
               "tokens": 8},
              {"t": 3.0, "event": ev.JOB_END, "pid": 1, "status": "ok"}]
    report = compute_goodput(events)
    assert report.badput_s[ev.INTEGRITY] == pytest.approx(0.5)
    assert report.productive_s == pytest.approx(1.5)


def test_a_persistent_bitflip_stays_with_its_process(tmp_path):
    """A bad device is a process, not a rank number: after a live re-layout gives another process the
    rank, that process is not struck; the struck process is struck on its new model too."""
    from types import SimpleNamespace

    from ntp_nemo.resilience.corruption import CorruptionInjector
    from ntp_nemo.resilience.fault_config import Fault

    fault = Fault(0, "bitflip", rank=0, step=2, target="grad", bit=30, persistent=True, draw=0)

    def process(rank: int):
        injector = CorruptionInjector([fault], tmp_path / "faults", tmp_path / "ckpt")
        module = SimpleNamespace(model=torch.nn.Linear(2, 2), data=None)
        trainer = SimpleNamespace(global_rank=rank, global_step=0)
        return injector, module, trainer

    def step(injector, module, trainer, n: int, rank: int) -> bool:
        """Step n as `rank`: is the first parameter's gradient flipped (its top exponent bit)?"""
        trainer.global_rank, trainer.global_step = rank, n - 1
        injector.on_train_batch_start(trainer, module, {}, n - 1)
        module.model.zero_grad()
        module.model(torch.ones(1, 2)).sum().backward()
        return abs(float(module.model.weight.grad.view(-1)[0])) > 1e30

    bad, good = process(0), process(1)
    assert not step(*bad, 1, rank=0) and not step(*good, 1, rank=1)  # before the fault's step
    assert step(*bad, 2, rank=0) and not step(*good, 2, rank=1)
    assert step(*bad, 3, rank=0)
    # the bad process excluded: the good one is rank 0 now, and stays good
    assert not step(*good, 3, rank=0) and not step(*good, 4, rank=0)
    # a re-layout gives the bad process a new model and rank: still bad
    bad[1].model = torch.nn.Linear(2, 2)
    assert step(*bad, 4, rank=1)
    assert [f["step"] for f in bad[0].fired] == [2] and good[0].fired == []


def test_a_new_model_restarts_the_spike_window_and_drops_the_verified_copy(tmp_path):
    """After a live re-layout every rank decides spikes from the same steps: a joining process has seen
    none of the earlier ones, so the survivors forget theirs too (and the verified copy no longer fits)."""
    from types import SimpleNamespace

    watch = IntegrityWatch(IntegrityConfig(spike_window=3), tmp_path)
    module = SimpleNamespace(model=torch.nn.Linear(1, 1))
    watch._follow_model(module)
    for loss in (3.0, 2.9, 2.8):
        watch.history["loss"].append(loss)
        watch.history["grad_norm"].append(1.0)
    watch.verified = "the copy"
    watch._follow_model(module)  # the same model: nothing forgotten
    assert len(watch.history["loss"]) == 3 and watch.verified == "the copy"
    assert watch._spike({"loss": 9.0, "grad_norm": 1.0})
    module.model = torch.nn.Linear(1, 1)  # a live recovery adopted a new one
    watch._follow_model(module)
    assert not watch.history["loss"] and not watch.history["grad_norm"] and watch.verified is None
    assert watch._spike({"loss": 9.0, "grad_norm": 1.0}) is None  # no window yet, as on a joining process
