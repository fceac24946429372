"""Autoscaling of an engine pool on speculative goodput: one pure decision per control-loop tick.

Contract: `decide(snapshot, config, state)` returns the replicas the pool should run now, why, and
the state of the next tick, from one `PoolSnapshot` (what the pool's replicas reported over the last
window, plus the tuning state's plain-decoding step times), the pool's `AutoscalingConfig` and the
previous `PolicyState`. No I/O, no clock: time comes in the snapshot. Words are those of
`cluster.speculation`; in addition:

- **load**: requests in flight at the pool (running in the engines plus queued at Ray's handles),
  averaged by Ray Serve over `look_back_period_s`.
- **carry**: requests in flight one replica holds with plain decoding (K = 0) while its step time
  stays within `slo_tpot_s` (`replica_carry`, from the router's tuning state). Below it the router
  can trade speculation for load (it lowers K as the batch grows); above it no K helps, only a replica.
- **SLO slip**: a replica's p99 TPOT or TTFT over the window above its objective (counted only once
  the replica finished `min_samples` requests in the window).
- **goodput**: output tokens per second of the pool (accepted + bonus), shown in the reason.

The decision, in order (then clamped to [min_replicas, max_replicas]):
1. a scale-up under way (target above the running replicas): hold the target unless the load
   needs more; latency measured before the new replica runs does not stack another one.
2. an SLO slip: one replica more than the target (at least what the load needs).
3. load above carry x target: ceil(load / carry) replicas.
4. load that fits in fewer replicas at `downscale_headroom` x carry, with every replica's p99 within
   `downscale_headroom` x its SLO: that many.
5. otherwise hold.
A change must be wanted continuously for `upscale_delay_s` / `downscale_delay_s` (snapshot time)
before it is applied; until then the verdict is pending and the target stays.

`effective_replicas` / `with_capacity` are the router's side: the replicas whose capacity the
router counts on when it buckets a pool's load for K, i.e. the autoscaler's decided target, which
includes a scale-up that is still starting (the router then does not cut K to absorb load that the
coming replica takes; the engine's per-step K cap still sees the real batch).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping, Optional, Sequence

from cluster.config_pool import AutoscalingConfig
from cluster.percentile import percentile
from cluster.policy import BUCKET_BATCH, BUCKET_NAMES

# Plain step time grows about this much per extra request in the batch on the CPU box
# (cluster.policy.PolicyParams.step_time_per_batch); used when only one batch size was measured.
PRIOR_STEP_GROWTH_PER_BATCH = 0.08
MAX_REPLICAS = 10_000  # no pool runs more; a record saying so is not believed


@dataclass(frozen=True)
class ReplicaMetrics:
    """What one engine replica reported (`EngineServer.record_autoscaling_stats`), window-averaged."""

    replica: str
    unfinished: float = 0.0  # requests in the engine (running + waiting in vLLM)
    finished: float = 0.0  # requests finished within the engine's metrics window
    tokens_per_s: float = 0.0  # output tokens per second (goodput before SLOs)
    accepted_per_s: float = 0.0  # accepted draft tokens per second
    tpot_p99_s: float = -1.0  # p99 time per output token over the window (-1: no request finished)
    ttft_p99_s: float = -1.0  # p99 time to first token at the engine (-1: none)
    mean_k: float = 0.0  # mean K of the requests finished in the window


@dataclass(frozen=True)
class PoolSnapshot:
    """One control-loop tick's view of a pool."""

    now_s: float  # wall-clock time of the tick (unix s)
    running_replicas: int
    target_replicas: int  # the target Ray Serve is currently bringing the pool to
    load: float  # requests in flight at the pool (see module doc)
    replicas: tuple[ReplicaMetrics, ...] = ()
    plain_step_s: tuple[tuple[float, float], ...] = ()  # (batch, plain step time s) from the tuning state

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["replicas"] = [asdict(r) for r in self.replicas]
        d["plain_step_s"] = [list(p) for p in self.plain_step_s]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PoolSnapshot":
        return cls(now_s=float(d["now_s"]), running_replicas=int(d["running_replicas"]),
                   target_replicas=int(d["target_replicas"]), load=float(d["load"]),
                   replicas=tuple(ReplicaMetrics(**r) for r in d.get("replicas", ())),
                   plain_step_s=tuple((float(b), float(t)) for b, t in d.get("plain_step_s", ())))


