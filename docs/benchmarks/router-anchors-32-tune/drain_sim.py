"""The draining batch sizes of a 32-stream phase on the gate table of this folder's run: the shipped gate
against one that lets a cold bucket decide on its own arms once they differ by over 3 standard errors.
Step throughput over 3 phases (climb to 32, 100 steps there, drain with 5 steps per batch size),
30 seeds, against always running the faster arm. Run from the repository root:

    .venv/bin/python docs/benchmarks/router-anchors-32-tune/drain_sim.py
"""
import random, sys, math
sys.path.insert(0, ".")
import cluster.engine.draft_gate as G
# per bucket (index): plain tok/s and draft/plain ratio, read off the tune-half 32-stream gate table
PLAIN = [15.4, 23.6, 52.2, 79.6, 100.6, 115.6, 113.7, 120.1, 139.5, 139.5, 139.5]
GAIN = [1.84, 2.87, 1.90, 1.21, 1.03, 0.94, 1.10, 1.17, 0.89, 0.89, 0.89]
class Own(G.DraftGate):
    """variant: a cold bucket whose own arms differ by > Z s.e. decides on them"""
    Z = 3.0
    def allows(self, batch_size):
        b = G.bucket_of(batch_size)
        d, p = self.arm(b, True), self.arm(b, False)
        if not self.compares(batch_size) and d.n >= 2 and p.n >= 2:
            diff = (d.rate() or 0) - (p.rate() or 0)
            if abs(diff) > self.Z * math.hypot(d.stderr(), p.stderr()):
                return diff > 0
        return super().allows(batch_size)
def phases(n=3, full=100, per=5):
    seq = []
    for _ in range(n):
        seq += list(range(1, 33, 2)) + [32] * full + [b for b in range(31, 0, -1) for _ in range(per)]
    return seq
def run(cls, seed):
    g = cls(prior_max_batch=11, explore=0.2, rng=random.Random(seed)); r = random.Random(seed + 7)
    tok = t = 0.0; otok = ot = 0.0
    for B in phases():
        bi = G.bucket_of(B); d = g.allows(B)
        dt = B / PLAIN[bi] * max(0.5, r.gauss(1, 0.05))
        tk = B * (GAIN[bi] * max(0.3, r.gauss(1, 0.15)) if d else 1.0)
        g.observe(B, d, tk, dt); tok += tk; t += dt
        best = max(GAIN[bi], 1.0); otok += B * best; ot += B / PLAIN[bi]
    return tok / t, otok / ot
for cls in (G.DraftGate, Own):
    rs = [run(cls, s) for s in range(30)]
    m = sum(a for a, _ in rs) / len(rs); o = rs[0][1]
    print(cls.__name__, "tok/s mean %.2f  of oracle %.3f  min %.3f" % (m, m / o, min(a for a, _ in rs) / o))
