"""Engine stalls in a one-stream comparison: gaps in a streamed answer far longer than its steps.

On this machine, stock vLLM servers started in a session of their own paused for about 1.05 s in
the middle of an answer whenever an idle engine of the cluster ran its health probe and busy-polled
after it on the same core (the kernel schedules each session as one group; every chunk after the
gap carried its usual one or two tokens: the engine paused, not the client).
`tools.bench.anchors.StockServer` now starts them in the bench's session. Such a pause was 4-8% of
a stock server's summed latency in a run and decided a ratio of a few percent, so the report states
the stalls per configuration, and the ratio with every configuration's stall time taken out beside
the measured one, whatever their cause.

A *stall* is an inter-chunk gap longer than `STALL_GAP_S`; the time it cost is the gap minus the
request's median gap (the step it would have taken). Only gaps between chunks count, not the time
to the first token (a long prompt's prefill is not a stall). One stream only: under load a streamed
answer's gaps also hold other requests' prefills and the cluster's chunked streaming
(`stream_chunks_per_step`), so a long gap there is no sign of a stall. Pure: samples in, numbers out.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tools.bench.metrics import Sample, group_by
from cluster.percentile import percentile

STALL_GAP_S = 0.8  # a step on these CPUs takes 25-70 ms at one stream; a stall about 1.05 s


def _gaps(sample: Sample) -> list[float]:
    t = sample.chunk_times_s or []
    return [b - a for a, b in zip(t, t[1:])]


def stall_s(sample: Sample, gap_s: float = STALL_GAP_S) -> float:
    """Seconds the request lost to stalls: each inter-chunk gap above `gap_s`, less the median gap.

    >>> s = Sample("compare", "x", "p", "c", "t", 0.0, 1, latency_s=2.0, chunk_times_s=[0.1, 0.13, 0.16, 1.2, 1.23])
    >>> round(stall_s(s), 3)   # the 1.04 s gap, less the usual 0.03
    1.01
    >>> stall_s(Sample("compare", "x", "p", "c", "t", 0.0, 1, latency_s=2.0, chunk_times_s=[1.5, 1.53]))
    0.0
    """
    gaps = _gaps(sample)
    if not gaps:
        return 0.0
    usual = percentile(gaps, 50)
    return sum((g - usual for g in gaps if g > gap_s), 0.0)


def without_stalls(sample: Sample, gap_s: float = STALL_GAP_S) -> Sample:
    """The sample with its stall time taken out of its latency (the same sample when it had none)."""
    lost = stall_s(sample, gap_s)
    return dataclasses.replace(sample, latency_s=sample.latency_s - lost) if lost > 0 else sample


def stall_table(samples: list[Sample], gap_s: float = STALL_GAP_S) -> dict[str, dict[str, Any]]:
    """Per configuration: requests, requests with a stall, seconds lost and their share of the summed
    latency.

    >>> ok = Sample("compare", "a", "p", "c", "t", 0.0, 1, latency_s=1.0, chunk_times_s=[0.1, 0.13, 0.16])
    >>> bad = Sample("compare", "b", "p", "c", "t", 0.0, 1, latency_s=2.0, chunk_times_s=[0.1, 0.13, 1.16, 1.19])
    >>> t = stall_table([ok, bad])
    >>> t["a"]["stalled"], t["b"]["stalled"], round(t["b"]["lost_s"], 2), round(t["b"]["share"], 3)
    (0, 1, 1.0, 0.5)
    """
    out = {}
    for cfg, group in sorted(group_by([s for s in samples if s.ok], lambda s: s.config).items()):
        lost = [stall_s(s, gap_s) for s in group]
        total = sum(s.latency_s for s in group)
        out[cfg] = {"requests": len(group), "stalled": sum(1 for x in lost if x > 0), "lost_s": sum(lost),
                    "share": sum(lost) / total if total > 0 else 0.0}
    return out
