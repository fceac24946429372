"""Where `auto`'s one-stream time goes against stock-suffix's, per request, from a bench run's samples.

    python docs/benchmarks/suffix-one-stream/serving_split.py RESULTS/samples.json [OTHER]

Pairs `auto` with OTHER (default stock-suffix) by prompt and repeat in the one-stream greedy
comparison and prints mean milliseconds per request of: the client's TTFT and latency; the same two
as the cluster's engine replica timed them (`spec.ttft_s`, `spec.latency_s`: from the replica's
receipt of the request), so that client minus replica is what Ray's proxy, the router and the two
handle hops add; and the decode part (latency minus TTFT) on both sides. Also engine steps and
streamed chunks per answer, which say whether the two drafted alike.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from tools.bench.report import load_samples


def main(path: str, other: str = "stock-suffix") -> None:
    samples = [s for s in load_samples(Path(path))[1] if s.phase == "compare" and s.ok and s.temperature == 0]
    by = {c: {(s.prompt_id, s.repeat): s for s in samples if s.config == c} for c in ("auto", other)}
    keys = sorted(set(by["auto"]) & set(by[other]))
    if not keys:
        sys.exit(f"no one-stream greedy pairs of auto and {other} in {path}")
    a, o = [by["auto"][k] for k in keys], [by[other][k] for k in keys]

    def ms(xs) -> float:
        return round(statistics.mean(xs) * 1000, 1)

    rows = [
        ("TTFT, client", ms(s.ttft_s for s in a), ms(s.ttft_s for s in o)),
        ("TTFT, engine replica", ms(s.spec["ttft_s"] for s in a), None),
        ("latency, client", ms(s.latency_s for s in a), ms(s.latency_s for s in o)),
        ("latency, engine replica", ms(s.spec["latency_s"] for s in a), None),
        ("decode part (latency - TTFT), client", ms(s.latency_s - s.ttft_s for s in a),
         ms(s.latency_s - s.ttft_s for s in o)),
    ]
    print(f"{len(keys)} pairs; mean ms per request      auto    {other}")
    for name, x, y in rows:
        print(f"  {name:<38} {x:>7} {'' if y is None else y:>8}")
    print(f"  serving path before the replica (client - replica TTFT): "
          f"{ms(s.ttft_s - s.spec['ttft_s'] for s in a)}")
    print(f"  engine steps per answer (auto): {statistics.mean(s.spec['steps'] for s in a):.1f}; streamed chunks "
          f"per answer: auto {statistics.mean(len(s.chunk_times_s) for s in a):.1f}, "
          f"{other} {statistics.mean(len(s.chunk_times_s) for s in o):.1f}")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    main(*sys.argv[1:])
