"""Time-varying load: an arrival schedule built once and replayed, identical, for every configuration.

Words: an *arrival* is one request of the schedule: its index, its offset (seconds after the replay
starts), its prompt and its max_tokens. The *schedule* is the list of arrivals. Two sources:
- segments `RATE:SECONDS,...` (`--trace 0.08:90,0.6:60,0.08:90`): a Poisson process whose rate is
  constant within a segment (seeded); rate 0 is an idle segment;
- a CSV with a timestamp column (`--trace-file`, the Azure LLM inference trace format
  `TIMESTAMP,ContextTokens,GeneratedTokens`; ISO timestamps such as `2023-11-16 18:15:46.6805900` or
  plain seconds), time-scaled to this machine: `rate` rescales the offsets so the mean arrival rate
  ((n - 1) / span) is `rate` req/s, `window_s` keeps the arrivals before that offset (after scaling),
  `max_requests` the first n. With a GeneratedTokens column, an arrival's max_tokens is its
  GeneratedTokens capped at the run's --max-tokens.
Pure functions only; the replay itself is `Runner.run_schedule`.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import random
import sys
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from tools.bench.workload import Prompt, round_prompts


@dataclass(frozen=True)
class Arrival:
    index: int
    offset_s: float
    prompt: Prompt
    max_tokens: int


@dataclass(frozen=True)
class TraceRow:
    t_s: float  # seconds since the epoch (ISO) or as given (plain seconds)
    context_tokens: Optional[int] = None
    generated_tokens: Optional[int] = None


def parse_segments(text: str, flag: str = "--trace") -> list[tuple[float, float]]:
    """'0.08:90,0.6:60' -> [(0.08, 90.0), (0.6, 60.0)] (requests/s, seconds).

    >>> parse_segments("0.08:90,0.6:60,0:30")
    [(0.08, 90.0), (0.6, 60.0), (0.0, 30.0)]
    """
    out = []
    for token in (t.strip() for t in text.split(",") if t.strip()):
        rate, colon, seconds = token.partition(":")
        try:
            seg = (float(rate), float(seconds))
        except ValueError:
            seg = None
        if not colon or seg is None or seg[0] < 0 or seg[1] <= 0 or not all(math.isfinite(x) for x in seg):
            raise ValueError(f"{flag}: expected RATE:SECONDS segments (rate >= 0 req/s, seconds > 0), got {token!r}")
        out.append(seg)
    if not out:
        raise ValueError(f"{flag}: no segment in {text!r}")
    return out


def poisson_offsets(segments: list[tuple[float, float]], seed: int = 0) -> list[float]:
    """Arrival offsets of a Poisson process whose rate is constant within each segment. The process
    is memoryless, so at a segment's end the draw restarts at the next segment's start.

    >>> poisson_offsets([(0.0, 10.0)], 1)
    []
    >>> offs = poisson_offsets([(0.0, 10.0), (50.0, 1.0)], 1)
    >>> 30 < len(offs) < 80 and all(10.0 <= t < 11.0 for t in offs)
    True
    """
    rng = random.Random(seed)
    out: list[float] = []
    start = 0.0
    for rate, seconds in segments:
        end = start + seconds
        if rate > 0:
            t = start + rng.expovariate(rate)
            while t < end:
                out.append(t)
                t += rng.expovariate(rate)
        start = end
    return out


def mmpp_rows(seconds: float, rates: tuple[float, float], dwell_s: tuple[float, float], seed: int = 0,
              median_generated: int = 120, median_context: int = 600) -> list[TraceRow]:
    """A bursty arrival file: a two-state Markov-modulated Poisson process (a calm and a burst rate,
    exponential dwell times), the shape of production LLM traffic (e.g. Azure's public traces: calm
    stretches and bursts several times the mean), with log-normal ContextTokens and GeneratedTokens.
    Seeded, so the committed file can be made again.

    >>> rows = mmpp_rows(600.0, (0.5, 6.0), (120.0, 30.0), seed=1)
    >>> 300 < len(rows) < 3000 and rows == sorted(rows, key=lambda r: r.t_s) and rows[-1].t_s < 600.0
    True
    >>> all(r.generated_tokens >= 1 and r.context_tokens >= 1 for r in rows)
    True
    """
    rng = random.Random(seed)
    out: list[TraceRow] = []
    t, state = 0.0, 0
    while t < seconds:
        end = min(seconds, t + rng.expovariate(1.0 / dwell_s[state]))
        if rates[state] > 0:
            t += rng.expovariate(rates[state])
            while t < end:
                out.append(TraceRow(round(t, 3), max(1, int(rng.lognormvariate(math.log(median_context), 0.8))),
                                    max(1, int(rng.lognormvariate(math.log(median_generated), 0.7)))))
                t += rng.expovariate(rates[state])
        t, state = end, 1 - state
    return out


def rows_csv(rows: list[TraceRow]) -> str:
    """The Azure trace's columns, plain-second timestamps.

    >>> rows_csv([TraceRow(1.5, 10, 20)])
    'TIMESTAMP,ContextTokens,GeneratedTokens\\n1.5,10,20\\n'
    """
    return "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"{r.t_s},{r.context_tokens},{r.generated_tokens}\n" for r in rows)


def parse_timestamp(text: str) -> float:
    """Seconds: a plain number as is, an ISO date-time as seconds since the epoch (naive = UTC;
    more than six fractional digits are cut, as the Azure trace has seven).

    >>> parse_timestamp("12.5"), parse_timestamp("1970-01-01 00:01:00.2500000")
    (12.5, 60.25)
    """
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    head, dot, frac = text.partition(".")
    if dot:
        digits = len(frac) - len(frac.lstrip("0123456789"))
        text = head + "." + frac[:min(digits, 6)] + frac[digits:]
    dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def _column(header: list[str], name: str) -> Optional[int]:
    lowered = [h.strip().lower() for h in header]
    return lowered.index(name) if name in lowered else None


def parse_trace_csv(text: str, source: str = "<trace>") -> list[TraceRow]:
    """Rows of a trace CSV (header required: a `timestamp` column, or the first column; optional
    ContextTokens and GeneratedTokens), sorted by time. Errors name the file and the line."""
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if not header:
        raise ValueError(f"{source}: empty trace file")
    t_col = _column(header, "timestamp")
    t_col = 0 if t_col is None else t_col
    ctx_col, gen_col = _column(header, "contexttokens"), _column(header, "generatedtokens")
    rows = []
    for n, row in enumerate(reader, 2):
        if not row or not any(cell.strip() for cell in row):
            continue
        try:
            rows.append(TraceRow(parse_timestamp(row[t_col]),
                                 int(row[ctx_col]) if ctx_col is not None else None,
                                 int(row[gen_col]) if gen_col is not None else None))
        except (ValueError, IndexError) as e:
            raise ValueError(f"{source}:{n}: {type(e).__name__}: {e} (expected {', '.join(header)})") from None
    if not rows:
        raise ValueError(f"{source}: no arrival in the trace")
    return sorted(rows, key=lambda r: r.t_s)


def load_trace_csv(path: str | Path) -> list[TraceRow]:
    return parse_trace_csv(Path(path).read_text(encoding="utf-8"), str(path))


def mean_rate(offsets: list[float]) -> float:
    """(n - 1) / (last - first): arrivals per second between the first and the last (nan below 2)."""
    if len(offsets) < 2 or offsets[-1] <= offsets[0]:
        return math.nan
    return (len(offsets) - 1) / (offsets[-1] - offsets[0])


def scale_trace(rows: list[TraceRow], rate: Optional[float] = None, window_s: Optional[float] = None,
                max_requests: Optional[int] = None) -> list[tuple[float, Optional[int]]]:
    """(offset s, generated tokens) per arrival: offsets from the first arrival, rescaled so the mean
    rate is `rate` (None: as recorded), then those before `window_s`, then the first `max_requests`.

    >>> rows = [TraceRow(100.0, None, 5), TraceRow(101.0, None, 6), TraceRow(104.0, None, 7)]
    >>> scale_trace(rows, rate=1.0)  # 2 gaps in 4 s is 0.5 req/s: time runs 2x faster
    [(0.0, 5), (0.5, 6), (2.0, 7)]
    >>> scale_trace(rows, window_s=2.0), scale_trace(rows, max_requests=1)
    ([(0.0, 5), (1.0, 6)], [(0.0, 5)])
    """
    if not rows:
        return []
    offsets = [r.t_s - rows[0].t_s for r in rows]
    if rate is not None:
        if rate <= 0:
            raise ValueError(f"--trace-rate: expected a rate > 0 req/s, got {rate}")
        recorded = mean_rate(offsets)
        if math.isnan(recorded):
            raise ValueError("--trace-rate: the trace needs two arrivals at different times to be rescaled")
        offsets = [t * recorded / rate for t in offsets]
    out = [(t, r.generated_tokens) for t, r in zip(offsets, rows)]
    if window_s is not None:
        out = [x for x in out if x[0] < window_s]
    return out[:max_requests] if max_requests is not None else out


def build_schedule(offsets: list[float], prompts: list[Prompt], max_tokens: int,
                   generated: Optional[list[Optional[int]]] = None) -> list[Arrival]:
    """Arrival i at offsets[i] with prompts[i mod len] and max_tokens (a trace's generated tokens,
    capped at max_tokens, where it gives them).

    >>> p = [Prompt("a", "qa", "qa", "x"), Prompt("b", "qa", "qa", "y")]
    >>> [(a.index, a.prompt.question_id, a.max_tokens) for a in build_schedule([0.0, 1.0, 2.0], p, 8, [3, None, 20])]
    [(0, 'a', 3), (1, 'b', 8), (2, 'a', 8)]
    """
    if offsets and not prompts:
        raise ValueError("the trace needs at least one prompt")
    gen = generated or [None] * len(offsets)
    return [Arrival(i, t, prompts[i % len(prompts)], max(1, min(max_tokens, g)) if g else max_tokens)
            for i, (t, g) in enumerate(zip(offsets, gen))]


def round_schedule(arrivals: list[Arrival], prompts: list[Prompt], round_: int, start: int = 0) -> list[Arrival]:
    """The schedule of replay round `round_`: the same arrival times and max_tokens, the prompts that
    follow the previous rounds' in `prompts` from `start` (after the load sweep's; cycled), so no round
    resends an earlier round's or the sweep's prompt while `prompts` lasts. A server that remembers its
    answers across requests (stock suffix decoding) would otherwise draft later rounds from its own
    earlier ones. Round 0 at start 0 is `build_schedule`'s.

    >>> p = [Prompt(c, "qa", "qa", c) for c in "abcde"]
    >>> s = build_schedule([0.0, 1.0], p, 8)
    >>> [[a.prompt.question_id for a in round_schedule(s, p, r)] for r in range(3)]
    [['a', 'b'], ['c', 'd'], ['e', 'a']]
    """
    return [replace(a, prompt=p) for a, p in zip(arrivals, round_prompts(prompts, len(arrivals), round_, start))]


def schedule_shape(arrivals: list[Arrival]) -> dict:
    """Arrivals, span (s) and mean rate of a schedule, for the plan and the summary."""
    offs = [a.offset_s for a in arrivals]
    return {"arrivals": len(arrivals), "span_s": (offs[-1] if offs else 0.0), "mean_rate_rps": mean_rate(offs),
            "prompts": len({a.prompt.question_id for a in arrivals}),
            "output_tokens_max": sum(a.max_tokens for a in arrivals)}


def offsets_from_args(args, seed: int) -> tuple[list[float], Optional[list[Optional[int]]], str]:
    """(offsets, generated tokens or None, description) of --trace / --trace-file; ([], None, '') without."""
    if args.trace and args.trace_file:
        raise ValueError("--trace and --trace-file: give one of them")
    if args.trace_window_s is not None and args.trace_window_s <= 0:
        raise ValueError(f"--trace-window: expected seconds > 0, got {args.trace_window_s}")
    if args.trace_max_requests is not None and args.trace_max_requests < 1:
        raise ValueError(f"--trace-max-requests: expected a positive integer, got {args.trace_max_requests}")
    if args.trace:
        if args.trace_rate is not None:
            raise ValueError("--trace-rate: applies to --trace-file only (--trace segments give their rates)")
        offsets = [t for t in poisson_offsets(parse_segments(args.trace), seed)
                   if args.trace_window_s is None or t < args.trace_window_s][:args.trace_max_requests]
        return offsets, None, f"Poisson segments {args.trace} (seed {seed})"
    if args.trace_file:
        scaled = scale_trace(load_trace_csv(args.trace_file), args.trace_rate, args.trace_window_s,
                             args.trace_max_requests)
        if not scaled:
            raise ValueError(f"--trace-file {args.trace_file}: no arrival left after --trace-window")
        generated = [g for _, g in scaled]
        return ([t for t, _ in scaled], generated if any(g is not None for g in generated) else None,
                f"{args.trace_file}" + (f" at {args.trace_rate:g} req/s" if args.trace_rate else "")
                + (f", first {args.trace_window_s:g} s" if args.trace_window_s else ""))
    return [], None, ""


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m tools.bench.trace mmpp --seconds S --rates CALM,BURST --dwell CALM_S,BURST_S --seed N > f.csv`"""
    ap = argparse.ArgumentParser(prog="python -m tools.bench.trace", description="Write a bursty arrival CSV.")
    ap.add_argument("kind", choices=["mmpp"])
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--rates", default="0.5,6", help="calm,burst arrivals per second")
    ap.add_argument("--dwell", default="120,30", help="mean seconds in the calm and in the burst state")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        rates = tuple(float(x) for x in args.rates.split(","))
        dwell = tuple(float(x) for x in args.dwell.split(","))
    except ValueError:
        ap.error("--rates and --dwell: two comma-separated numbers each")
    if len(rates) != 2 or len(dwell) != 2 or min(rates) < 0 or min(dwell) <= 0:
        ap.error("--rates: two rates >= 0; --dwell: two durations > 0")
    sys.stdout.write(rows_csv(mmpp_rows(args.seconds, rates, dwell, args.seed)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