@dataclass(frozen=True)
class PolicyState:
    """Carried between ticks: the change wanted, and since when (for the delays)."""

    want: Optional[int] = None
    since_s: Optional[float] = None

    def to_dict(self) -> dict[str, Any]:
        return {"specserve_want": self.want, "specserve_since_s": self.since_s}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PolicyState":
        return cls(want=d.get("specserve_want"), since_s=d.get("specserve_since_s"))


@dataclass(frozen=True)
class Verdict:
    replicas: int  # the target to apply now
    want: int  # what the policy wants (applied once the delay has passed)
    action: str  # up | down | hold | pending-up | pending-down
    reason: str
    load: float
    carry: float
    carry_source: str  # measured | prior | config
    goodput_tokens_per_s: float
    accepted_per_s: float
    tpot_p99_s: float  # worst replica with enough samples (-1: none)
    ttft_p99_s: float
    mean_k: float  # token-weighted over replicas

    def record(self, pool: str, snap: PoolSnapshot) -> dict[str, Any]:
        """What is published for the router and `specserve status` (JSON-able)."""
        return {"pool": pool, "time_unix_s": snap.now_s, "running": snap.running_replicas,
                "target": self.replicas, "previous_target": snap.target_replicas, **asdict(self),
                "replica_metrics": [asdict(r) for r in snap.replicas]}


# -- capacity -------------------------------------------------------------------------------------

def replica_carry(
    plain_step_s: Sequence[tuple[float, float]], slo_tpot_s: Optional[float], fallback: float,
    max_carry: float, growth: float = PRIOR_STEP_GROWTH_PER_BATCH,
) -> tuple[float, str]:
    """(carry, source): the batch at which plain decoding's step time reaches `slo_tpot_s`.

    Step time is modelled as a line in the batch size: fitted by least squares through the measured
    (batch, step s) points, or through one point with the prior growth per request. No SLO or no
    point: `fallback` (the config's target_ongoing_requests); a crossing below every measured batch
    (> 1) is not trusted either (fallback, at most the smallest measured batch). Bounded to [1, max_carry].

    >>> replica_carry([(1.0, 0.1), (11.5, 0.2)], 0.2, 8, 64)
    (11.5, 'measured')
    >>> replica_carry([], 0.2, 8, 64)
    (8, 'config')
    """
    if slo_tpot_s is None or not plain_step_s:
        return fallback, "config"
    pts = sorted((float(b), float(t)) for b, t in plain_step_s)
    if len(pts) == 1:
        b0, t0 = pts[0]
        t1 = t0 / (1.0 + growth * (b0 - 1.0))
        slope, intercept, source = t1 * growth, t1 - t1 * growth, "prior"
    else:
        n = len(pts)
        mb, mt = sum(b for b, _ in pts) / n, sum(t for _, t in pts) / n
        var = sum((b - mb) ** 2 for b, _ in pts)
        slope = sum((b - mb) * (t - mt) for b, t in pts) / var if var > 0 else 0.0
        intercept, source = mt - slope * mb, "measured"
    if slope <= 1e-12:  # step time does not grow with the batch (as far as measured)
        return (float(max_carry) if intercept <= slo_tpot_s else 1.0), source
    carry = (slo_tpot_s - intercept) / slope
    lowest = pts[0][0]
    if carry < lowest and lowest > 1.0:
        # Every measured batch is already past the objective and nothing smaller was measured: the
        # line's extrapolation downwards is not evidence (on an overloaded CPU it gave carry 1 from
        # points at batch 11.5 and 24); keep the config's carry, at most the smallest measured batch.
        return min(float(fallback), lowest), "config"
    return round(min(max(carry, 1.0), float(max_carry)), 3), source


def _worst(replicas: Sequence[ReplicaMetrics], attr: str, min_samples: int) -> float:
    vals = [getattr(r, attr) for r in replicas if r.finished >= min_samples and getattr(r, attr) >= 0]
    return max(vals) if vals else -1.0


# -- the decision ---------------------------------------------------------------------------------

