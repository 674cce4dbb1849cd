"""The architecture registry (`models/families.py`) and its third family, Qwen2 (Llama plus q/k/v biases).

The registry is the only place that knows a family by name: the code outside `models/` and `hf/` asks
it for traits.  Qwen2 shows that adding a family is one entry plus its Hugging Face names: a
`transformers.Qwen2ForCausalLM` imports with the same logits and exports bit-exact; on an uneven
(2,1) layout it trains on the single-process loss curve (float64); a checkpoint saved there loads on
TP3 and trains on the same numbers; the trained checkpoint, exported with `ntp-export`, reproduces
ntp_nemo's logits in `transformers`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import multiprocessing
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from ntp_nemo.checkpoint import load_checkpoint, save_checkpoint
from ntp_nemo.cli.export import main
from ntp_nemo.config.validate import validate_model
from ntp_nemo.errors import ConfigError
from ntp_nemo.hf import load_hf_into
from ntp_nemo.hf.config_map import hf_config, hf_fields, resolve_model_config
from ntp_nemo.hf.export import export_model
from ntp_nemo.hf.mapping import weight_map
from ntp_nemo.launch.workers import run_workers
from ntp_nemo.models import build_model, param_count
from ntp_nemo.models.families import family, model_shape, names
from ntp_nemo.models.model_config import ModelConfig
from ntp_nemo.runtime.assemble import RankState, assemble
from ntp_nemo.runtime.step import train_step
from ntp_nemo.topology import ResolvedLayout, Topology
from tests.hf.test_export import assert_bit_exact, hf_state
from tests.hf.test_import import HF_VOCAB, TOL, _one_thread, _rel, hf_logits, tokens
from tests.ntp_cases import OPTIM

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
QWEN = ModelConfig(arch="qwen2", vocab_size=67, hidden_size=48, num_layers=2, num_heads=6, num_kv_heads=2,
                   ffn_hidden_size=70, max_seq_len=16, tie_embeddings=False, norm_eps=1e-6)
SEED, SEQ, GLOBAL_BATCH, LR = 7, 8, 6, 1e-2
STEPS_BEFORE, STEPS_AFTER = 2, 2
UNEVEN = (2, [2, 1], [2] * 4)  # TP2 and a degraded TP1 replica
TP3 = (3, [3], [3] * 4)  # 6 query heads over 3 ranks, 2 KV heads shared unevenly


def tiny(arch: str, **kw) -> ModelConfig:
    kv = None if not family(arch).gqa else 2
    return ModelConfig(arch=arch, vocab_size=50, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=kv,
                       ffn_hidden_size=64, max_seq_len=16, **kw)


# ---- the registry ---------------------------------------------------------------------------------------


def test_unknown_family_names_model_arch_and_the_known_names():
    with pytest.raises(ConfigError) as err:
        family("bert")
    text = str(err.value)
    assert "model.arch" in text and "'bert'" in text
    assert all(f"model.arch={n}" in text for n in ("gpt2", "llama", "qwen2"))
    assert names() == ("gpt2", "llama", "qwen2")


# What the grep of the code review looked for: an architecture named, or a model asked whether it is one.
ARCH_NAME = re.compile(r'"llama"|"gpt2"|"qwen2"|arch ==|\.arch\b|getattr\(model, "llama"')


def test_architecture_names_appear_only_in_models_and_hf():
    """Everything outside `ntp_nemo/models/` and `ntp_nemo/hf/` asks the registry for traits."""
    hits = []
    for path in sorted((ROOT / "ntp_nemo").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("ntp_nemo/models/", "ntp_nemo/hf/")):
            continue
        hits += [f"{rel}:{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
                 if ARCH_NAME.search(line)]
    assert not hits, "architecture named outside models/ and hf/:\n" + "\n".join(hits)


@pytest.mark.parametrize("arch", names())
def test_traits_shape_the_model_and_its_hf_names(arch):
    """Every registered family builds, counts its parameters and has Hugging Face names and config."""
    cfg = tiny(arch)
    fam = family(arch)
    model = build_model(cfg)
    params = dict(model.named_parameters())
    assert param_count(cfg) == sum(p.numel() for p in params.values())
    assert model_shape(cfg).gated_mlp == fam.gated_mlp == ("blocks.0.mlp.gate_proj.weight" in params)
    assert ("pos_embed" in params) == fam.learned_positions
    assert ("blocks.0.attn_norm.bias" in params) == (not fam.rms_norm)
    qkv_bias, o_bias = fam.attention_bias
    assert all((f"blocks.1.attn.{p}_proj.bias" in params) == qkv_bias for p in "qkv")
    assert ("blocks.1.attn.o_proj.bias" in params) == o_bias
    assert model.uses_rope == fam.rope
    # The HF table covers every parameter exactly once.
    parts = [part for t in weight_map(cfg).tensors for part in t.parts]
    assert sorted(parts) == sorted(params)
    doc = hf_config(cfg)
    assert (doc["model_type"], doc["architectures"]) == (fam.hf_model_type, [fam.hf_architecture])
    back = hf_fields(doc)
    assert back["arch"] == arch and all(back[k] == getattr(cfg, k) for k in ("hidden_size", "num_layers"))


def test_qwen2_has_llama_traits_plus_qkv_bias():
    llama, qwen = family("llama"), family("qwen2")
    assert dataclasses.replace(qwen, name="llama", qkv_bias=False, hf_model_type="llama",
                               hf_architecture="LlamaForCausalLM") == llama
    assert qwen.attention_bias == (True, False)


def test_family_validate_hooks_name_the_key_and_the_fix():
    odd = OmegaConf.create(dataclasses.asdict(dataclasses.replace(QWEN, hidden_size=42, num_heads=6)))
    with pytest.raises(ConfigError, match="even head dim") as err:
        validate_model(odd)
    assert err.value.key == "model.hidden_size"
    validate_model(OmegaConf.create(dataclasses.asdict(QWEN)))
    gpt_gqa = dataclasses.replace(tiny("gpt2"), num_kv_heads=2)  # trains, but has no HF GPT-2 form
    validate_model(OmegaConf.create(dataclasses.asdict(gpt_gqa)))
    with pytest.raises(ConfigError, match="grouped-query attention") as err:
        weight_map(gpt_gqa)
    assert err.value.key == "model.num_kv_heads"
    with pytest.raises(ConfigError, match="gpt2|llama|qwen2") as err:
        validate_model(OmegaConf.create(dataclasses.asdict(QWEN) | {"arch": "mistral"}))
    assert err.value.key == "model.arch"


# ---- Qwen2 through Hugging Face -------------------------------------------------------------------------


def make_qwen2_dir(path: Path, seed: int = 21) -> Path:
    """A random `transformers` Qwen2 model with perturbed weights (biases included: HF starts them at 0)."""
    torch.manual_seed(seed)
    with _one_thread():
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            vocab_size=HF_VOCAB, hidden_size=48, intermediate_size=70, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=16,
            tie_word_embeddings=False, rope_theta=500.0, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
        model.save_pretrained(path)
    return path


def test_qwen2_imports_with_transformers_logits_and_exports_bit_exact(tmp_path):
    path = make_qwen2_dir(tmp_path / "hf")
    cfg = resolve_model_config(dataclasses.replace(QWEN, vocab_size=HF_VOCAB, init_from=str(path)))
    assert (cfg.arch, cfg.rope_theta, cfg.num_kv_heads) == ("qwen2", 500.0, 2)
    model = build_model(cfg)
    load_hf_into(model, path)
    bias = hf_state(path)["model.layers.1.self_attn.k_proj.bias"]
    assert float(bias.abs().max()) > 0 and torch.equal(model.blocks["1"].attn.k_proj.bias.detach(), bias)
    ids = tokens()
    with torch.no_grad():
        ours = model(ids)
    assert _rel(ours, hf_logits(path, ids)) < TOL
    export_model(model, tmp_path / "out", eos_token_id=1)
    assert_bit_exact(path, tmp_path / "out")
    mine, theirs = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "out", path))
    assert mine["architectures"] == ["Qwen2ForCausalLM"] and hf_fields(mine) == hf_fields(theirs)
    # Without the q/k/v biases the logits differ: the test above sees them.
    with torch.no_grad():
        for i in model.blocks:
            model.blocks[i].attn.q_proj.bias.zero_()
    with torch.no_grad():
        assert _rel(model(ids), hf_logits(path, ids)) > 1e-3


def test_sliding_window_qwen2_is_refused(tmp_path):
    doc = json.loads((make_qwen2_dir(tmp_path / "hf") / "config.json").read_text())
    doc |= {"use_sliding_window": True, "sliding_window": 4}
    with pytest.raises(ConfigError, match="sliding-window"):
        hf_fields(doc, "qwen")


# ---- Qwen2 trains, reshards and exports -----------------------------------------------------------------


def _batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, QWEN.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=gen)


def _setup(rank: int, layout: tuple, seed: int, lr: float = LR) -> RankState:
    """Rank `rank` in float64 as a run builds it (`assemble`: model slice, sync, AdamW)."""
    torch.set_num_threads(1)
    return assemble(ResolvedLayout.make(Topology(*layout)), rank, QWEN, {**OPTIM, "lr": lr}, None, seed=seed,
                    param_dtype=torch.float64)


def _train_step(state: RankState, step: int) -> float:
    toks = _batch(step)
    micro = [toks[i: i + 1] for i in state.my_microbatches(GLOBAL_BATCH)]
    return train_step(state, micro, toks[:, 1:].numel(), max_norm=None).loss


def save_worker(rank: int, world: int, layout: tuple, run_dir: str | None) -> dict:
    """Train STEPS_BEFORE steps, save (when `run_dir`), keep the logits of what was saved, train on."""
    state = _setup(rank, layout, SEED)
    model, opt = state.model, state.optimizer
    losses = [_train_step(state, s) for s in range(STEPS_BEFORE)]
    if run_dir is not None:
        save_checkpoint(f"{run_dir}/checkpoints/step_{STEPS_BEFORE:06d}", model, opt,
                        {"model_config": dataclasses.asdict(QWEN)}, step=STEPS_BEFORE,
                        layout=state.layout.to_dict())
    with torch.no_grad():
        logits = model(tokens(QWEN.vocab_size)).numpy().copy()
    bias = model.blocks["0"].attn.v_proj.bias.detach().abs().max().item()
    losses += [_train_step(state, s) for s in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)]
    return {"losses": losses, "logits": logits, "vocab_start": model.vocab_start, "bias": bias}


def load_worker(rank: int, world: int, layout: tuple, ckpt: str) -> list[float]:
    state = _setup(rank, layout, SEED + 1, lr=0.5)  # every value must come from the checkpoint
    load_checkpoint(ckpt, state.model, state.optimizer)
    return [_train_step(state, s) for s in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)]


def _one_process(fn, *args):
    """`fn(0, 1, *args)` in a forked child without torch.distributed: the single-process run."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        return pool.submit(fn, 0, 1, *args).result()


