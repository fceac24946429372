"""CPU seconds of every process of the machine while N tune prompts (from SKIP) run one at a time,
streamed, against URL (the cluster or a stock server); EXTRA is a JSON object merged into each
request body (e.g. '{"specserve":{"speculative":{"mode":"none"}}}'). Prints the wall time, the
streamed chunks and the 16 busiest processes with their CPU time per chunk.

    .venv/bin/python docs/benchmarks/one-stream/cpu_per_process.py http://127.0.0.1:8000 12 40 [EXTRA]
"""
import sys, time, psutil, httpx, json
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tools.bench.split import keep
from tools.bench.workload import load_prompts
url, n, skip = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
def snap():
    out = {}
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            t = p.cpu_times(); out[p.pid] = (" ".join(p.info["cmdline"] or [p.info["name"] or ""])[:70], t.user + t.system)
        except psutil.Error: pass
    return out
prompts = keep(load_prompts(), "tune")[skip:skip + n]
a = snap(); t0 = time.time(); toks = 0; chunks = 0
with httpx.Client(timeout=300) as c:
    for p in prompts:
        body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": p.text}], "max_tokens": 128,
                "temperature": 0, "stream": True, **extra}
        with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and "[DONE]" not in line:
                    chunks += 1
wall = time.time() - t0; b = snap()
rows = sorted(((b[k][1] - a[k][1], b[k][0]) for k in b if k in a), reverse=True)
print(f"wall {wall:.1f} s, chunks {chunks}")
for d, name in rows[:16]:
    print(f"{d:7.2f} s  {100*d/wall:5.1f}%  {1000*d/max(chunks,1):6.2f} ms/chunk  {name}")
