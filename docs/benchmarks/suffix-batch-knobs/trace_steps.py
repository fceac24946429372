"""Where a run's latency goes, per configuration and round: engine steps against step time.

    .venv/bin/python docs/benchmarks/suffix-batch-knobs/trace_steps.py RUN/samples.json FROM_S TO_S
    .venv/bin/python docs/benchmarks/suffix-batch-knobs/trace_steps.py RUN/samples.json sweep

For the cluster's configurations (stock servers report no steps): with FROM_S TO_S, the trace
requests that arrived between FROM_S and TO_S seconds into their round (the burst: `55 82` for the
`0.1:60,2.5:20,0.1:60` trace); with `sweep`, the closed-loop load phases, per stream count. Prints
the mean latency and TTFT, engine steps per request, decode milliseconds per step (latency less
TTFT, over steps: the batch's step time as each request saw it), the share of steps that verified
a draft, and draft tokens verified per step. Outputs are beside each run's report.
"""
import os
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, os.getcwd())
from tools.bench.report import load_samples

path, window = Path(sys.argv[1]), sys.argv[2:]
_, samples = load_samples(path)
groups = defaultdict(list)  # (streams or "trace", round, config) -> samples
for s in samples:
    if not (s.ok and s.spec.get("steps")):
        continue
    if window == ["sweep"] and s.phase == "sweep":
        groups[(s.concurrency, s.repeat, s.config)].append(s)
    elif window != ["sweep"] and s.phase == "trace":
        groups[("trace", s.repeat, s.config)].append(s)
print(f"{'load':>5} {'round':>5} {'config':<10} {'n':>3} {'latency s':>9} {'ttft s':>6} {'steps/req':>9} "
      f"{'ms/step':>7} {'drafting':>8} {'drafts/step':>11}")
for (load, r, config), got in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), kv[0][1], kv[0][2])):
    xs = got
    if load == "trace":
        lo, hi = float(window[0]), float(window[1])
        t0 = min(s.start_s for s in got)
        xs = [s for s in got if lo <= s.start_s - t0 < hi]
    if not xs:
        continue
    steps = sum(s.spec["steps"] for s in xs)
    decode = sum(s.latency_s - (s.ttft_s or 0.0) for s in xs)
    print(f"{load:>5} {r:>5} {config:<10} {len(xs):>3} {sum(s.latency_s for s in xs) / len(xs):>9.2f} "
          f"{sum(s.ttft_s or 0.0 for s in xs) / len(xs):>6.2f} {steps / len(xs):>9.1f} "
          f"{1000 * decode / steps:>7.1f} {sum(s.spec.get('spec_steps', 0) for s in xs) / steps:>8.2f} "
          f"{sum(s.spec.get('drafted', 0) for s in xs) / steps:>11.2f}")
