"""Tokenizer and model building/loading: determinism, the qwen2 tokenizer trap, HF directories, clear errors."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from dapo_core.engines.models import (
    DTYPES,
    ModelNotFoundError,
    build_tiny_qwen2,
    load_model,
    resolve_device,
    save_hf_dir,
)
from dapo_core.engines.tokenizer import (
    CHAR_TOKENIZER_MARKER,
    DEFAULT_ALPHABET,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    build_char_tokenizer,
    load_tokenizer,
)

TINY = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
TASK_TEXTS = [
    "Q: 71-57*6\n",
    "57*6=342\n71-342=-271\nAnswer: -271",
    "Solve the following problem.  Two spaces, then\n\nnew lines: (3+4)/7 = 1?",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A saved tiny qwen2 model + char tokenizer: the directory where AutoTokenizer falls into the trap."""
    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    model = build_tiny_qwen2(tok, **TINY)
    path = tmp_path_factory.mktemp("hf") / "base_model"
    save_hf_dir(model, tok, path)
    return str(path)


@pytest.fixture(scope="module")
def loaded_tokenizer(model_dir: str) -> PreTrainedTokenizerBase:
    return load_tokenizer(model_dir)


# ---------------------------------------------------------------------------------------------- tokenizer


def test_char_tokenizer_json_is_byte_identical_for_the_same_alphabet(tmp_path) -> None:
    shuffled = list(DEFAULT_ALPHABET * 2)  # duplicated and reordered: same set of characters
    random.Random(0).shuffle(shuffled)
    build_char_tokenizer(DEFAULT_ALPHABET).save_pretrained(tmp_path / "a")
    build_char_tokenizer("".join(shuffled)).save_pretrained(tmp_path / "b")
    a = (tmp_path / "a" / "tokenizer.json").read_bytes()
    assert a == (tmp_path / "b" / "tokenizer.json").read_bytes()
    build_char_tokenizer(DEFAULT_ALPHABET + "$").save_pretrained(tmp_path / "c")
    assert a != (tmp_path / "c" / "tokenizer.json").read_bytes()


def test_char_tokenizer_ids_and_special_tokens() -> None:
    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    assert len(tok) == len(SPECIAL_TOKENS) + len(set(DEFAULT_ALPHABET))
    assert (tok.pad_token, tok.pad_token_id) == (PAD_TOKEN, 0)
    assert (tok.eos_token, tok.eos_token_id) == (EOS_TOKEN, 1)
    assert tok.padding_side == "left"
    assert tok.encode("Q: 1") == [tok.convert_tokens_to_ids(c) for c in "Q: 1"]  # one token per character
    assert tok.encode("<|im_start|>1<|im_end|>") == [2, tok.convert_tokens_to_ids("1"), 3]
    assert tok.encode("$") == [tok.unk_token_id]


def test_default_alphabet_covers_the_task_and_answer_line() -> None:
    for ch in "0123456789+-*/=() \n.,:?QASolve":
        assert ch in DEFAULT_ALPHABET
    assert len(set(DEFAULT_ALPHABET)) == len(DEFAULT_ALPHABET)


@pytest.mark.parametrize("text", TASK_TEXTS)
def test_round_trip_after_save_and_load_keeps_spaces_and_newlines(loaded_tokenizer, text: str) -> None:
    assert loaded_tokenizer.decode(loaded_tokenizer.encode(text)) == text
    assert loaded_tokenizer.padding_side == "left"
    assert loaded_tokenizer.pad_token_id == 0


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=DEFAULT_ALPHABET, max_size=60))
def test_round_trip_property(loaded_tokenizer, text: str) -> None:
    ids = loaded_tokenizer.encode(text)
    assert len(ids) == len(text)
    assert loaded_tokenizer.decode(ids) == text


def test_load_tokenizer_avoids_the_autotokenizer_qwen2_trap(model_dir: str, loaded_tokenizer) -> None:
    text = TASK_TEXTS[0]
    auto = AutoTokenizer.from_pretrained(model_dir)
    if auto.decode(auto.encode(text)) == text:  # pragma: no cover - depends on the transformers version
        pytest.skip("this transformers version no longer has the qwen2 tokenizer trap")
    assert type(loaded_tokenizer).__name__ != "Qwen2Tokenizer"
    assert loaded_tokenizer.decode(loaded_tokenizer.encode(text)) == text


