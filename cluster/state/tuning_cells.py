"""The tuning cell's schema: the hash fields one finished request adds (`increments_from_stats`) and the
validation that turns a hash read back from Redis into a `cluster.policy.CellStats` (`parse_cell`)."""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Optional
from urllib.parse import quote

from cluster.policy import MAX_K, CellStats
from cluster.speculation import RUN_CAP, SpecMode, SpecStats

INT_FIELDS = ("requests", "steps", "drafted", "accepted", "rejected_steps", "k_steps", "kk_steps", "tokens")
_ACC_NAMES = tuple(f"a{i}" for i in range(MAX_K))  # accepted at position i
_EXP_NAMES = tuple(f"e{i}" for i in range(MAX_K))  # drafted (exposed) at position i
_RUN_NAMES = tuple(f"r{i}" for i in range(RUN_CAP + 1))  # accepted runs of i tokens
_STEPS_AT_K = tuple(f"s{k}" for k in range(MAX_K + 1))  # steps of the requests that ran at K
_DECODE_AT_K = tuple(f"t{k}" for k in range(MAX_K + 1))  # ... and their decode seconds
FLOAT_FIELDS = ("decode_s", "k_decode_s") + _DECODE_AT_K  # HINCRBYFLOAT; the rest HINCRBY
POSITION_FIELDS = _ACC_NAMES + _EXP_NAMES + _RUN_NAMES + _STEPS_AT_K
META_FIELDS = ("updated",)
KNOWN_FIELDS = frozenset(INT_FIELDS + FLOAT_FIELDS + POSITION_FIELDS + META_FIELDS)
MAX_FIELDS = len(KNOWN_FIELDS)
MAX_VALUE_BYTES = 32
MAX_COUNT = 10**13  # no legitimate counter gets near this
MAX_DECODE_S = 1e10
MODES = tuple(m.value for m in SpecMode)


class MalformedCell(ValueError):
    """A tuning hash that failed validation; the message says why."""


def key_segment(s: str) -> str:
    """One segment of a cell's key, percent-quoted so it holds no stray ':'."""
    return quote(str(s), safe="-._~@+/")


def cell_key(prefix: str, model: str, mode: str, workload_class: str, bucket: str) -> str:
    """`{prefix}:{model}:{mode}:{class}:{bucket}`; segments are percent-quoted (no stray ':')."""
    return ":".join([prefix, key_segment(model), key_segment(mode), key_segment(workload_class), key_segment(bucket)])


def increments_from_stats(
    stats: SpecStats, latency_s: float, ttft_s: Optional[float] = None, output_tokens: Optional[int] = None,
) -> dict[str, float]:
    """Hash increments for one finished request (ValueError on impossible stats).

    α trials: every step is a trial of draft position 0 (a step with nothing drafted counts as a
    rejection: it bought nothing), and position i >= 1 is tried in the steps where it was drafted
    and position i-1 accepted, estimated as min(drafted_per_position[i], accepted_per_position[i-1])
    (exact when all K are drafted). rejected_steps = trials - accepted. Without drafted_per_position
    all K positions count as drafted. Exposure of position i (`e{i}`) is drafted_per_position[i]
    (else the request's steps when K > i). `r{L}` counts the request's accepted runs of L tokens
    (`SpecStats.run_lengths`), dropped when they claim more runs than steps. decode_s =
    latency_s - ttft_s; `s{K}` / `t{K}` add the request's steps and decode_s at its K (the step time
    per K of `cluster.policy.measured_overheads`)."""
    k, steps, drafted, accepted = int(stats.k), int(stats.steps), int(stats.drafted), int(stats.accepted)
    if not 0 <= k <= MAX_K:
        raise ValueError(f"k={k} outside 0..{MAX_K}")
    if min(steps, drafted, accepted) < 0 or accepted > drafted:
        raise ValueError(f"inconsistent stats (steps={steps}, drafted={drafted}, accepted={accepted})")
    if not (isinstance(latency_s, (int, float)) and math.isfinite(latency_s) and latency_s >= 0):
        raise ValueError(f"latency_s={latency_s!r}")
    decode_s = float(latency_s)
    if ttft_s is not None and math.isfinite(ttft_s) and ttft_s >= 0:
        decode_s = max(decode_s - ttft_s, 0.0)
    n = min(k, MAX_K)
    dr_list = [int(x) for x in getattr(stats, "drafted_per_position", [])][:n]
    exposed = [min(max(x, 0), steps) for x in dr_list] if dr_list else [steps] * n
    exposed += [0] * (n - len(exposed))
    acc = [min(max(int(x), 0), e) for x, e in zip(list(stats.accepted_per_position)[:n] + [0] * n, exposed)]
    trials = (steps + sum(min(exposed[i], acc[i - 1]) for i in range(1, n))) if n else 0
    inc: dict[str, float] = {  # (kk_steps and k_decode_s: sums for the regression of step time on K)
        "requests": 1, "steps": steps, "drafted": drafted, "accepted": accepted,
        "rejected_steps": min(max(trials - accepted, 0), steps), "k_steps": k * steps, "kk_steps": k * k * steps,
        "tokens": int(output_tokens) if output_tokens is not None else steps + accepted + 1,
        "decode_s": decode_s, "k_decode_s": k * decode_s, f"s{k}": steps, f"t{k}": decode_s,
    }
    for i in range(n):
        if exposed[i]:
            inc[f"e{i}"] = exposed[i]
        if acc[i]:
            inc[f"a{i}"] = acc[i]
    runs = [max(int(x), 0) for x in getattr(stats, "run_lengths", [])][:RUN_CAP + 1]
    if n and sum(runs) <= steps:  # every run takes a step at least; else the report is not trusted
        for i, r in enumerate(runs):
            if r:
                inc[f"r{i}"] = r
    return inc


