"""Seeds derived from the root seed and a position, so every executor draws the same samples.

docs/design.md, "Seeds": every sample's seed derives from (trainer.seed, step, generation batch, shard). A hash (not
``seed + step``) keeps neighbouring positions from sharing streams.
"""

from __future__ import annotations

import hashlib


def derive_seed(root: int, *parts: int | str) -> int:
    """A 63-bit seed from ``root`` and any number of position parts (step, gen batch, shard, ...)."""
    text = ":".join(str(p) for p in (root, *parts))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & ((1 << 63) - 1)
