"""`tools.bench.phases.forget`: which load phases ask the cluster's suffix trees to forget."""

import asyncio
from types import SimpleNamespace

from tools.bench import plan as P
from tools.bench.phases import forget


class _Client:
    def __init__(self, fail: bool = False):
        self.calls, self.fail = 0, fail

    async def forget_outputs(self):
        self.calls += 1
        if self.fail:
            raise RuntimeError("no such route")
        return {"pools": {"ngram": {"forgotten": 3}}}


def _run(cfg, keep=False, fail=False, answered=None, repeat=False):
    client = _Client(fail)
    answered = {"suffix:16"} if answered is None else answered
    asyncio.run(forget(SimpleNamespace(client=client), cfg, SimpleNamespace(keep_outputs=keep), answered, repeat))
    return client.calls


def test_cluster_phases_forget_after_another_cluster_config_stock_ones_and_keep_outputs_do_not():
    auto = P.BenchConfig("auto", None, None)
    assert _run(auto) == 1
    assert _run(P.baseline_config("stock-table")) == 0  # a stock server has no such route
    assert _run(auto, keep=True) == 0
    assert _run(auto, answered={"auto"}) == 0  # its own answers to other prompts: kept, like stock's
    assert _run(auto, answered={"auto"}, repeat=True) == 1  # prompts come round again


def test_forget_outputs_forgets_before_every_cluster_phase_and_keep_outputs_wins():
    auto, client, answered = P.BenchConfig("auto", None, None), _Client(), {"auto"}
    # --forget-outputs reaches forget as prompts_repeat (phases._measure)
    asyncio.run(forget(SimpleNamespace(client=client), auto, SimpleNamespace(keep_outputs=False), answered, True))
    assert client.calls == 1 and answered == {"auto"}
    asyncio.run(forget(SimpleNamespace(client=client), auto, SimpleNamespace(keep_outputs=True), answered, True))
    assert client.calls == 1


def test_answered_tracks_what_the_trees_hold_across_a_round():
    auto, fixed, stock = P.BenchConfig("auto", None, None), P.BenchConfig("suffix:16", "suffix", 16), \
        P.baseline_config("stock-suffix")
    client, args, answered = _Client(), SimpleNamespace(keep_outputs=False), set()
    calls = []
    for cfg in (auto, stock, fixed, auto, auto):
        asyncio.run(forget(SimpleNamespace(client=client), cfg, args, answered, False))
        calls.append(client.calls)
    assert calls == [0, 0, 1, 2, 2] and answered == {"auto"}


def test_a_cluster_without_the_route_is_measured_anyway(capsys):
    assert _run(P.BenchConfig("auto", None, None), fail=True) == 1
    assert "could not make the suffix trees forget" in capsys.readouterr().err
