"""Exporting to Hugging Face: import -> export is bit-exact, and a trained (2,1) checkpoint exported
with `ntp-export` loads in `transformers` and reproduces ntp_nemo's logits."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch

from ntp_nemo.checkpoint.sharded import save_checkpoint
from ntp_nemo.cli.export import main
from ntp_nemo.errors import ConfigError
from ntp_nemo.hf import load_hf_into
from ntp_nemo.hf.checkpoint_source import iter_logical_tensors
from ntp_nemo.hf.config_map import hf_fields
from ntp_nemo.hf.export import export_checkpoint, export_model, parse_size
from ntp_nemo.hf.safetensors_files import HFWeightsReader
from ntp_nemo.launch.workers import run_workers
from ntp_nemo.models import build_model
from ntp_nemo.runtime.assemble import assemble
from ntp_nemo.runtime.runtime import NTPRuntime
from ntp_nemo.runtime.step import train_step
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.hf.test_import import HF_VOCAB, PADDED_VOCAB, TOL, _rel, hf_logits, make_hf_dir, resolved, tokens
from tests.ntp_cases import OPTIM

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_export")
    return {"gpt2": make_hf_dir(root / "gpt2", "gpt2", seed=11),
            "llama": make_hf_dir(root / "llama", "llama", seed=12, max_shard_size="40KB"),
            "gpt2-untied": make_hf_dir(root / "gpt2_untied", "gpt2-untied", seed=13),
            "llama-tied": make_hf_dir(root / "llama_tied", "llama-tied", seed=14)}


def hf_state(path) -> dict[str, torch.Tensor]:
    with HFWeightsReader(path) as reader:
        return {k: reader.read(k, (slice(None),) * len(reader.shape(k))) for k in reader.weight_map}


def assert_bit_exact(original, exported) -> None:
    want, got = hf_state(original), hf_state(exported)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


@pytest.mark.parametrize("kind", ["gpt2", "llama", "gpt2-untied", "llama-tied"])
def test_import_export_in_memory_is_bit_exact(hf_dirs, tmp_path, kind):
    path = hf_dirs[kind]
    model = build_model(resolved(path))
    load_hf_into(model, path)
    export_model(model, tmp_path / "out", eos_token_id=1)
    assert_bit_exact(path, tmp_path / "out")
    if kind == "gpt2":  # same tensors, same dtype: safetensors writes the very same file
        written, original = (d / "model.safetensors" for d in (tmp_path / "out", path))
        assert written.read_bytes() == original.read_bytes()
    mine, theirs = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "out", path))
    assert hf_fields(mine) == hf_fields(theirs)


def test_padded_vocabulary_exports_back_to_the_hf_size(hf_dirs, tmp_path):
    path = hf_dirs["gpt2-untied"]
    model = build_model(resolved(path, PADDED_VOCAB))
    load_hf_into(model, path)
    assert float(model.embed.weight.detach()[HF_VOCAB:].abs().max()) == 0.0
    export_model(model, tmp_path / "out", vocab_size=HF_VOCAB)
    assert_bit_exact(path, tmp_path / "out")
    with pytest.raises(ConfigError, match="--vocab-size"):
        export_model(model, tmp_path / "out2", vocab_size=PADDED_VOCAB + 1)
    with pytest.raises(ConfigError, match="grouped-query"):
        gqa = dataclasses.replace(model.cfg, num_heads=4, num_kv_heads=2)
        export_model(build_model(gqa), tmp_path / "gqa")
    with pytest.raises(ValueError, match="unsharded"):
        model.embed.weight.ntp_spec = dataclasses.replace(model.embed.weight.ntp_spec, hi=3)
        export_model(model, tmp_path / "out3")


def train_worker(rank: int, world: int, cfg, path: str, root: str, ids: torch.Tensor) -> dict:
    """Import on layout (2,1), checkpoint it, train 3 AdamW steps (`train_step` on the assembled rank),
    checkpoint again, return logits."""
    layout = ResolvedLayout.make(Topology(2, [2, 1], [2] * (cfg.num_layers + 2)))

    def imported(rt: NTPRuntime) -> torch.nn.Module:
        model = rt.build_model(cfg, seed=0, dtype=torch.float32)
        load_hf_into(model, path)
        return model

    state = assemble(layout, rank, cfg, {**OPTIM, "lr": 1e-2}, None, seed=0, make_model=imported)
    model, opt, topo = state.model, state.optimizer, state.runtime.topology
    save_checkpoint(f"{root}/imported/checkpoints/step_000000", model, step=0, layout=layout.to_dict())
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        batch = torch.randint(0, HF_VOCAB, (6, 9), generator=gen)
        micro = [batch[i: i + 1] for i in state.my_microbatches(6)]
        train_step(state, micro, batch[:, 1:].numel(), max_norm=None)
    extra = {"model_config": dataclasses.asdict(cfg)}
    save_checkpoint(f"{root}/trained/checkpoints/step_000003", model, opt, extra, step=3,
                    layout=layout.to_dict())
    with torch.no_grad():
        return {"logits": model(ids), "vocab_start": model.vocab_start, "replica": topo.coord(rank).replica}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_trained_checkpoint_exports_to_transformers(hf_dirs, tmp_path, kind, monkeypatch, capsys):
    path = hf_dirs[kind]
    cfg = resolved(path)
    ids = tokens()
    results = run_workers(train_worker, 3, cfg, str(path), str(tmp_path), ids)
    # Import -> sharded (2,1) checkpoint -> export: bit-exact.
    export_checkpoint(tmp_path / "imported/checkpoints/step_000000", tmp_path / "hf_imported", cfg=cfg)
    assert_bit_exact(path, tmp_path / "hf_imported")
    single = build_model(cfg)
    load_hf_into(single, path)
    logical = dict(iter_logical_tensors(tmp_path / "imported/checkpoints/step_000000"))
    assert sorted(logical) == sorted(n for n, _ in single.named_parameters())
    assert all(torch.equal(logical[n], p.detach()) for n, p in single.named_parameters())
    # Trained: the CLI on the run directory, written as several shards with an index.
    monkeypatch.setattr(sys, "argv", ["ntp-export", str(tmp_path / "trained"), str(tmp_path / "hf_trained"),
                                      "--max-shard-size", "60KB"])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code == 0, capsys.readouterr().err
    assert (tmp_path / "hf_trained" / "model.safetensors.index.json").is_file()
    assert not torch.equal(hf_state(tmp_path / "hf_trained")[next(iter(hf_state(path)))],
                           hf_state(path)[next(iter(hf_state(path)))])  # training changed the weights
    theirs = hf_logits(tmp_path / "hf_trained", ids)
    ours = torch.cat([r["logits"] for r in sorted(results[:2], key=lambda r: r["vocab_start"])], dim=-1)
    assert _rel(ours, theirs) < TOL
    assert _rel(results[2]["logits"], theirs) < TOL  # the degraded replica holds the same model


def test_cli_rejects_bad_input_with_exit_code_2(tmp_path, monkeypatch, capsys):
    for argv in (["ntp-export", str(tmp_path / "nothing"), str(tmp_path / "out")],
                 ["ntp-export", str(tmp_path), str(tmp_path / "out")]):
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit) as done:
            main()
        assert done.value.code == 2
        assert "RUN_DIR_OR_CHECKPOINT" in capsys.readouterr().err
    assert parse_size("60KB") == 60_000 and parse_size("5GB") == 5 * 10**9 and parse_size("123") == 123
    with pytest.raises(ConfigError, match="--max-shard-size"):
        parse_size("lots")
