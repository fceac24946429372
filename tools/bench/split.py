"""The shipped prompts in two fixed halves: one to tune on, one never to tune on.

Contract: `split_half(question_id)` says which half a prompt belongs to, from its id alone, so the
split never changes when prompts are added, removed or reordered, and every tool agrees on it.
Priors, thresholds and design choices come from the `tune` half only; results are reported on the
`untouched` half (`specserve bench --split untouched`). Within each Spec-Bench category the halves
are near equal (a hash of the id decides, not the file order): in the shipped 240, 119 tune and 121
untouched, 17-23 of each 40-prompt task and 2-3 of each MT-bench category.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Sequence, TypeVar

TUNE, UNTOUCHED, ALL = "tune", "untouched", "all"
SPLITS = (TUNE, UNTOUCHED, ALL)
_SALT = "specserve-split-v1"

T = TypeVar("T")


def split_half(question_id: object) -> str:
    """`tune` or `untouched` for a prompt id (stable across runs and machines).

    >>> split_half(81), split_half("81"), split_half(84)
    ('tune', 'tune', 'untouched')
    """
    digest = hashlib.sha256(f"{_SALT}:{question_id}".encode()).digest()
    return TUNE if digest[0] % 2 == 0 else UNTOUCHED


def keep(items: Iterable[T], split: str, key=lambda p: p.question_id) -> list[T]:
    """The items of one half (`all`: every item). Raises ValueError naming the allowed values.

    >>> keep([81, 84, 85], "untouched", key=lambda q: q), keep([84], "all", key=lambda q: q)
    ([84, 85], [84])
    """
    if split not in SPLITS:
        raise ValueError(f"--split: expected one of {', '.join(SPLITS)}, got {split!r}")
    items = list(items)
    return items if split == ALL else [p for p in items if split_half(key(p)) == split]


def balance(categories: Sequence[str], halves: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Per category, (tune, untouched) counts: a check that the hash halves each category."""
    out: dict[str, list[int]] = {}
    for c, h in zip(categories, halves):
        out.setdefault(c, [0, 0])[0 if h == TUNE else 1] += 1
    return {c: (t, u) for c, (t, u) in out.items()}
