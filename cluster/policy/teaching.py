"""What traffic teaches the tuner: a finished request's statistics move the shared tuning cells only
when the router, not the caller, chose what they measure, and each client's weight is bounded.

Words: a request *teaches* when its SpecStats are recorded into the tuning cell of its (mode,
workload class, load bucket), which every later `auto` decision of that class reads; otherwise it
is *excluded*, for the first reason of `EXCLUSION_REASONS` that applies (counted in
`specserve_tuning_excluded{reason}`). A *client* is who sent the request: its API key's label when
keys are on, else its peer address as the front door saw it (`client_id`).

Why each rule (a caller can set each of these on every request):
- `caller_mode`: a K the caller named (`decided_by == "request"`, K > 0) measures the caller's
  choice; K = 6 on prompts that reject files six rejected drafts per step under the class. A
  caller's plain decoding (K = 0) teaches: it drafts nothing, so it measures only the plain step
  time at the load it met.
- `caller_class`: a `workload_class` hint the classifier disagrees with would file one class's
  acceptance under another. A hint the classifier agrees with teaches: it changes nothing.
- `ignore_eos`: text generated past the end of the answer loops and repeats, which n-gram drafts
  accept far more often than they accept the answer.
- `temperature`: sampled hotter than `max_temperature`, acceptance falls with the temperature;
  greedy and moderate sampling are the traffic the cells describe.
- `client_budget`: past its token bucket (`ClientBudget`), a client's requests are served but
  teach nothing, so one key or address cannot outweigh the rest by volume alone.

A *trusted* client (router.teaching.trusted_clients, e.g. a calibration or benchmark key) is exempt
from `caller_mode`, `caller_class` and its budget, not from the rules about the text it makes.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Iterable, Optional

EXCLUSION_REASONS = ("caller_mode", "caller_class", "ignore_eos", "temperature", "client_budget")
MAX_CLIENTS = 1024  # buckets kept per router replica; clients beyond share one (`ClientBudget`)
OTHERS = "others"  # the shared bucket's name
_MAX_CLIENT_CHARS = 96


@dataclass(frozen=True)
class Lesson:
    """What the rule reads of one finished request."""

    decided_by: str  # Decision.decided_by: "policy", "default" (the configured mode) or "request"
    k: int  # the decision's K (0: plain decoding)
    classified: str  # the workload class the router's classifier gave the prompt
    class_hint: Optional[str]  # the caller's workload_class, if it sent one
    temperature: float
    ignore_eos: bool

    @classmethod
    def of(cls, req: Any, decision: Any) -> "Lesson":
        """From a GenerateRequest and the router's Decision (whose detail holds `classified`)."""
        detail = decision.detail or {}
        return cls(decided_by=decision.decided_by, k=int(decision.k),
                   classified=detail.get("classified", decision.workload_class),
                   class_hint=req.workload_class, temperature=float(req.temperature), ignore_eos=bool(req.ignore_eos))


def teaches_tuner(lesson: Lesson, max_temperature: float, trusted: bool = False) -> Optional[str]:
    """None when the request may teach the tuner, else the first reason of EXCLUSION_REASONS that
    excludes it (the budget is `ClientBudget`'s, applied after this). `trusted`: its client is
    exempt from the caller_mode and caller_class rules.

    >>> ok = Lesson("policy", 3, "code", None, 0.0, False)
    >>> teaches_tuner(ok, 1.0) is None
    True
    >>> from dataclasses import replace
    >>> [teaches_tuner(replace(ok, **c), 1.0) for c in ({"decided_by": "request"}, {"class_hint": "translation"},
    ...  {"class_hint": "code"}, {"ignore_eos": True}, {"temperature": 1.5}, {"decided_by": "default"},
    ...  {"decided_by": "request", "k": 0})]
    ['caller_mode', 'caller_class', None, 'ignore_eos', 'temperature', None, None]
    >>> teaches_tuner(replace(ok, decided_by="request", class_hint="qa"), 1.0, trusted=True) is None
    True
    """
    if not trusted and lesson.decided_by == "request" and lesson.k > 0:
        return "caller_mode"
    if not trusted and lesson.class_hint is not None and lesson.class_hint != lesson.classified:
        return "caller_class"
    if lesson.ignore_eos:
        return "ignore_eos"
    if not lesson.temperature <= max_temperature:
        return "temperature"
    return None


