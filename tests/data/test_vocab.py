"""The run's tokenizer and the model's vocabulary, decided before launch from the composed config."""

from __future__ import annotations

import json

import pytest

from ntp_nemo.config.data_keys import explicit_keys, resolve_data_config
from ntp_nemo.config.resolve import with_values
from ntp_nemo.data.tokenizer import build_tokenizer
from ntp_nemo.data.vocabulary import padded_vocab
from ntp_nemo.errors import ConfigError
from tests.conftest import compose
from tests.data_helpers import make_tokenizer_json, run_preprocess, write_jsonl

VOCAB = 320  # the test tokenizer's size


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok") / "tok"
    make_tokenizer_json(directory, VOCAB)
    return directory


@pytest.fixture(scope="module")
def token_file(tmp_path_factory, tok_dir):
    from tests.data_helpers import corpus_documents

    work = tmp_path_factory.mktemp("data")
    write_jsonl(work / "a.jsonl", corpus_documents(30_000))
    res = run_preprocess("a.jsonl", "--out", "t.bin", "--tokenizer", str(tok_dir), cwd=work)
    assert res.returncode == 0, res.stderr
    return work / "t.bin"


def test_padding_rule():
    assert padded_vocab(257, 1, 2) == 257  # uneven shards are fine: one row per rank is all TP needs
    assert padded_vocab(50257, 128, 4) == 50304  # GPT-2's vocabulary on a GPU recipe
    assert padded_vocab(128256, 128, 8) == 128256
    assert padded_vocab(3, 1, 4) == 4  # at least one vocabulary row per rank of the widest replica
    assert explicit_keys(["model.vocab_size=99", "+data.x=1", "mesh.tp=2"]) == {"model.vocab_size", "data.x",
                                                                               "mesh.tp"}


def test_vocabulary_follows_the_tokenizer(tok_dir, token_file):
    cfg = compose(["recipe=gpt_tiny"])
    chosen = resolve_data_config(cfg)
    assert chosen["vocab_size"] == 257 and chosen["tokenizer"] == "byte"  # the default
    cfg = compose(["recipe=gpt_tiny", f"data.path={token_file}"])  # no tokenizer: the file's own
    assert resolve_data_config(cfg)["vocab_size"] == VOCAB
    cfg = compose(["recipe=gpt_tiny", f"data.path={token_file}", f"data.tokenizer={tok_dir}/tokenizer.json",
                   "data.vocab_multiple=128"])
    assert resolve_data_config(cfg)["vocab_size"] == 384
    assert cfg.model.vocab_size == 257  # the composed config is not changed


def test_explicit_vocab_size_is_kept_or_refused(tok_dir, token_file):
    cfg = compose(["recipe=gpt_tiny", f"data.path={token_file}", "model.vocab_size=400"])
    assert resolve_data_config(cfg, {"model.vocab_size"})["vocab_size"] == 400  # larger: padding, kept
    cfg = compose(["recipe=gpt_tiny", f"data.path={token_file}", "model.vocab_size=257"])
    with pytest.raises(ConfigError) as err:
        resolve_data_config(cfg, {"model.vocab_size"})
    assert err.value.key == "model.vocab_size" and str(VOCAB) in str(err.value)


def test_init_from_directory_supplies_the_tokenizer(tmp_path, tok_dir):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": VOCAB + 8}))
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    cfg = compose(["recipe=llama_tiny_from_hf", f"model.init_from={hf}"])
    chosen = resolve_data_config(cfg)
    assert chosen["tokenizer_from"] == "model.init_from" and chosen["tokenizer"] == str(hf.resolve())
    assert chosen["vocab_size"] == VOCAB + 8  # at least the HF model's own embedding
    tok = build_tokenizer(str(hf))
    assert tok.vocab_size == VOCAB and tok.eos_id == tok._backend.token_to_id("<|endoftext|>")


@pytest.mark.parametrize("recipe", ["gpt2_124m", "llama3_8b"])
def test_cluster_recipes_take_a_token_file_and_a_tokenizer(recipe, tok_dir, token_file):
    from ntp_nemo.config.validate import validate

    # A 320-id tokenizer is far smaller than the recipes' vocabularies: 128-row shard blocks would leave
    # ranks of a TP group empty (a config error of its own), so this checks the data path at block 1.
    cfg = compose([f"recipe={recipe}", f"data.path={token_file}", f"data.tokenizer={tok_dir}",
                   "ntp.shard_align=1"])
    chosen = resolve_data_config(cfg)
    assert chosen["vocab_size"] == 384  # 320 ids padded to a multiple of 128
    validate(with_values(cfg, {"data.tokenizer": chosen["tokenizer"], "model.vocab_size": 384}))


def test_token_file_from_another_tokenizer_is_refused(tmp_path, tok_dir, token_file):
    from ntp_nemo.data.prepare import build_data

    other = tmp_path / "other"  # same name and size, other merges: another hash
    make_tokenizer_json(other, VOCAB - 10)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_bytes((other / "tokenizer.json").read_bytes())
    for spec in ("byte", str(tmp_path / "tok")):
        with pytest.raises(ConfigError) as err:
            build_data(str(token_file), spec, 16, 4, 0, model_vocab_size=VOCAB)
        assert err.value.key == "data.tokenizer" and "hf:tok" in str(err.value), str(err.value)
    assert build_data(str(token_file), str(tok_dir), 16, 4, 0, model_vocab_size=VOCAB).vocab_size == VOCAB
