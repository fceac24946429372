"""Benchmark metric math: pure functions over `Sample`s (one per request), no I/O.

Words (with those of `cluster.speculation`):
- TTFT (`ttft_s`): request sent -> first token-bearing chunk, at the client.
- TPOT (`tpot_s`): (latency - TTFT) / (output tokens - 1), one figure per request.
- ITL (`itl_s`): gaps between successive token-bearing chunks at the client; with speculation a
  chunk may carry several tokens (accepted + bonus), so ITL is per chunk, not per token.
- latency (`latency_s`): request sent -> last chunk.
- request tokens/s: sum of output tokens / sum of latencies (the decode speed one stream sees;
  for sequential requests it equals wall-clock throughput).
- throughput (`throughput_tokens_per_s`): output tokens / wall span of the requests (first send to
  last completion), for concurrent requests. A load level run in rounds (one short phase per
  configuration and round, configurations interleaved) pools its phases: summed tokens / summed
  phase spans (`round_rates`, `pooled_rate`), never the span from the first round to the last.
- goodput (`goodput_tokens_per_s`): output tokens of the requests meeting every given SLO
  (TTFT, TPOT, latency) / the same wall span; `request_goodput_tokens_per_s` divides by the
  summed latency instead (for one stream whose requests interleave with other configurations).
- acceptance length = accepted / steps + 1 over the summed steps (token-weighted, as SpecStats).
- logit gap at a position: top-1 minus top-2 logprob of the no-speculation run there. Greedy
  outputs may diverge where the gap is a near-tie (numerics of batched verification); a large gap
  at a divergence means speculation changed the output: a bug.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Optional

from cluster.percentile import percentile


@dataclass
class Sample:
    """One request of a run, as measured at the client (times in s since the run started)."""

    phase: str  # reference | warmup | compare | sweep | poisson | trace
    config: str
    prompt_id: str
    category: str
    task: str
    temperature: float
    concurrency: int  # streams of the closed loop (0 in an open-loop phase)
    repeat: int = 0
    rate_rps: Optional[float] = None  # open-loop arrival rate
    arrival: Optional[int] = None  # trace replay: the arrival's index in the schedule (same for every config)
    ok: bool = True
    error_status: Optional[int] = None
    error: Optional[str] = None
    start_s: float = 0.0
    end_s: float = 0.0
    ttft_s: Optional[float] = None
    latency_s: Optional[float] = None
    chunk_times_s: list[float] = field(default_factory=list)  # since this request was sent
    chunk_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    spec: dict = field(default_factory=dict)  # the response's specserve stats (without token_ids/logprobs)
    logprobs: Optional[list[dict[int, float]]] = None  # reference runs only
    text: str = ""

    @property
    def output_tokens(self) -> int:
        return len(self.token_ids)

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.logprobs is not None:
            d["logprobs"] = [{str(t): v for t, v in pos.items()} for pos in self.logprobs]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Sample":
        d = dict(d)
        if d.get("logprobs") is not None:
            d["logprobs"] = [{int(t): float(v) for t, v in pos.items()} for pos in d["logprobs"]]
        return cls(**d)


@dataclass(frozen=True)
class Slo:
    """Latency objectives of one request; None means no objective."""

    ttft_s: Optional[float] = None
    tpot_s: Optional[float] = None
    latency_s: Optional[float] = None


# -- distributions -------------------------------------------------------------------------------


def distribution(values: Iterable[Optional[float]]) -> dict[str, float]:
    xs = [v for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return {"n": 0, "mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan,
                "min": math.nan, "max": math.nan}
    return {"n": len(xs), "mean": sum(xs) / len(xs), "p50": percentile(xs, 50), "p90": percentile(xs, 90),
            "p99": percentile(xs, 99), "min": xs[0] if len(xs) == 1 else min(xs), "max": max(xs)}


# -- per request ------------------------------------------------------------------------------------


def tpot_s(s: Sample) -> Optional[float]:
    if not s.ok or s.ttft_s is None or s.latency_s is None or s.output_tokens < 2:
        return None
    return (s.latency_s - s.ttft_s) / (s.output_tokens - 1)


def itl_s(s: Sample) -> list[float]:
    t = s.chunk_times_s
    return [b - a for a, b in zip(t, t[1:])]


def meets_slo(s: Sample, slo: Slo) -> bool:
    """A successful request within every given objective. A one-token output has no TPOT and
    meets any TPOT objective; a missing TTFT or latency fails its objective."""
    if not s.ok:
        return False
    tpot = tpot_s(s)
    if slo.tpot_s is not None and tpot is not None and tpot > slo.tpot_s:
        return False
    for limit, value in ((slo.ttft_s, s.ttft_s), (slo.latency_s, s.latency_s)):
        if limit is not None and (value is None or value > limit):
            return False
    return True


# -- per group ---------------------------------------------------------------------------------------


def summarize(samples: list[Sample], slo: Slo = Slo()) -> dict[str, Any]:
    """Every metric of one group of samples (one configuration x category x load level)."""
    ok = [s for s in samples if s.ok]
    tokens = sum(s.output_tokens for s in ok)
    latency_sum = sum(s.latency_s or 0.0 for s in ok)
    span_s = (max(s.end_s for s in samples) - min(s.start_s for s in samples)) if samples else 0.0
    good = [s for s in ok if meets_slo(s, slo)]
    steps = sum(int(s.spec.get("steps", 0)) for s in ok)
    drafted = sum(int(s.spec.get("drafted", 0)) for s in ok)
    accepted = sum(int(s.spec.get("accepted", 0)) for s in ok)
    return {
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "output_tokens": tokens,
        "ttft_s": distribution(s.ttft_s for s in ok),
        "tpot_s": distribution(tpot_s(s) for s in ok),
        "itl_s": distribution(x for s in ok for x in itl_s(s)),
        "latency_s": distribution(s.latency_s for s in ok),
        "request_tokens_per_s": tokens / latency_sum if latency_sum > 0 else math.nan,
        "span_s": span_s,
        "throughput_tokens_per_s": tokens / span_s if span_s > 0 else math.nan,
        "goodput_tokens_per_s": sum(s.output_tokens for s in good) / span_s if span_s > 0 else math.nan,
        "request_goodput_tokens_per_s": sum(s.output_tokens for s in good) / latency_sum if latency_sum > 0 else math.nan,
        "good_requests": len(good),
        "steps": steps,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_length": 1.0 + accepted / steps if steps else 1.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "k_distribution": dict(sorted(Counter(f"{s.spec.get('mode', '?')}:{s.spec.get('k', '?')}"
                                              for s in ok).items())),
        "explored": sum(1 for s in ok if s.spec.get("explored")),
        "load_buckets": dict(sorted(Counter(s.spec["decision"]["load_bucket"] for s in ok
                                            if (s.spec.get("decision") or {}).get("load_bucket")).items())),
    }


def group_by(samples: list[Sample], key: Callable[[Sample], Any]) -> dict[Any, list[Sample]]:
    out: dict[Any, list[Sample]] = {}
    for s in samples:
        out.setdefault(key(s), []).append(s)
    return out


def repeat_spread(samples: list[Sample]) -> dict[str, float]:
    """request tokens/s of each repeat of a group, then their min and median over repeats."""
    per_repeat = []
    for _, group in sorted(group_by(samples, lambda s: s.repeat).items()):
        ok = [s for s in group if s.ok]
        lat = sum(s.latency_s or 0.0 for s in ok)
        if lat > 0:
            per_repeat.append(sum(s.output_tokens for s in ok) / lat)
    if not per_repeat:
        return {"repeats": 0, "min": math.nan, "median": math.nan}
    return {"repeats": len(per_repeat), "min": min(per_repeat), "median": statistics.median(per_repeat)}


def round_rates(samples: list[Sample], slo: Slo = Slo(), wall: bool = True) -> list[dict[str, Any]]:
    """One row per round (the samples' `repeat`), in round order: requests, output tokens, tokens
    of the requests meeting `slo`, time and tokens/s. Time is the round's wall span (first send to
    last completion: a closed-loop phase, `wall`) or its summed latency (one stream, interleaved)."""
    rows = []
    for r, group in sorted(group_by(samples, lambda s: s.repeat).items()):
        ok = [s for s in group if s.ok]
        if wall:
            time_s = max(s.end_s for s in group) - min(s.start_s for s in group)
        else:
            time_s = sum(s.latency_s or 0.0 for s in ok)
        tokens = sum(s.output_tokens for s in ok)
        rows.append({"round": r, "requests": len(group), "output_tokens": tokens,
                     "good_tokens": sum(s.output_tokens for s in ok if meets_slo(s, slo)), "time_s": time_s,
                     "tokens_per_s": tokens / time_s if time_s > 0 else math.nan})
    return rows


def pooled_rate(rounds: list[dict[str, Any]], tokens_key: str = "output_tokens") -> float:
    """Summed tokens over summed time of `round_rates` rows (each phase weighted by its length,
    not the mean of the per-round rates)."""
    time_s = sum(r["time_s"] for r in rounds)
    return sum(r[tokens_key] for r in rounds) / time_s if time_s > 0 else math.nan


def paired_ratios(rounds: list[dict[str, Any]], reference_rounds: list[dict[str, Any]]) -> list[float]:
    """tokens/s of each round over the reference's tokens/s in the same round (rounds present in both
    with a positive rate), in round order."""
    ref = {r["round"]: r["tokens_per_s"] for r in reference_rounds}
    out = []
    for r in rounds:
        a, b = r["tokens_per_s"], ref.get(r["round"])
        if b is not None and not math.isnan(b) and b > 0 and not math.isnan(a):
            out.append(a / b)
    return out


def ratio_spread(ratios: list[float], target: float) -> dict[str, Any]:
    """min / median / max of per-round ratios, how many rounds fall below `target`, and whether the
    target lies inside the spread (`within_noise`: some rounds meet it and some do not; None with
    fewer than two rounds, where there is no spread to judge by)."""
    if not ratios:
        return {"n": 0, "min": math.nan, "median": math.nan, "max": math.nan, "below_target": 0, "within_noise": None}
    below = sum(1 for x in ratios if x < target)
    return {"n": len(ratios), "min": min(ratios), "median": statistics.median(ratios), "max": max(ratios),
            "below_target": below, "within_noise": (0 < below < len(ratios)) if len(ratios) > 1 else None}


def speedup(config_tokens_per_s: float, baseline_tokens_per_s: float) -> float:
    if not baseline_tokens_per_s or math.isnan(baseline_tokens_per_s):
        return math.nan
    return config_tokens_per_s / baseline_tokens_per_s


def best_k_per_mode(rows: dict[str, float], names_to_mode_k: dict[str, tuple[str, int]]) -> dict[str, str]:
    """mode -> the configuration name with the highest tokens/s among that mode's fixed-K ones."""
    best: dict[str, tuple[float, str]] = {}
    for name, value in rows.items():
        if name not in names_to_mode_k or value is None or math.isnan(value):
            continue
        mode, _ = names_to_mode_k[name]
        if mode not in best or value > best[mode][0]:
            best[mode] = (value, name)
    return {mode: name for mode, (_, name) in best.items()}