def client_id(key_label: Optional[str], peer: Any) -> str:
    """Who sent a request: `key:<label>` when an API key matched, else `peer:<host>` from the
    front door's peer (gRPC `ipv4:10.0.0.7:51234` / `ipv6:[::1]:51234`, HTTP `(host, port)`),
    without the port, else `unknown`. Bounded in length.

    >>> client_id("team-a", "ipv4:10.0.0.7:5"), client_id(None, "ipv4:10.0.0.7:51234")
    ('key:team-a', 'peer:10.0.0.7')
    >>> client_id(None, "ipv6:[::1]:51234"), client_id(None, ("10.0.0.8", 40000)), client_id(None, None)
    ('peer:::1', 'peer:10.0.0.8', 'unknown')
    """
    if key_label:
        return f"key:{key_label}"[:_MAX_CLIENT_CHARS]
    if isinstance(peer, (tuple, list)) and peer:
        host = str(peer[0])
    elif isinstance(peer, str) and peer:
        kind, _, rest = peer.partition(":")
        if kind == "ipv6" and rest.startswith("["):
            host = rest[1:].partition("]")[0]
        elif kind == "ipv4":
            host = rest.rpartition(":")[0] or rest
        else:
            host = peer
    else:
        return "unknown"
    return f"peer:{host}"[:_MAX_CLIENT_CHARS]


class ClientBudget:
    """A token bucket per client: on average `rate_per_s` teaching requests a second, at most
    `burst` at once; `rate_per_s` 0 bounds nothing. At most `max_clients` buckets are kept (and the
    shared one): a bucket
    that has refilled is forgotten first (a full bucket is a new one), and while every kept bucket
    is in use, new clients share one bucket (OTHERS), so fresh identities buy no extra weight.
    Pure bookkeeping with explicit times; O(1) per request.

    >>> b = ClientBudget(rate_per_s=1.0, burst=2, max_clients=1)
    >>> [b.take("a", now=0.0) for _ in range(3)], b.take("a", now=1.0)
    ([True, True, False], True)
    >>> [b.take(c, now=1.0) for c in ("b", "c", "d")]  # "a" is in use: new clients share one bucket
    [True, True, False]
    """

    def __init__(self, rate_per_s: float, burst: int, max_clients: int = MAX_CLIENTS):
        self.rate_per_s, self.burst, self.max_clients = float(rate_per_s), float(burst), int(max_clients)
        self._buckets: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()  # (tokens, t)

    def _level(self, key: str, now: float) -> float:
        tokens, t = self._buckets.get(key, (self.burst, now))
        return min(self.burst, tokens + max(now - t, 0.0) * self.rate_per_s)

    def take(self, client: str, now: float) -> bool:
        """Whether `client` may teach now (and spend one token if so)."""
        if self.rate_per_s <= 0:
            return True
        key = client
        if key not in self._buckets and len(self._buckets) >= self.max_clients:
            oldest = next(iter(self._buckets))
            if oldest != OTHERS and self._level(oldest, now) >= self.burst:
                del self._buckets[oldest]
            else:
                key = OTHERS
        level = self._level(key, now)
        ok = level >= 1.0
        self._buckets[key] = (level - 1.0 if ok else level, now)
        self._buckets.move_to_end(key)
        return ok

    def __len__(self) -> int:
        return len(self._buckets)


class Teacher:
    """The rule and the budget together, with counts of what was excluded and why."""

    def __init__(self, max_temperature: float, client_rate_per_s: float, client_burst: int,
                 trusted_clients: Iterable[str] = (), max_clients: int = MAX_CLIENTS):
        self.max_temperature = max_temperature
        self.trusted = frozenset(trusted_clients)  # client ids (`client_id`) exempt from the caller rules
        self.budget = ClientBudget(client_rate_per_s, client_burst, max_clients)
        self.excluded: collections.Counter = collections.Counter()  # reason -> requests

    @classmethod
    def from_config(cls, teaching: Any) -> "Teacher":
        """From a `TeachingConfig` (router.teaching)."""
        return cls(teaching.max_temperature, teaching.client_rate_per_s, teaching.client_burst,
                   teaching.trusted_clients)

    def exclusion(self, lesson: Lesson, client: str, now: float) -> Optional[str]:
        """None when the request teaches (a token of its client spent), else why not (counted)."""
        trusted = client in self.trusted
        why = teaches_tuner(lesson, self.max_temperature, trusted)
        if why is None and not trusted and not self.budget.take(client, now):
            why = "client_budget"
        if why is not None:
            self.excluded[why] += 1
        return why
