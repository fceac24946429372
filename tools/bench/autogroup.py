"""Whether the stock servers and the cluster's engines share a scheduler autogroup (Linux).

With `kernel.sched_autogroup_enabled=1` the kernel schedules each session as one group. A stock
server in another group than the cluster's engines lost its core for about 1 s whenever an idle
cluster engine ran its health probe and vLLM's worker busy-polled after it on the same core, so
the bench starts stock servers in its own session (`tools.bench.anchors.StockServer`) and warns
when its group differs from the engines'.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional


def autogroup_note(enabled: str, bench_group: Optional[str], engine_groups: set[str]) -> Optional[str]:
    """A warning when the stock servers (started in the bench's session) and the cluster's engines
    are scheduled in different autogroups; None when they share one, autogroup is off, or nothing
    is known. `enabled`: the text of /proc/sys/kernel/sched_autogroup_enabled; groups: the first
    word of /proc/PID/autogroup.

    >>> autogroup_note("1", "/autogroup-7", {"/autogroup-7"}) is None, autogroup_note("0", "/autogroup-7", {"/autogroup-9"})
    (True, None)
    >>> autogroup_note("1", "/autogroup-7", {"/autogroup-9"})[:40]
    'bench: the stock servers run in schedule'
    """
    if enabled.strip() != "1" or not bench_group or not engine_groups or engine_groups == {bench_group}:
        return None
    return (f"bench: the stock servers run in scheduler autogroup {bench_group}, the cluster's engines in "
            f"{', '.join(sorted(engine_groups))} (one per session): an idle cluster engine's health probe "
            "can then take a shared core from a stock server for about 1 s (a stall in its answer). Run "
            "the bench from the shell that started the cluster, or set kernel.sched_autogroup_enabled=0")


def local_autogroups() -> tuple[str, Optional[str], set[str]]:
    """(sched_autogroup_enabled, this process's autogroup, the autogroups of this machine's vLLM
    workers): what `autogroup_note` reads; empty where /proc does not say."""
    def group(pid: str) -> Optional[str]:
        try:
            return Path(f"/proc/{pid}/autogroup").read_text().split()[0]
        except (OSError, IndexError):
            return None

    try:
        enabled = Path("/proc/sys/kernel/sched_autogroup_enabled").read_text()
    except OSError:
        enabled = ""
    engines = set()
    for cmd in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if cmd.read_bytes().startswith(b"VLLM::Worker"):
                g = group(cmd.parent.name)
                if g:
                    engines.add(g)
        except OSError:
            continue
    return enabled, group("self"), engines