def add_increments(into: dict[str, float], inc: Mapping[str, float]) -> dict[str, float]:
    """Sum one request's increments into `into` (what HINCRBY / HINCRBYFLOAT do in Redis)."""
    for f, v in inc.items():
        into[f] = into.get(f, 0) + v
    return into


def cell_from_requests(requests: Iterable[tuple[SpecStats, float]]) -> CellStats:
    """Finished requests, (stats, latency_s) pairs, summed into one cell as the store sums them in
    Redis (increments, then the hash's validation): for tools and tests that have no Redis."""
    total: dict[str, float] = {}
    for stats, latency_s in requests:
        add_increments(total, increments_from_stats(stats, latency_s))
    fields = {f: repr(float(v)) if f in FLOAT_FIELDS else str(int(v)) for f, v in total.items()}
    return parse_cell(fields, now_unix_s=0.0, max_age_s=math.inf)


def _number(name: str, raw, kind) -> float:
    s = raw.decode() if isinstance(raw, bytes) else str(raw)
    if len(s) > MAX_VALUE_BYTES:
        raise MalformedCell(f"{name}: value of {len(s)} bytes")
    try:
        v = kind(s)
    except ValueError:
        raise MalformedCell(f"{name}: not a{'n integer' if kind is int else ' number'}: {s[:20]!r}") from None
    if not math.isfinite(v):
        raise MalformedCell(f"{name}: not finite")
    return v


def parse_cell(fields: Mapping, now_unix_s: float, max_age_s: float) -> CellStats:
    """Validate one hash (HGETALL result) into CellStats; raise MalformedCell."""
    if len(fields) > MAX_FIELDS:
        raise MalformedCell(f"{len(fields)} fields")
    vals: dict[str, float] = {}
    for raw_name, raw in fields.items():
        name = raw_name.decode(errors="replace") if isinstance(raw_name, bytes) else str(raw_name)
        if name not in KNOWN_FIELDS:
            raise MalformedCell(f"unknown field {name[:40]!r}")
        v = _number(name, raw, float if name in FLOAT_FIELDS + ("updated",) else int)
        if not 0 <= v <= (MAX_DECODE_S if name in FLOAT_FIELDS else MAX_COUNT if name != "updated" else 1e11):
            raise MalformedCell(f"{name}={v} out of range")
        vals[name] = v
    g = lambda n: int(vals.get(n, 0))  # noqa: E731
    steps = g("steps")
    if (g("accepted") > g("drafted") or g("rejected_steps") > steps or g("k_steps") > MAX_K * steps
            or g("kk_steps") > MAX_K * MAX_K * steps
            or float(vals.get("k_decode_s", 0.0)) > MAX_K * float(vals.get("decode_s", 0.0)) + 1e-6):
        raise MalformedCell("inconsistent counts (accepted > drafted, rejected > steps or K > max)")
    acc = [int(vals.get(n, 0)) for n in _ACC_NAMES]
    exp = [int(vals.get(n, 0)) for n in _EXP_NAMES]
    if any(a > e or e > steps for a, e in zip(acc, exp)):
        raise MalformedCell("per-position counts exceed exposure or steps")
    runs = [int(vals.get(n, 0)) for n in _RUN_NAMES]
    if sum(runs) > steps:
        raise MalformedCell("more accepted runs than steps")
    at_k = [int(vals.get(n, 0)) for n in _STEPS_AT_K]
    t_at_k = [float(vals.get(n, 0.0)) for n in _DECODE_AT_K]
    if sum(at_k) > steps or sum(t_at_k) > float(vals.get("decode_s", 0.0)) * (1 + 1e-9) + 1e-6:
        raise MalformedCell("steps or decode time at K exceed the cell's")
    updated = float(vals.get("updated", 0.0))
    if updated > now_unix_s + 3600:
        raise MalformedCell(f"updated {updated:.0f} is in the future")
    if updated and now_unix_s - updated > max_age_s:
        raise MalformedCell(f"stale: updated {now_unix_s - updated:.0f} s ago")
    n = max((i + 1 for i in range(MAX_K) if exp[i] or acc[i]), default=0)
    width = max((k + 1 for k in range(MAX_K + 1) if at_k[k] or t_at_k[k]), default=0)
    return CellStats(
        requests=g("requests"), steps=steps, drafted=g("drafted"), accepted=g("accepted"),
        rejected_steps=g("rejected_steps"), k_steps=g("k_steps"), kk_steps=g("kk_steps"), tokens=g("tokens"),
        k_decode_s=float(vals.get("k_decode_s", 0.0)),
        decode_s=float(vals.get("decode_s", 0.0)), accepted_at=tuple(acc[:n]), exposed_at=tuple(exp[:n]),
        runs=tuple(runs[:max((i + 1 for i, r in enumerate(runs) if r), default=0)]), updated_unix_s=updated,
        steps_at_k=tuple(at_k[:width]), decode_s_at_k=tuple(t_at_k[:width]),
    )
