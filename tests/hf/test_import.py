"""Importing Hugging Face GPT-2 / Llama directories: logits match `transformers` on every layout.

The HF models are random (no download), with every parameter perturbed so that norms and biases
matter too, and saved with `save_pretrained`; the Llama one is split into several safetensors
files with an index.  Layouts: (1) in process, (2,1) and (3,2) on forked gloo workers, where the
GPT-2 heads (5) and the vocabulary split unevenly and the Llama KV heads (2) are replicated over 3
ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from ntp_nemo.errors import ConfigError
from ntp_nemo.hf import load_hf_into, resolve_model_config
from ntp_nemo.launch.workers import run_workers
from ntp_nemo.models import build_model
from ntp_nemo.models.model_config import ModelConfig
from ntp_nemo.runtime.runtime import RankPlace
from ntp_nemo.topology import ResolvedLayout, Topology

transformers = pytest.importorskip("transformers")

HF_VOCAB = 67
PADDED_VOCAB = 71
TOL = 1e-5


def _gpt2(tied: bool = True):
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=HF_VOCAB, n_positions=16, n_embd=40, n_layer=2, n_head=5, tie_word_embeddings=tied,
        bos_token_id=HF_VOCAB - 1, eos_token_id=HF_VOCAB - 1, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))


def _llama(tied: bool = False):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=HF_VOCAB, hidden_size=48, intermediate_size=70, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=tied, rope_theta=500.0,
        rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1))


@contextlib.contextmanager
def _one_thread():
    """Parent-side torch work before forking workers stays single-threaded."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_hf_dir(path: Path, kind: str, seed: int = 0, max_shard_size: str | None = None) -> Path:
    """Save a random HF model of `kind` (gpt2, gpt2-untied, llama, llama-tied) with perturbed weights."""
    torch.manual_seed(seed)
    with _one_thread():
        model = {"gpt2": _gpt2, "gpt2-untied": lambda: _gpt2(False), "llama": _llama,
                 "llama-tied": lambda: _llama(True)}[kind]()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(path, **kwargs)
    return path


def hf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    with _one_thread(), torch.no_grad():
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return model(ids).logits


