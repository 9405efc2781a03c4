"""Secrets never reach MLflow: params, tags and logged text files go through ``redact`` first.

What counts as a secret: the password of a URL (``https://user:PASSWORD@host``, e.g. a tracking URI with
credentials), strings shaped like well-known tokens (Hugging Face ``hf_...``, OpenAI-style ``sk-...``, GitHub
``ghp_...``/``github_pat_...``, AWS access key ids), the value of any environment variable whose name says it is a
secret (``HF_TOKEN``, ``MLFLOW_TRACKING_PASSWORD``, ``AWS_SECRET_ACCESS_KEY``...) wherever it appears, and the
whole value of a key whose name says so (``...token``, ``...password``, ``...secret``, ``...api_key``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

MASK = "***"
_URL_PASSWORD = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/@:\s]*):(?P<pw>[^/@\s]+)@")
_TOKEN_SHAPES = re.compile(
    r"\b(?:hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|ghp_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"
    r"|AKIA[0-9A-Z]{16})\b"
)
# a name part (between _ . - or the ends) that says secret: HF_TOKEN, db_password, AWS_SECRET_ACCESS_KEY, api_key;
# not max_new_tokens, tokenizer_path or TOKENIZERS_PARALLELISM
_SECRET_NAME = re.compile(
    r"(?:^|[_.-])(?:TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIALS?)(?:[_.-]|$)",
    re.IGNORECASE,
)
_MIN_SECRET_LEN = 6  # shorter env values ("1", "true") would mask ordinary text


def secret_env_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of the environment variables named like secrets, longest first."""
    env = os.environ if environ is None else environ
    values = {v for k, v in env.items() if _SECRET_NAME.search(k) and len(v.strip()) >= _MIN_SECRET_LEN}
    return sorted(values, key=len, reverse=True)


def is_secret_key(key: str) -> bool:
    """Whether a (dotted) key's last part names a secret: ``hub.token``, ``db_password``, ``openai_api_key``."""
    return bool(_SECRET_NAME.search(key.rsplit(".", 1)[-1]))


def redact(text: str, environ: Mapping[str, str] | None = None) -> str:
    """``text`` with every secret (module doc) replaced by ``***``."""
    out = _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)
    out = _TOKEN_SHAPES.sub(MASK, out)
    for value in secret_env_values(environ):
        out = out.replace(value, MASK)
    return out


def redact_items(items: Mapping[str, str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Key -> value with secret-named keys masked whole and every value redacted."""
    return {k: (MASK if is_secret_key(k) and v else redact(v, environ)) for k, v in items.items()}
