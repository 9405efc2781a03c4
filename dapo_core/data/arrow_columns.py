"""Reading Arrow record batches for the source loaders: required columns, struct fields, chat prompts.

Pure pyarrow/numpy helpers with no notion of a source spec (``dapo_core.data.loaders`` builds ``SourceRows`` from
them). A file-level problem raises ``SchemaError`` naming the file (``where``), the column and what was expected.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dapo_core.data.schema import Column, SchemaError, column_from_arrow

BATCH_ROWS = 1 << 16  # rows per Arrow batch: memory stays ~ one batch of text + the distinct values


def require_columns(names: Sequence[str], columns: Iterable[str], where: str, expected: str) -> None:
    """Raise ``SchemaError`` naming every one of ``columns`` that ``names`` lacks, and what was ``expected``."""
    missing = [c for c in columns if c not in names]
    if missing:
        raise SchemaError(
            f"{where}: missing column(s) {missing} (has {list(names)}); expected {expected}. Set the "
            "source's problem_key / answer_key, or its format, to match the file"
        )


def struct_field(batch: pa.RecordBatch, column: str, name: str, where: str) -> pa.Array:
    """Field ``name`` of the struct column ``column`` (e.g. ``reward_model.ground_truth``), or ``SchemaError``."""
    array = batch.column(column)
    if not pa.types.is_struct(array.type) or array.type.get_field_index(name) < 0:
        raise SchemaError(f"{where}: column {column!r} has type {array.type}; expected a struct with field {name!r}")
    return pc.struct_field(array, name)


def last_user_message(prompt: pa.Array, where: str) -> tuple[Column, dict[int, str]]:
    """Per row, the content of the last message with role 'user' (verl prompts: one user message)."""
    n = len(prompt)
    kind = prompt.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_struct(kind.value_type):
        raise SchemaError(f"{where}: column 'prompt' has type {kind}; expected list<struct<role, content>> (chat)")
    if kind.value_type.get_field_index("role") < 0 or kind.value_type.get_field_index("content") < 0:
        raise SchemaError(f"{where}: 'prompt' messages have fields {kind.value_type}; expected role and content")
    messages = pc.list_flatten(prompt)  # (M,) all messages, null lists skipped
    parents = pc.list_parent_indices(prompt).to_numpy(zero_copy_only=False)  # (M,) row of each message
    is_user = pc.fill_null(pc.equal(pc.struct_field(messages, "role"), "user"), False)
    user_idx = np.flatnonzero(is_user.to_numpy(zero_copy_only=False))
    rows = parents[user_idx]
    last = np.r_[rows[1:] != rows[:-1], True] if len(rows) else np.zeros(0, dtype=bool)  # parents are ascending
    rows, user_idx = rows[last], user_idx[last]
    # Encode the contents of all messages in place (no copy of the text), then keep the users' distinct values.
    contents = column_from_arrow(pc.struct_field(messages, "content"))  # (M,) codes
    used, inverse = np.unique(contents.codes[user_idx], return_inverse=True)
    values = [contents.values[u] for u in used.tolist()] + [None]  # the last: rows without a user message
    codes = np.full(n, len(values) - 1, dtype=np.int64)
    codes[rows] = inverse
    has_user = np.zeros(n, dtype=bool)
    has_user[rows] = True
    valid = prompt.is_valid().to_numpy(zero_copy_only=False)
    unreadable = {i: "prompt is null" for i in np.flatnonzero(~valid).tolist()}
    unreadable.update({i: "prompt has no user message" for i in np.flatnonzero(valid & ~has_user).tolist()})
    null_content = [u for u, value in enumerate(values[:-1]) if value is None]
    for i in np.flatnonzero(has_user & np.isin(codes, null_content)).tolist():
        unreadable[i] = "the user message has no content"
    return Column(codes=codes, values=values), unreadable
