"""cluster/ops/reaper.py on real processes: an orphaned grandchild is re-parented to a subreaper and
stopped by `reap_descendants`; one that ignores SIGTERM is killed after the grace period."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import psutil

# A child that spawns a grandchild and exits at once, orphaning it (what a Ray worker killed during
# engine start-up does to its vLLM engine process).
_SCRIPT = textwrap.dedent("""
    import json, subprocess, sys, time
    from cluster.ops import reaper
    subreaper = reaper.become_subreaper()
    grandchild = sys.argv[1]
    orphaner = subprocess.Popen([sys.executable, "-c",
        "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', sys.argv[1]], stdout=-3, stderr=-3); print(p.pid)",
        grandchild], stdout=subprocess.PIPE, text=True)
    pid = int(orphaner.stdout.readline())
    orphaner.wait()
    time.sleep(0.5)
    import psutil
    parent = psutil.Process(pid).ppid()
    left = reaper.reap_descendants(grace_s=1.0)
    print(json.dumps({"subreaper": subreaper, "orphan": pid, "orphan_parent": parent,
                      "reaped": [pid for pid, _ in left], "alive_after": psutil.pid_exists(pid)
                      and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE}))
""")


def _run(grandchild_code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, grandchild_code], capture_output=True, text=True,
                         timeout=60, cwd=__file__.rsplit("/tests/", 1)[0])
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if r["alive_after"]:  # the reaper missed it: do not leave it running past the failing test
        psutil.Process(r["orphan"]).kill()
    return r


def test_an_orphaned_grandchild_is_adopted_and_stopped():
    r = _run("import time; time.sleep(300)")
    assert r["subreaper"] is True  # Linux
    assert r["orphan_parent"] != 1  # adopted by the subreaper, not init
    assert r["orphan"] in r["reaped"]
    assert r["alive_after"] is False
    assert not psutil.pid_exists(r["orphan"]) or psutil.Process(r["orphan"]).status() == psutil.STATUS_ZOMBIE


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace_period():
    r = _run("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)")
    assert r["orphan"] in r["reaped"]
    assert r["alive_after"] is False


def test_nothing_left_means_nothing_reaped():
    from cluster.ops import reaper

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert reaper.reap_descendants(grace_s=0.1, pid=p.pid) == []  # a pid that is gone