def decide(
    snap: PoolSnapshot, cfg: AutoscalingConfig, state: PolicyState = PolicyState(), max_carry: float = 64.0,
) -> tuple[Verdict, PolicyState]:
    """The pool's replicas now, and why (see the module doc for the rules)."""
    target, running = snap.target_replicas, snap.running_replicas
    load = max(snap.load, 0.0)
    carry, source = replica_carry(snap.plain_step_s, cfg.slo_tpot_s, cfg.target_ongoing_requests, max_carry)
    tpot = _worst(snap.replicas, "tpot_p99_s", cfg.min_samples)
    ttft = _worst(snap.replicas, "ttft_p99_s", cfg.min_samples)
    goodput = sum(r.tokens_per_s for r in snap.replicas)
    accepted = sum(r.accepted_per_s for r in snap.replicas)
    mean_k = (sum(r.mean_k * r.tokens_per_s for r in snap.replicas) / goodput) if goodput > 0 else 0.0
    by_load = math.ceil(load / carry - 1e-9) if load > 0 else 0
    carried = f"{carry:.1f} carried per replica without speculation ({source})"

    # 1-5: what the pool should run, and why
    slips = []
    if cfg.slo_tpot_s is not None and tpot > cfg.slo_tpot_s:
        slips.append(f"p99 TPOT {tpot:.3f} s > SLO {cfg.slo_tpot_s:.3f} s")
    if cfg.slo_ttft_s is not None and ttft > cfg.slo_ttft_s:
        slips.append(f"p99 TTFT {ttft:.2f} s > SLO {cfg.slo_ttft_s:.2f} s")
    if running < target:
        want = max(target, by_load)
        why = f"scale-up under way ({running} of {target} running); load {load:.1f}, {carried}"
    elif slips:
        want = max(target + 1, by_load)
        why = "; ".join(slips) + f"; load {load:.1f}"
    elif by_load > target:
        want = by_load
        why = f"load {load:.1f} > {target} x {carried}"
    else:
        fewer = max(math.ceil(load / (carry * cfg.downscale_headroom) - 1e-9), 0)
        calm = all(slo is None or p < 0 or p <= cfg.downscale_headroom * slo
                   for p, slo in ((tpot, cfg.slo_tpot_s), (ttft, cfg.slo_ttft_s)))
        if fewer < target and calm:
            want = fewer
            why = f"load {load:.1f} fits {max(fewer, cfg.min_replicas)} at {cfg.downscale_headroom:.0%} of {carried}"
        else:
            want = target
            why = f"load {load:.1f} within {target} x {carried}"
            if slips == [] and tpot >= 0 and cfg.slo_tpot_s is not None:
                why += f"; p99 TPOT {tpot:.3f} s <= {cfg.slo_tpot_s:.3f} s"
    bounded = min(max(want, cfg.min_replicas), cfg.max_replicas)
    if bounded != want:
        why += f" (bounded to {bounded}: min {cfg.min_replicas}, max {cfg.max_replicas})"
    want = bounded

    # delays: a change must be wanted continuously before it is applied
    if want == target:
        replicas, action, new_state = target, "hold", PolicyState()
    else:
        up = want > target
        delay = cfg.upscale_delay_s if up else cfg.downscale_delay_s
        same_way = state.want is not None and state.since_s is not None and (state.want > target) == up
        since = state.since_s if same_way else snap.now_s
        waited = snap.now_s - since
        if waited + 1e-6 >= delay:
            replicas, action, new_state = want, "up" if up else "down", PolicyState()
        else:
            replicas, action, new_state = target, "pending-up" if up else "pending-down", PolicyState(want, since)
            why = f"{why} (wanted for {waited:.0f} of {delay:.0f} s)"
    reason = f"{action} {target}->{want}: {why}" if want != target else f"hold {target}: {why}"
    verdict = Verdict(replicas=replicas, want=want, action=action, reason=reason, load=round(load, 3), carry=carry,
                      carry_source=source, goodput_tokens_per_s=round(goodput, 3), accepted_per_s=round(accepted, 3),
                      tpot_p99_s=tpot, ttft_p99_s=ttft, mean_k=round(mean_k, 3))
    return verdict, new_state


# -- the router's side ----------------------------------------------------------------------------