def _rel_losses(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_qwen2_trains_on_an_uneven_layout_reshards_and_exports(tmp_path, monkeypatch, capsys):
    single = _one_process(save_worker, (1, [1], [1] * 4), None)
    ranks = run_workers(save_worker, 3, UNEVEN, str(tmp_path / "run"))
    # (2,1) in float64 follows the single-process curve, and training moved the q/k/v biases off zero.
    assert single["bias"] > 0
    for rank, r in enumerate(ranks):
        assert _rel_losses(r["losses"], single["losses"]) < 1e-10, f"rank {rank}: {r['losses']}"
    # Saved on (2,1), loaded on TP3: the continuation's losses are the same numbers.
    ckpt = tmp_path / "run" / "checkpoints" / f"step_{STEPS_BEFORE:06d}"
    for rank, losses in enumerate(run_workers(load_worker, 3, TP3, str(ckpt))):
        assert _rel_losses(losses, ranks[0]["losses"][STEPS_BEFORE:]) < 1e-10, f"rank {rank}: {losses}"
    # The saved checkpoint through ntp-export: transformers reproduces ntp_nemo's logits.
    monkeypatch.setattr(sys, "argv", ["ntp-export", str(tmp_path / "run"), str(tmp_path / "hf")])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code == 0, capsys.readouterr().err
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
    theirs = hf_logits(tmp_path / "hf", tokens(QWEN.vocab_size)).double()
    tp2 = sorted(ranks[:2], key=lambda r: r["vocab_start"])
    ours = torch.cat([torch.from_numpy(r["logits"]) for r in tp2], dim=-1)
    assert _rel(ours, theirs) < TOL
    assert _rel(torch.from_numpy(ranks[2]["logits"]), theirs) < TOL  # the TP1 replica holds the same model


@pytest.mark.slow
def test_qwen2_recipe_dry_runs_through_the_cli(tmp_path):
    """`model=qwen2_tiny` composes, validates, plans and builds every rank (the dry run)."""
    run = subprocess.run(
        [sys.executable, "-m", "ntp_nemo.train", "model=qwen2_tiny", "trainer.dry_run=true",
         f"hydra.run.dir={tmp_path / 'r'}"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "qwen2" in run.stdout
    assert (tmp_path / "r" / "dry_run.json").is_file()
