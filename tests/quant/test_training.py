"""QuantizationCallback inside real Lightning training (NTPStrategy, forked gloo workers).

Full precision until `start_step`, then calibration and QAT: a degraded NTP layout follows the
single-process QAT loss curve, the signature invariant carried over to fake-quantised training.
"""

from __future__ import annotations

import pytest

from tests.conftest import TINY, compose, read_metrics

STEPS, START = 6, 3


def _fit(tmp_path, name: str, layout: list[str], fmt: str) -> list[float]:
    from ntp_nemo.config.resolve import resolve
    from ntp_nemo.config.validate import validate
    from ntp_nemo.data.prepare import build_data
    from ntp_nemo.lightning.factory import build_trainer
    from ntp_nemo.lightning.qat import QuantizationCallback

    cfg = compose([*TINY, *layout, f"trainer.max_steps={STEPS}", "checkpoint.save_on_end=false"])
    validate(cfg)
    run_dir = tmp_path / name
    run_dir.mkdir()
    d = cfg.data
    data = build_data(d.path, d.tokenizer, int(d.seq_len), int(d.global_batch_size), int(cfg.seed),
                      float(d.val_fraction), int(cfg.model.vocab_size))
    callback = QuantizationCallback(fmt, calib_batches=2, start_step=START, exclude=["head"])
    trainer, module, _ = build_trainer(resolve(cfg), run_dir, data, None, [callback])
    trainer.fit(module)
    return [m["loss"] for m in read_metrics(run_dir)]


@pytest.fixture
def one_thread(monkeypatch):
    """One thread in this process and in the forked workers, as in the CLI (2 shared cores).

    Lightning's launcher would otherwise raise a 1-process worker to cpu_count threads; an OpenMP
    team inherited from threaded work earlier in this process then deadlocks the forked worker.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
def test_qat_on_a_degraded_layout_follows_the_single_process_curve(tmp_path, capfd, one_thread):
    from ntp_nemo.quant.modules import register_tp_layers

    register_tp_layers()  # import modelopt once, before the workers are forked
    single = _fit(tmp_path, "single", ["mesh.dp=1", "mesh.tp=1", "ntp.replica_tp=null"], "int8")
    plain = _fit(tmp_path, "plain", ["mesh.dp=1", "mesh.tp=1", "ntp.replica_tp=null"], "none")
    ntp = _fit(tmp_path, "ntp", ["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,1]"], "int8")
    out = capfd.readouterr().out
    assert out.count(f"quant: int8 fake quantisation from step {START}") == 2, out[-2000:]
    assert len(single) == len(ntp) == STEPS
    assert single[:START] == pytest.approx(plain[:START], rel=1e-6)  # full precision before start_step
    assert all(abs(q - p) > 1e-6 for q, p in zip(single[START + 1:], plain[START + 1:], strict=True))
    # Tolerance above the exactness tests' 1e-5: several optimizer steps compound float32 noise.
    assert ntp == pytest.approx(single, rel=1e-4)