def effective_replicas(record: Optional[Mapping[str, Any]], configured: int, now_unix_s: float,
                       max_age_s: float = 30.0) -> int:
    """Replicas whose capacity the router counts on: the autoscaler's decided target (a scale-up
    still starting included, a scale-down already draining excluded), or `configured` when there is
    no fresh record (autoscaler silent, Redis down: fail open to the static view).

    >>> effective_replicas({"target": 2, "running": 1, "time_unix_s": 100.0}, 1, 101.0)
    2
    >>> effective_replicas({"target": 2, "running": 1, "time_unix_s": 10.0}, 1, 101.0)
    1
    >>> effective_replicas({"target": float("inf"), "time_unix_s": 100.0}, 1, 101.0)  # not a count
    1
    """
    if not record or not isinstance(record, Mapping):
        return configured
    try:
        age = now_unix_s - float(record["time_unix_s"])
        target = float(record["target"])
    except (KeyError, TypeError, ValueError, OverflowError):
        return configured
    if not (math.isfinite(age) and abs(age) <= max_age_s and 0 <= target <= MAX_REPLICAS and target == int(target)):
        return configured
    return max(int(target), 1)


def with_capacity(views: list, records: Mapping[str, Mapping[str, Any]], now_unix_s: float,
                  max_age_s: float = 30.0) -> list:
    """`views` (cluster.routing.route.PoolView) with `replicas` from the autoscaler's records by pool name."""
    return [replace(v, replicas=effective_replicas(records.get(v.name), v.replicas, now_unix_s, max_age_s))
            for v in views]


def plain_step_points(view: Any, min_steps: int = 100) -> tuple[tuple[float, float], ...]:
    """(representative batch, plain step time s) per load bucket of a `cluster.policy.TuningView`
    with at least `min_steps` plain-decoding steps (summed over workload classes)."""
    out = []
    for bucket in BUCKET_NAMES:
        cell = view.merged("none", bucket)
        if cell.steps >= min_steps and cell.step_s:
            out.append((BUCKET_BATCH[bucket], round(cell.step_s, 6)))
    return tuple(out)


# -- the engine's side ----------------------------------------------------------------------------

class LatencyWindow:
    """Finished requests of one engine replica over the last `window_s` seconds, summarised as the
    metrics `ReplicaMetrics` names (time is passed in: monotonic seconds of the replica)."""

    def __init__(self, window_s: float = 30.0, max_entries: int = 20000):
        self.window_s = window_s
        self.max_entries = max_entries
        self._entries: list[tuple[float, float, float, int, int, int]] = []  # (end, tpot, ttft, tokens, accepted, k)
        self._started: Optional[float] = None

    def add(self, end_s: float, ttft_s: float, decode_s: float, tokens: int, accepted: int, k: int) -> None:
        """One finished request: TTFT at the engine, decode time after the first token, output tokens."""
        if self._started is None:
            self._started = end_s - max(ttft_s + decode_s, 0.0)
        tpot = decode_s / (tokens - 1) if tokens > 1 else -1.0
        self._entries.append((end_s, tpot, ttft_s, int(tokens), int(accepted), int(k)))
        if len(self._entries) > self.max_entries:
            del self._entries[: len(self._entries) - self.max_entries]

    def summary(self, now_s: float) -> dict[str, float]:
        cut = now_s - self.window_s
        self._entries = [e for e in self._entries if e[0] >= cut]
        es = self._entries
        span = min(self.window_s, max(now_s - self._started, 1.0)) if self._started is not None else self.window_s
        tokens = sum(e[3] for e in es)
        return {
            "finished": float(len(es)),
            "tokens_per_s": round(tokens / span, 4),
            "accepted_per_s": round(sum(e[4] for e in es) / span, 4),
            "tpot_p99_s": _p99([e[1] for e in es if e[1] >= 0]),
            "ttft_p99_s": _p99([e[2] for e in es]),
            "mean_k": round(sum(e[5] * e[3] for e in es) / tokens, 4) if tokens else 0.0,
        }


def _p99(xs: list[float]) -> float:
    """Nearest-rank p99 (-1.0 for no sample)."""
    return round(percentile(xs, 99, "nearest_rank"), 6) if xs else -1.0
