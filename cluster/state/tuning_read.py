"""Reading one model's tuning cells back from Redis, validated, in three round trips: SCAN for the model's
keys (keys that are not cells are left alone), then HLEN (type and field count) with MEMORY USAGE (size),
then HGETALL of the cells that passed, each parsed by `cluster.state.tuning_cells.parse_cell`. A cell that
fails is handed to the caller (`TuningStore` ignores it, counts it and deletes it); any other error reply
(NOPERM, a replica still loading, ...) is Redis failing, not the cell, and fails the whole read.
"""

from __future__ import annotations

from typing import Any, Callable

from cluster.policy import CellKey, CellStats
from cluster.state.tuning_cells import MAX_FIELDS, MalformedCell, key_segment, parse_cell

MAX_KEY_BYTES = 16384  # MEMORY USAGE of a full legitimate cell is ~2-4 KiB
MAX_SCAN_ROUNDS = 20  # SCAN calls per refresh (COUNT 1000 each)


def read_cells(
    client: Any, prefix: str, model: str, known: dict[str, CellKey], clock: Callable[[], float],
    max_age_s: float, malformed: Callable[[str, str, str], None],
) -> tuple[dict[CellKey, CellStats], float]:
    """The valid cells of `model` read from Redis now through `client` (raises redis errors), and the
    time (`clock()`) against which they were checked for staleness (older than `max_age_s`: malformed).
    `known`: every possible key of the model -> its cell. `malformed(key, reason, kind)` gets each cell
    that fails, `kind` one of type / fields / size / value. Three round trips and ~1 ms of CPU for a few
    dozen cells."""
    pattern = f"{prefix}:{key_segment(model)}:*"
    found, cursor, rounds = set(), 0, 0
    while True:
        cursor, batch = client.scan(cursor=cursor, match=pattern, count=1000)
        found.update(k.decode(errors="replace") if isinstance(k, bytes) else k for k in batch)
        rounds += 1
        if cursor == 0 or rounds >= MAX_SCAN_ROUNDS:
            break
    candidates = sorted(k for k in found if k in known)
    pipe = client.pipeline(transaction=False)
    for key in candidates:
        pipe.hlen(key)
        pipe.memory_usage(key, samples=0)
    replies = pipe.execute(raise_on_error=False)
    present = []
    for key, n, size in zip(candidates, replies[0::2], replies[1::2]):
        _raise_unless_wrongtype(n)
        if isinstance(n, Exception):
            malformed(key, f"not a hash ({n})", "type")
        elif n > MAX_FIELDS:
            malformed(key, f"{n} fields", "fields")
        elif isinstance(size, int) and size > MAX_KEY_BYTES:
            malformed(key, f"{size} bytes", "size")
        elif n:
            present.append((known[key], key))
    pipe = client.pipeline(transaction=False)
    for _, key in present:
        pipe.hgetall(key)
    now = clock()
    cells: dict[CellKey, CellStats] = {}
    for (ck, key), fields in zip(present, pipe.execute(raise_on_error=False)):
        _raise_unless_wrongtype(fields)
        try:
            if isinstance(fields, Exception):
                raise MalformedCell(str(fields))
            cell = parse_cell(fields, now, max_age_s)
        except MalformedCell as e:
            malformed(key, str(e), "value")
            continue
        cells[ck] = cell
    return cells, now


def _raise_unless_wrongtype(reply) -> None:
    """A per-command error reply of a read pipeline: WRONGTYPE says the key is malformed; any other
    (NOPERM, a replica still loading, ...) is Redis failing, not the key, and fails the whole read."""
    if isinstance(reply, Exception) and not str(reply).startswith("WRONGTYPE"):
        raise reply
