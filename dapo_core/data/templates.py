"""Prompt templates: how a bare problem becomes the user message, and how to find and strip one again.

A template is a format string with exactly one ``{problem}`` placeholder, so templates are config:
``data.template`` names a registered template (``dapo``, ``tiny``) or is itself such a format string.

- ``dapo``: the instruction DAPO-Math-17k and AIME-2024 were published with (the "Answer:" line that the
  ``math_dapo`` scorer reads, DAPO Sec. 3 / verl ``math_dapo``);
- ``tiny``: ``"Q: {problem}"``, compact for the CPU task (every prompt token costs a ~1M-parameter model).

Curation strips a detected template before de-duplicating (the same problem published with and without the
instruction is one problem), then applies the configured one::

    t = get_template("dapo")
    text = t.apply("What is 1+1?")
    strip_template(text)               # ("What is 1+1?", "dapo")
    get_template("Problem: {problem}")  # a literal template, named by its format
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# Counts the tokens of user messages as the policy sees them (chat template + generation prompt included).
TokenCounter = Callable[[Sequence[str]], list[int]]
CHAR_TOKENIZER = "char"  # the tiny task's character tokenizer (dapo_core.engines.tokenizer), no files needed
_SENTINEL = "@@DAPO_FLOW_PROBLEM@@"
_BATCH = 4096

PLACEHOLDER = "{problem}"

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
TINY_FORMAT = "Q: {problem}"


@dataclass(frozen=True)
class PromptTemplate:
    """``prefix + problem + suffix``; ``format`` is the same as a ``{problem}`` format string."""

    name: str
    prefix: str
    suffix: str = ""

    @classmethod
    def from_format(cls, fmt: str, name: str | None = None) -> PromptTemplate:
        """Parse ``"...{problem}..."`` (exactly one placeholder; no other braces are interpreted)."""
        if fmt.count(PLACEHOLDER) != 1:
            raise ValueError(
                f"template {fmt!r:.80} must contain {PLACEHOLDER} exactly once (found {fmt.count(PLACEHOLDER)}): "
                f"write the problem's place as {PLACEHOLDER}, e.g. 'Q: {PLACEHOLDER}', or use a registered name "
                f"({', '.join(available_templates())})"
            )
        prefix, suffix = fmt.split(PLACEHOLDER)
        return cls(name=name or fmt, prefix=prefix, suffix=suffix)

    @property
    def format(self) -> str:
        return f"{self.prefix}{PLACEHOLDER}{self.suffix}"

    def apply(self, problem: str) -> str:
        """The user message for ``problem``."""
        return f"{self.prefix}{problem}{self.suffix}"

    def extract(self, text: str) -> str | None:
        """The problem inside ``text`` when ``text`` is this template applied (whitespace at the joins is
        tolerated, the problem is returned stripped), else None. An applied template around nothing gives ""."""
        head, tail = self.prefix.strip(), self.suffix.strip()
        body = text.strip()
        if len(body) < len(head) + len(tail) or not body.startswith(head) or not body.endswith(tail):
            return None
        return body[len(head) : len(body) - len(tail)].strip()

    @property
    def detectable(self) -> bool:
        """A template with no visible text around the problem would match anything: never detected."""
        return bool(self.prefix.strip() or self.suffix.strip())


_TEMPLATES: dict[str, PromptTemplate] = {}


def register_template(template: PromptTemplate) -> PromptTemplate:
    """Add ``template`` to the registry under ``template.name`` (a name can be registered once)."""
    if template.name in _TEMPLATES and _TEMPLATES[template.name] != template:
        raise ValueError(f"template name {template.name!r} is already registered with a different text")
    _TEMPLATES[template.name] = template
    return template


def available_templates() -> list[str]:
    return sorted(_TEMPLATES)


def get_template(spec: str) -> PromptTemplate:
    """A registered template by name, or a literal ``{problem}`` format string (templates are config)."""
    if spec in _TEMPLATES:
        return _TEMPLATES[spec]
    if PLACEHOLDER in spec:
        return PromptTemplate.from_format(spec)
    raise ValueError(
        f"unknown prompt template {spec!r}: data.template must be one of {available_templates()} "
        f"or a format string containing {PLACEHOLDER} (e.g. 'Q: {PLACEHOLDER}')"
    )


def detect_template(text: str) -> PromptTemplate | None:
    """The registered template ``text`` was made with; the most specific (longest visible text) wins."""
    candidates = sorted(
        (t for t in _TEMPLATES.values() if t.detectable),
        key=lambda t: (-len(t.prefix.strip()) - len(t.suffix.strip()), t.name),
    )
    for template in candidates:
        if template.extract(text) is not None:
            return template
    return None


def strip_template(text: str) -> tuple[str, str | None]:
    """``(problem, template name)`` with a detected template removed, or ``(text.strip(), None)``."""
    template = detect_template(text)
    if template is None:
        return text.strip(), None
    problem = template.extract(text)
    assert problem is not None  # detect_template only returns templates that strip
    return problem, template.name


DAPO_TEMPLATE = register_template(PromptTemplate("dapo", DAPO_PREFIX, DAPO_SUFFIX))
TINY_TEMPLATE = register_template(PromptTemplate.from_format(TINY_FORMAT, name="tiny"))


def chat_token_counter(tokenizer: Any) -> TokenCounter:
    """A ``TokenCounter`` for a transformers tokenizer: tokens of the chat-rendered user message with the
    generation prompt (what verl compares to ``max_prompt_length``).

    The chat template is rendered once around a sentinel, so counting is one batched tokenizer call (exact for
    templates that insert the content verbatim, as Qwen's and ours do); a template that does not show the
    sentinel exactly once falls back to rendering every message.
    """
    head, tail, per_message = "", "", False
    if getattr(tokenizer, "chat_template", None):
        rendered = _render(tokenizer, _SENTINEL)
        if rendered.count(_SENTINEL) == 1:
            head, tail = rendered.split(_SENTINEL)
        else:
            per_message = True
            logger.warning("chat template transforms the message text: rendering every prompt (slower)")

    backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's Rust core: ~2.5x quicker

    def encode(texts: list[str]) -> list[int]:
        if backend is not None:
            return [len(e.ids) for e in backend.encode_batch(texts, add_special_tokens=False)]
        return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def count(texts: Sequence[str]) -> list[int]:
        out: list[int] = []
        for start in range(0, len(texts), _BATCH):
            chunk = texts[start : start + _BATCH]
            out.extend(
                encode([_render(tokenizer, t) for t in chunk] if per_message else [head + t + tail for t in chunk])
            )
        return out

    return count


def _render(tokenizer: Any, content: str) -> str:
    messages = [{"role": "user", "content": content}]
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def load_token_counter(tokenizer: str | None = None) -> TokenCounter:
    """The ``TokenCounter`` of a tokenizer spec: ``None`` / ``"char"`` -> the tiny task's character tokenizer,
    else a local directory or hub id (``dapo_core.engines.tokenizer.load_tokenizer``)."""
    from dapo_core.engines.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer, load_tokenizer

    if tokenizer in (None, CHAR_TOKENIZER):
        return chat_token_counter(build_char_tokenizer(DEFAULT_ALPHABET))
    return chat_token_counter(load_tokenizer(tokenizer))