# -- losslessness ------------------------------------------------------------------------------------


def first_divergence(reference: list[int], other: list[int]) -> Optional[int]:
    """Index of the first position where the two token lists differ (a length difference counts)."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def logit_gap(position_logprobs: Optional[dict[int, float]]) -> Optional[float]:
    """Top-1 minus top-2 logprob at one position (None without two alternatives)."""
    if not position_logprobs or len(position_logprobs) < 2:
        return None
    top = sorted(position_logprobs.values(), reverse=True)
    return top[0] - top[1]


@dataclass
class Mismatch:
    config: str
    prompt_id: str
    task: str
    repeat: int
    position: int
    reference_token: Optional[int]
    token: Optional[int]
    gap: Optional[float]  # logit gap of the reference at `position`
    verdict: str  # near-tie | large-gap | unknown-gap


def check_lossless(reference: dict[str, Sample], samples: list[Sample], tie_gap: float) -> tuple[dict, list[Mismatch]]:
    """Compare every greedy sample with the no-speculation reference of its prompt, token by token.

    `reference` maps prompt id -> reference sample (with logprobs). Returns per-configuration
    counts {config: {"compared", "mismatches", "near_tie", "large_gap", "unknown_gap"}} and the
    mismatches. A divergence whose reference gap is below `tie_gap` (nats) is a near-tie.
    """
    counts: dict[str, dict[str, int]] = {}
    mismatches = []
    for s in samples:
        ref = reference.get(s.prompt_id)
        if not s.ok or s.temperature != 0 or ref is None or not ref.ok:
            continue
        c = counts.setdefault(s.config, {"compared": 0, "mismatches": 0, "near_tie": 0, "large_gap": 0,
                                         "unknown_gap": 0})
        c["compared"] += 1
        pos = first_divergence(ref.token_ids, s.token_ids)
        if pos is None:
            continue
        gap = logit_gap(ref.logprobs[pos]) if ref.logprobs and pos < len(ref.logprobs) else None
        verdict = "unknown-gap" if gap is None else ("near-tie" if gap < tie_gap else "large-gap")
        c["mismatches"] += 1
        c[verdict.replace("-", "_")] += 1
        mismatches.append(Mismatch(
            config=s.config, prompt_id=s.prompt_id, task=s.task, repeat=s.repeat, position=pos,
            reference_token=ref.token_ids[pos] if pos < len(ref.token_ids) else None,
            token=s.token_ids[pos] if pos < len(s.token_ids) else None, gap=gap, verdict=verdict))
    return counts, mismatches
