"""Tokenizers: the deterministic character-level tokenizer of the tiny CPU task, and a trap-free loader.

The tiny task (synthetic arithmetic, DAPO "Answer:" line) needs no sub-word vocabulary: one token per character
keeps the vocabulary at ~80 entries, so a ~1M-parameter model spends its parameters on the task, not on embeddings.

Two transformers 5 facts shape this module (both measured with transformers 5.24):

- a character-level BPE tokenizer needs ``decoders.Fuse()``, otherwise ``decode`` joins tokens with spaces;
- for a model whose config says ``qwen2``, ``AutoTokenizer`` forces ``Qwen2Tokenizer``, which silently drops the
  spaces and newlines of a custom tokenizer (``"Q: 1+2\\n"`` -> ``"Q:1+2"``). ``load_tokenizer`` recognises our
  tokenizer by a marker key in ``tokenizer_config.json`` and loads it with ``PreTrainedTokenizerFast`` instead.

Build, save and reload::

    tok = build_char_tokenizer(DEFAULT_ALPHABET)
    tok.save_pretrained("outputs/base_model")
    tok = load_tokenizer("outputs/base_model")
    assert tok.decode(tok.encode("Q: 1+2\\n")) == "Q: 1+2\\n"
"""

from __future__ import annotations

import json
import logging
import os
import string

from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
UNK_TOKEN = "<|unk|>"
# Special tokens take the first ids, in this order (pad = 0, eos = 1, ...); characters follow, sorted.
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, UNK_TOKEN)

# Marker written into tokenizer_config.json so that load_tokenizer can avoid the AutoTokenizer/qwen2 trap.
CHAR_TOKENIZER_MARKER = "dapo_flow_char_tokenizer"

# Everything the synthetic arithmetic task and the DAPO answer line need: digits, operators, brackets,
# punctuation, space, newline and the ASCII letters ("Q:", "Solve", "Answer:").
DEFAULT_ALPHABET: str = string.digits + "+-*/=()" + " \n" + ".,:?" + string.ascii_letters

# Compact chat template for the tiny task (no role names: every prompt token costs model capacity).
# A user/system turn is its content closed by <|im_end|>; the assistant turn opens with <|im_start|> and closes
# with <|endoftext|>, the EOS that generation stops on. Rendered with add_generation_prompt=True:
#   [{"role": "user", "content": "Q: 1+2"}]  ->  "Q: 1+2<|im_end|><|im_start|>"
DEFAULT_CHAT_TEMPLATE: str = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "<|im_start|>{{ message['content'] }}<|endoftext|>"
    "{%- else -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>{%- endif -%}"
)


def _char_vocab(alphabet: str) -> dict[str, int]:
    """Specials first, then the sorted, de-duplicated characters of ``alphabet``."""
    if not alphabet:
        raise ValueError("alphabet is empty: it must contain the characters to tokenize, e.g. DEFAULT_ALPHABET")
    chars = sorted(set(alphabet))
    clashes = [c for c in chars if c in SPECIAL_TOKENS]
    if clashes:  # only possible for a 1-char special, kept for safety
        raise ValueError(f"alphabet characters {clashes} collide with special tokens {SPECIAL_TOKENS}")
    tokens = list(SPECIAL_TOKENS) + chars
    return {tok: i for i, tok in enumerate(tokens)}


def build_char_tokenizer(alphabet: str, *, chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """Build a deterministic character-level tokenizer: one token per distinct character of ``alphabet``.

    Same alphabet (as a set) -> byte-identical ``tokenizer.json``. Ids: ``<|pad|>`` 0, ``<|endoftext|>`` 1 (EOS),
    ``<|im_start|>`` 2, ``<|im_end|>`` 3, ``<|unk|>`` 4 (any character outside the alphabet), then the sorted
    characters. Padding is on the left (batched generation). ``chat_template`` defaults to
    ``DEFAULT_CHAT_TEMPLATE``.
    """
    vocab = _char_vocab(alphabet)
    # A BPE model with no merges is exactly "one token per character"; no pre-tokenizer, so spaces and
    # newlines are ordinary tokens.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    backend.decoder = decoders.Fuse()  # concatenate tokens on decode (the default joins them with spaces)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        chat_template=chat_template if chat_template is not None else DEFAULT_CHAT_TEMPLATE,
        **{CHAR_TOKENIZER_MARKER: True},
    )
    return tokenizer


def _is_char_tokenizer_dir(path: str) -> bool:
    """True when ``path`` is a local directory holding a tokenizer written by ``build_char_tokenizer``."""
    config_file = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(config_file):
        return False
    with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    return bool(config.get(CHAR_TOKENIZER_MARKER, False))


def load_tokenizer(
    path: str, *, revision: str | None = None, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a local directory or a hub id, with left padding and a pad token.

    Our character tokenizer (marker key in ``tokenizer_config.json``) is loaded with
    ``PreTrainedTokenizerFast`` because ``AutoTokenizer`` would swap in ``Qwen2Tokenizer`` next to a qwen2 model
    config and drop spaces/newlines. Anything else goes through ``AutoTokenizer``. A missing pad token falls back
    to EOS (as verl does for Qwen base models).
    """
    if _is_char_tokenizer_dir(path):
        logger.debug("loading character tokenizer from %s with PreTrainedTokenizerFast", path)
        tokenizer: PreTrainedTokenizerBase = PreTrainedTokenizerFast.from_pretrained(path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"tokenizer {path!r} has neither a pad token nor an EOS token; batched generation needs one: "
                "set tokenizer.pad_token before use or pick a tokenizer that defines EOS"
            )
        logger.info("tokenizer %s has no pad token; using EOS %r for padding", path, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