def tokens(vocab: int = HF_VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (3, 12), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {"gpt2": make_hf_dir(root / "gpt2", "gpt2", seed=1),
            "llama": make_hf_dir(root / "llama", "llama", seed=2, max_shard_size="40KB"),
            "gpt2-untied": make_hf_dir(root / "gpt2_untied", "gpt2-untied", seed=3)}


def resolved(path: Path, vocab: int = HF_VOCAB) -> ModelConfig:
    arch = json.loads((path / "config.json").read_text())["model_type"]
    return resolve_model_config(ModelConfig(arch=arch, vocab_size=vocab, init_from=str(path)))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def import_worker(rank: int, world: int, tp: int, replica_tp: list[int], cases: list) -> list[dict]:
    out = []
    for cfg, path, ids, ref in cases:
        topo = Topology(tp, replica_tp, [tp] * (cfg.num_layers + 2))
        rt = RankPlace(ResolvedLayout.make(topo), rank)
        model = rt.build_model(cfg, seed=0, dtype=torch.float32)
        report = load_hf_into(model, path)
        with torch.no_grad():
            logits = model(ids)
        vs, n = model.vocab_start, logits.shape[-1]
        real = max(0, min(n, ref.shape[-1] - vs))
        local_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        full_bytes = sum(torch.Size(p.ntp_spec.global_shape).numel() * 4 for p in model.parameters())
        out.append({"err": _rel(logits[..., :real], ref[..., vs: vs + real]),
                    "pad_logits": float(logits[..., real:].abs().max()) if real < n else 0.0,
                    "bytes_read": report.bytes_read, "padded_rows": report.padded_rows,
                    "expected_bytes": local_bytes - report.padded_rows * cfg.hidden_size * 4,
                    "full_bytes": full_bytes, "replica_tp": replica_tp[topo.coord(rank).replica]})
    return out


def test_single_device_matches_transformers(hf_dirs):
    for kind in ("gpt2", "llama", "gpt2-untied"):
        cfg = resolved(hf_dirs[kind])
        model = build_model(cfg)
        load_hf_into(model, hf_dirs[kind])
        ids = tokens()
        with torch.no_grad():
            assert _rel(model(ids), hf_logits(hf_dirs[kind], ids)) < TOL, kind


@pytest.mark.slow
@pytest.mark.parametrize("replica_tp", [[2, 1], [3, 2]], ids=["2-1", "3-2"])
def test_sharded_layouts_match_transformers(hf_dirs, replica_tp):
    ids = tokens()
    cases = [(resolved(hf_dirs[k]), str(hf_dirs[k]), ids, hf_logits(hf_dirs[k], ids))
             for k in ("gpt2", "llama")]
    if replica_tp == [3, 2]:  # untied GPT-2 with a padded vocabulary: 71 rows split 3 and 2 ways
        path = hf_dirs["gpt2-untied"]
        cases.append((resolved(path, PADDED_VOCAB), str(path), ids, hf_logits(path, ids)))
    results = run_workers(import_worker, sum(replica_tp), max(replica_tp), replica_tp, cases)
    for rank, per_case in enumerate(results):
        for case, r in zip(("gpt2", "llama", "gpt2-untied-padded"), per_case, strict=False):
            assert r["err"] < TOL, f"{case} rank {rank}: rel error {r['err']:.2e}"
            assert r["pad_logits"] == 0.0
            # The rank read exactly its own slices, much less than the model when it shards 3 ways.
            assert r["bytes_read"] == r["expected_bytes"], (case, rank)
            if r["replica_tp"] == 3:
                assert r["bytes_read"] < 0.6 * r["full_bytes"], (case, rank)
    if replica_tp == [3, 2]:
        padded = [per_case[2]["padded_rows"] for per_case in results]
        # Each replica zeroes the padded rows of the embedding and of the head exactly once.
        assert sum(padded[:3]) == sum(padded[3:]) == 2 * (PADDED_VOCAB - HF_VOCAB)


def test_architecture_fields_come_from_config_json(hf_dirs):
    base = ModelConfig(arch="llama", vocab_size=300, hidden_size=256, num_layers=4, num_heads=8,
                       num_kv_heads=2, ffn_hidden_size=688, max_seq_len=256, init_from=str(hf_dirs["llama"]))
    cfg = resolve_model_config(base)
    shape = (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.ffn_hidden_size)
    assert shape == (48, 2, 6, 2, 70)
    assert (cfg.max_seq_len, cfg.tie_embeddings, cfg.rope_theta, cfg.norm_eps) == (16, False, 500.0, 1e-5)
    assert cfg.vocab_size == 300  # the vocabulary stays the run's (padding)
    gpt = resolve_model_config(ModelConfig(arch="gpt2", vocab_size=HF_VOCAB, init_from=str(hf_dirs["gpt2"])))
    assert (gpt.hidden_size, gpt.num_heads, gpt.num_kv_heads, gpt.ffn_hidden_size, gpt.tie_embeddings) == (
        40, 5, None, 160, True)
    scratch = dataclasses.replace(base, init_from=None)
    assert resolve_model_config(scratch) == scratch


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    doc = json.loads((src / "config.json").read_text())
    doc.update(changes)
    (dst / "config.json").write_text(json.dumps(doc))
    return dst


def _expect_error(cfg: ModelConfig, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_model_config(cfg)
    assert err.value.key == "model.init_from"
    assert fragment in str(err.value), str(err.value)


def test_unsupported_or_contradicting_directories_are_config_errors(hf_dirs, tmp_path):
    llama, gpt2 = hf_dirs["llama"], hf_dirs["gpt2"]
    cases = [
        (_edit_config(llama, tmp_path / "mistral", model_type="mistral",
                      architectures=["MistralForCausalLM"]),
         "llama", "model_type 'mistral'"),
        (_edit_config(llama, tmp_path / "scaled", rope_parameters={"rope_type": "llama3", "rope_theta": 5e5}),
         "llama", "'llama3'"),
        (_edit_config(llama, tmp_path / "bias", attention_bias=True), "llama", "attention_bias"),
        (_edit_config(gpt2, tmp_path / "act", activation_function="relu"), "gpt2", "'relu'"),
        (llama, "gpt2", "is a llama model but model.arch=gpt2. Pick a llama model config "
                        "(model=llama3_8b or model=llama_tiny)"),
        (tmp_path / "missing", "llama", "is not a directory"),
        (tmp_path, "llama", "has no config.json"),
    ]
    for path, arch, fragment in cases:
        _expect_error(ModelConfig(arch=arch, vocab_size=HF_VOCAB, init_from=str(path)), fragment)
    _expect_error(ModelConfig(arch="llama", vocab_size=HF_VOCAB - 1, init_from=str(llama)),
                  f"model.vocab_size={HF_VOCAB}")
    _expect_error(ModelConfig(arch="llama", init_from="???"), "is not set")


def test_model_choices_name_each_familys_configs():
    from ntp_nemo.hf.config_map import model_choices

    assert model_choices("qwen2") == ["qwen2_tiny"]  # a Qwen2 directory is pointed at its own family
    assert model_choices("gpt2") == ["gpt2_124m", "gpt_tiny"]


def test_load_refuses_mismatched_models_and_files(hf_dirs, tmp_path):
    path = hf_dirs["gpt2"]
    wrong = dataclasses.replace(resolved(path), hidden_size=80, num_heads=5)
    with pytest.raises(ConfigError, match="hidden_size: model 80, config.json 40"):
        load_hf_into(build_model(wrong), path)
    no_weights = _edit_config(path, tmp_path / "bin")
    (no_weights / "model.safetensors").rename(no_weights / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="pytorch_model.bin"):
        load_hf_into(build_model(resolved(no_weights)), no_weights)
    longer = _edit_config(path, tmp_path / "longer", n_positions=32)  # the file's wpe has 16 rows
    with pytest.raises(ConfigError, match="transformer.wpe.weight"):
        load_hf_into(build_model(resolved(longer)), longer)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_pipeline_stages_load_their_own_layers(hf_dirs, kind):
    from ntp_nemo.models import DecoderLM

    cfg = resolved(hf_dirs[kind])
    whole = build_model(cfg)
    load_hf_into(whole, hf_dirs[kind])
    reference = dict(whole.named_parameters())
    first = DecoderLM(cfg, layers=range(0, 1), has_embedding=True, has_head=False)
    last = DecoderLM(cfg, layers=range(1, 2), has_embedding=False, has_head=True)
    for stage in (first, last):
        report = load_hf_into(stage, hf_dirs[kind])
        assert report.parameters == len(list(stage.parameters()))
        for name, p in stage.named_parameters():
            assert torch.equal(p, reference[name]), name
    assert not any(n.startswith("blocks.1.") for n, _ in first.named_parameters())


@pytest.mark.parametrize("damage", ["header length past the file", "header not JSON", "tensor past the data"])
def test_a_crafted_safetensors_header_is_a_config_error_naming_the_file(hf_dirs, tmp_path, damage):
    """The safetensors library refuses a crafted header; the project says so, naming the file, when the
    config is checked (before any worker starts: exit 2 from the CLI), instead of a worker's traceback."""
    import struct

    from omegaconf import open_dict

    from ntp_nemo.config.validate import resolve_init_from
    from ntp_nemo.hf.safetensors_files import HFWeightsReader
    from tests.conftest import compose

    crafted = _edit_config(hf_dirs["gpt2"], tmp_path / "crafted")
    weights = crafted / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    if damage == "header length past the file":
        raw[:8] = struct.pack("<Q", len(raw) * 4)
    elif damage == "header not JSON":
        raw[8:8 + length] = b"{" * length
    else:
        header = json.loads(raw[8:8 + length])
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"][1] += 1 << 30
        text = json.dumps(header).encode()
        raw = bytearray(struct.pack("<Q", len(text))) + text + raw[8 + length:]
    weights.write_bytes(bytes(raw))
    with pytest.raises(ConfigError) as err:
        with HFWeightsReader(crafted) as reader:
            reader.check_headers()
    msg = str(err.value)
    assert err.value.key == "model.init_from" and str(weights) in msg and "safetensors" in msg, msg
    assert "\n" not in msg and "save_pretrained" in msg
    cfg = compose(["model=gpt_tiny"])
    with open_dict(cfg):
        cfg.model.init_from = str(crafted)
    with pytest.raises(ConfigError, match="refuses it"):
        resolve_init_from(cfg)


def test_resolve_takes_the_architecture_from_init_from_and_validate_only_checks(hf_dirs):
    """`resolve_init_from` returns the architecture of `model.init_from`'s config.json, `resolve` runs on it,
    and neither it nor `validate` writes into the composed config."""
    from omegaconf import OmegaConf

    from ntp_nemo.config.resolve import resolve, with_values
    from ntp_nemo.config.validate import resolve_init_from, validate
    from tests.conftest import SINGLE, compose

    cfg = compose([*SINGLE, "model=llama_tiny", f"model.init_from={hf_dirs['llama']}", "data.seq_len=8"])
    before = OmegaConf.to_yaml(cfg)
    derived = resolve_init_from(cfg)
    want = resolved(hf_dirs["llama"], vocab=int(cfg.model.vocab_size))
    assert derived["model.arch"] == "llama" and derived["model.hidden_size"] == want.hidden_size
    assert want.hidden_size != cfg.model.hidden_size  # the HF model's own, not the composed one
    validate(with_values(cfg, derived))
    spec = resolve(cfg, {"mesh.dp", "mesh.tp", "ntp.replica_tp"})
    assert (spec.model.arch, spec.model.hidden_size, spec.model.num_layers) == (
        "llama", want.hidden_size, want.num_layers)
    assert OmegaConf.to_yaml(cfg) == before  # the composed config is left as composed