def test_load_tokenizer_without_marker_uses_autotokenizer_and_sets_pad(tmp_path) -> None:
    build_char_tokenizer(DEFAULT_ALPHABET).save_pretrained(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    del config[CHAR_TOKENIZER_MARKER], config["pad_token"]
    config["padding_side"] = "right"
    config_file.write_text(json.dumps(config))
    tok = load_tokenizer(str(tmp_path))  # no qwen2 config here, so AutoTokenizer is safe
    assert tok.padding_side == "left"
    assert tok.pad_token == EOS_TOKEN  # missing pad falls back to EOS
    assert tok.decode(tok.encode(TASK_TEXTS[1])) == TASK_TEXTS[1]


def test_chat_template_renders_user_then_assistant_turn(loaded_tokenizer) -> None:
    tok = loaded_tokenizer
    user = [{"role": "user", "content": "Q: 1+2"}]
    assert tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True) == "Q: 1+2<|im_end|><|im_start|>"
    assert tok.apply_chat_template(user, tokenize=False) == "Q: 1+2<|im_end|>"
    turn = [*user, {"role": "assistant", "content": "1+2=3\nAnswer: 3"}]
    rendered = tok.apply_chat_template(turn, tokenize=False)
    assert rendered == "Q: 1+2<|im_end|><|im_start|>1+2=3\nAnswer: 3<|endoftext|>"
    ids = tok.encode(rendered)
    assert ids[-1] == tok.eos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "Q: 1+21+2=3\nAnswer: 3"


def test_custom_chat_template_is_kept(tmp_path) -> None:
    build_char_tokenizer("ab", chat_template="{{ messages[0]['content'] }}!").save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert tok.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False) == "ab!"


def test_empty_alphabet_is_rejected() -> None:
    with pytest.raises(ValueError, match="alphabet is empty"):
        build_char_tokenizer("")


# ---------------------------------------------------------------------------------------------- models


def test_tiny_qwen2_defaults_have_about_one_million_parameters() -> None:
    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    model = build_tiny_qwen2(tok)
    n_params = sum(p.numel() for p in model.parameters())
    assert 0.9e6 < n_params < 1.1e6
    assert model.config.vocab_size == len(tok)
    assert model.config.model_type == "qwen2"
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    for cfg in (model.config, model.generation_config):
        assert (cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id) == (0, 1, 1)


def test_tiny_qwen2_init_is_deterministic_and_leaves_global_rng_alone() -> None:
    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a = build_tiny_qwen2(tok, seed=7, **TINY)
    assert torch.equal(torch.rand(3), before)  # global stream unaffected by the build
    b = build_tiny_qwen2(tok, seed=7, **TINY)
    c = build_tiny_qwen2(tok, seed=8, **TINY)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_tiny_qwen2_rejects_bad_head_counts() -> None:
    tok = build_char_tokenizer("ab")
    with pytest.raises(ValueError, match="divisible by num_attention_heads"):
        build_tiny_qwen2(tok, hidden_size=30, num_attention_heads=4)
    with pytest.raises(ValueError, match="divisible by num_key_value_heads"):
        build_tiny_qwen2(tok, num_attention_heads=4, num_key_value_heads=3)


def test_save_hf_dir_then_load_model_gives_the_same_model(tmp_path) -> None:
    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    model = build_tiny_qwen2(tok, seed=1, **TINY)
    path = tmp_path / "m"
    save_hf_dir(build_tiny_qwen2(tok, seed=2, **TINY), tok, path)  # an existing directory gets replaced
    save_hf_dir(model, tok, path)
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= set(os.listdir(path))
    assert os.listdir(tmp_path) == ["m"]  # no temp or backup directory left behind
    loaded = load_model(str(path))
    assert not loaded.training
    ids = torch.tensor([tok.encode(TASK_TEXTS[1])])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-6)
    assert load_model(str(path), dtype="bfloat16").dtype == torch.bfloat16
    assert loaded.generation_config.eos_token_id == tok.eos_token_id


def test_load_model_missing_local_dir_names_model_and_fix(tmp_path) -> None:
    missing = str(tmp_path / "outputs" / "base_model")
    with pytest.raises(ModelNotFoundError) as info:
        load_model(missing)
    assert isinstance(info.value, FileNotFoundError)
    message = str(info.value)
    assert missing in message
    assert "Offline mode is" in message
    assert "model.path" in message and "base_model" in message


def test_load_model_dir_without_config(tmp_path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"no config\.json"):
        load_model(str(tmp_path))


def test_load_model_offline_uncached_hub_id(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match=r"dapo-flow-test/no-such-model.*Offline mode is on"):
        load_model("dapo-flow-test/no-such-model")


def test_load_model_rejects_unknown_dtype(model_dir: str) -> None:
    with pytest.raises(ValueError, match=r"unknown dtype 'fp8'.*valid names") as info:
        load_model(model_dir, dtype="fp8")
    for name in DTYPES:
        assert name in str(info.value)


def test_resolve_device() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("tpu-ish")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")
