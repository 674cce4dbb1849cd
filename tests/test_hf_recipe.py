"""The `llama_tiny_from_hf` recipe continues training from a HF directory made here, and `ntp-export`
turns the run directory back into a HF directory: the real commands, end to end."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from ntp_nemo.hf.config_map import hf_fields
from tests.conftest import run_cli
from tests.test_hf_export import hf_state

transformers = pytest.importorskip("transformers")

STEPS, LR = 3, 1e-3


def _hf_llama(path) -> None:
    torch.manual_seed(21)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=256,
        eos_token_id=256))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)


@pytest.mark.slow
def test_recipe_continues_from_hf_and_exports(tmp_path, monkeypatch, capsys):
    hf_dir, run_dir, out_dir = tmp_path / "hf_llama", tmp_path / "run", tmp_path / "exported"
    _hf_llama(hf_dir)
    train = run_cli(["recipe=llama_tiny_from_hf", f"model.init_from={hf_dir}", f"hydra.run.dir={run_dir}",
                     f"trainer.max_steps={STEPS}", f"optim.lr={LR}", "optim.warmup_steps=0",
                     "data.seq_len=32", "trainer.val_every_n_steps=1000", "trainer.progress_bar=false",
                     "checkpoint.every_n_steps=0", "checkpoint.save_on_end=true", "logger=none",
                     "callbacks=none"], cwd=tmp_path)
    assert train.returncode == 0, train.stderr[-3000:]
    from ntp_nemo.hf.export import main  # ntp-export, called in this process as its console script does

    monkeypatch.setattr(sys, "argv", ["ntp-export", str(run_dir), str(out_dir)])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code == 0, capsys.readouterr().err[-3000:]

    mine, theirs = (json.loads((d / "config.json").read_text()) for d in (out_dir, hf_dir))
    assert hf_fields(mine) == hf_fields(theirs)
    assert (mine["bos_token_id"], mine["eos_token_id"]) == (256, 256)
    start, end = hf_state(hf_dir), hf_state(out_dir)
    assert sorted(start) == sorted(end)
    moved = max(float((end[k] - start[k]).abs().max()) for k in start)
    # Training started from the HF weights (a fresh init differs from them by ~0.1 per element) and
    # moved them: AdamW moves an element by at most about lr per step.
    assert 0.0 < moved <= 1.5 * LR * STEPS
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir)
    assert loaded.config.num_key_value_heads == 2
