"""The draft gate on simulated steps: how often it runs the slower arm, and how fast it follows a change.

Steps at batch 16 with the costs measured on this CPU (a plain step 52 ms, +2.4 ms per verified draft);
`gain` is the draft arm's rate over the plain arm's. Run from the repository root:

    .venv/bin/python docs/benchmarks/draft-gate/simulate.py
"""
import random, sys
sys.path.insert(0, ".")
from cluster.engine.draft_gate import DraftGate
def run(gain, steps=3000, prior=11, B=16, seed=1, shift_at=None, gain2=None):
    g = DraftGate(prior_max_batch=prior, explore=0.2, rng=random.Random(seed))
    r = random.Random(seed + 100)
    chosen = []; tok_total = 0; time_total = 0
    for i in range(steps):
        gg = gain if shift_at is None or i < shift_at else gain2
        d = g.allows(B)
        if d:
            drafts = max(0, r.gauss(30, 12)); acc = drafts * r.uniform(0.2, 0.8)
            t = 0.052 + 0.0024 * drafts; tokens = 16 + acc
            # scale so that draft rate / plain rate = gg on average
            tokens *= gg / ((16 + 30 * 0.5) / (0.052 + 0.0024 * 30) / (16 / 0.052))
        else:
            t = max(0.01, r.gauss(0.052, 0.005)); tokens = 16
        g.observe(B, d, tokens, t); chosen.append(d)
    return chosen
for gain in (0.85, 0.93, 0.97, 1.0, 1.03, 1.06, 1.15, 1.4):
    c = run(gain)
    print(f"gain {gain}: draft share first 300 {sum(c[:300])/300:.2f}, 300-1000 {sum(c[300:1000])/700:.2f}, last 2000 {sum(c[1000:])/2000:.2f}")
for g1, g2 in ((1.1, 0.9), (0.9, 1.1)):
    c = run(g1, steps=6000, shift_at=3000, gain2=g2)
    print(f"shift {g1}->{g2}: before {sum(c[2000:3000])/1000:.2f} after +500 {sum(c[3000:3500])/500:.2f} +1500 {sum(c[3500:4500])/1000:.2f} +3000 {sum(c[4500:])/1500:.2f}")
print("--- other_fade variants")
import cluster.engine.draft_gate as G
for of in (0.25, 0.5, 1.0):
    def mk(gain, steps=3000, shift_at=None, gain2=None, seed=1):
        g = G.DraftGate(prior_max_batch=11, explore=0.2, rng=random.Random(seed), other_fade=of)
        r = random.Random(seed + 100); chosen = []
        for i in range(steps):
            gg = gain if shift_at is None or i < shift_at else gain2
            d = g.allows(16)
            if d:
                drafts = max(0, r.gauss(30, 12)); acc = drafts * r.uniform(0.2, 0.8)
                t = 0.052 + 0.0024 * drafts; tokens = (16 + acc) * gg / ((16 + 30 * 0.5) / (0.052 + 0.0024 * 30) / (16 / 0.052))
            else:
                t = max(0.01, r.gauss(0.052, 0.005)); tokens = 16
            g.observe(16, d, tokens, t); chosen.append(d)
        return chosen
    out = []
    for gain in (0.7, 0.93, 1.07, 1.4):
        c = mk(gain); share = sum(c[1000:]) / 2000
        out.append(f"gain {gain}: wrong-arm share {share if gain < 1 else 1 - share:.3f}")
    for g1, g2 in ((1.1, 0.9), (0.9, 1.1)):
        c = mk(g1, steps=6000, shift_at=3000, gain2=g2)
        out.append(f"shift {g1}->{g2}: +500 {sum(c[3000:3500])/500:.2f} +1500 {sum(c[3500:4500])/1000:.2f} +3000 {sum(c[4500:])/1500:.2f}")
    print(f"other_fade {of}:", "; ".join(out))
print("--- a cold burst: batch climbs 1 -> 20 over 150 steps, stays 150; draft gain falls with the batch")
class StaticPrior(G.DraftGate):  # the prior before neighbours: the bound alone
    def prior(self, batch_size):
        return self.prior_max_batch is None or batch_size <= self.prior_max_batch
def burst(cls, gain_at, seed):
    g = cls(prior_max_batch=11, explore=0.2, rng=random.Random(seed)); r = random.Random(seed + 100)
    tok = sec = 0.0
    for i in range(300):
        B = min(20, 1 + i * 20 // 150); gg = gain_at(B); d = g.allows(B)
        if d:
            drafts = max(0, r.gauss(30, 12)); t = 0.052 + 0.0024 * drafts
            tokens = (B + drafts * r.uniform(0.2, 0.8)) * gg * (B / 0.052) / ((B + 15) / (0.052 + 0.072))
        else:
            t = max(0.01, r.gauss(0.052, 0.005)); tokens = B
        g.observe(B, d, tokens, t); tok += tokens; sec += t
    return tok / sec
for name, gain_at in (("drafting pays everywhere (1.6 at 1 -> 1.3 at 20)", lambda b: 1.6 - 0.3 * (b - 1) / 19),
                      ("drafting stops paying at 12 (1.3 at 1 -> 0.85 at 20)", lambda b: 1.3 - 0.45 * (b - 1) / 19)):
    rs = [burst(G.DraftGate, gain_at, s) / burst(StaticPrior, gain_at, s) for s in range(20)]
    print(f"{name}: tokens/s with neighbours / with the bound alone, 20 seeds: mean {sum(rs)/len(rs):.3f}, min {min(rs):.3f}, max {max(rs):.3f}")
