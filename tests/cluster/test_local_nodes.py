"""Local multi-node clusters: the config section, the placement check, the node processes (their
start, join wait and stop, with a stand-in that forks a child like a raylet)."""

from __future__ import annotations

import os
import stat
import time

import pytest
import yaml

from cluster.config import ConfigError, load_config, parse_config
from cluster.config_sections import LocalNodeConfig
from cluster.ops.local_nodes import LocalNodes
from cluster.ops.placement import placement_problems, router_deployment_options
from cluster.ops.ray_driver import ray_init_kwargs
from tests.paths import CONFIGS, LOCAL_CPU

MULTINODE = CONFIGS / "local-multinode.yaml"


def _raw(path=LOCAL_CPU) -> dict:
    return yaml.safe_load(path.read_text())


def _error(raw: dict) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(raw)
    return str(e.value)


def _nodes_of(cfg) -> list[dict[str, float]]:
    """Each node's total resources as Ray reports them, from the config's own ray section."""
    head = {"CPU": float(cfg.ray.num_cpus or 1), **cfg.ray.head_resources}
    return [head] + [{"CPU": float(n.num_cpus), **n.resources} for n in cfg.ray.nodes]


def test_the_multinode_config_places_every_replica_on_its_nodes():
    cfg = load_config(str(MULTINODE))
    assert [n.name for n in cfg.ray.nodes] == ["target-1", "target-2", "drafter"]
    assert placement_problems(cfg, _nodes_of(cfg)) == []
    assert router_deployment_options(cfg)["ray_actor_options"]["resources"] == {"specserve_head": 0.01}
    kwargs = ray_init_kwargs(cfg, pythonpath="/x")
    assert kwargs["resources"] == {"specserve_head": 1.0} and kwargs["_node_name"] == "head"


def test_the_gpu_config_names_the_resources_local_nodes_advertise():
    gpu = load_config(str(CONFIGS / "gpu-example.yaml"))
    local = load_config(str(MULTINODE))
    gpu_names = {r for p in gpu.pools.values() for b in p.bundles for r in b} | {
        r for d in gpu.drafters.values() for r in d.resources}
    local_names = {r for n in local.ray.nodes for r in n.resources}
    assert local_names <= gpu_names, local_names - gpu_names


def test_a_replica_that_fits_no_node_is_named_with_its_resource():
    cfg = load_config(str(MULTINODE))
    nodes = [n for n in _nodes_of(cfg) if "specserve_drafter" not in n]
    assert placement_problems(cfg, nodes) == [
        "drafter 'l4': a replica needs specserve_drafter 1 on one node; the most any node has is 0"]
    nodes = [{"CPU": 1.0}, {"CPU": 1.0, "specserve_drafter": 1.0}]
    problems = placement_problems(cfg, nodes)
    assert problems[0].startswith("pool 'ngram': a replica needs specserve_target 1") and len(problems) == 3


def test_strict_pack_bundles_must_fit_one_node_together():
    raw = _raw()
    raw["pools"]["ngram"]["bundles"] = [{"CPU": 1}, {"CPU": 1}]
    cfg = parse_config(raw)
    assert placement_problems(cfg, [{"CPU": 1.0}, {"CPU": 1.0}])[0].startswith("pool 'ngram': a replica needs CPU 2")
    assert placement_problems(cfg, [{"CPU": 2.0}]) == []
    raw["pools"]["ngram"]["placement_strategy"] = "PACK"
    assert placement_problems(parse_config(raw), [{"CPU": 1.0}, {"CPU": 1.0}]) == []
    raw["pools"]["ngram"]["bundles"] = [{"CPU": 1, "GPU": 1}]
    assert "needs GPU 1 on one node; the most any node has is 0" in placement_problems(parse_config(raw), [{"CPU": 4.0}])[0]


@pytest.mark.parametrize("change, field", [
    (lambda r: r["ray"].update(address="auto", nodes=[{"name": "a"}]), "nodes"),
    (lambda r: r["ray"].update(nodes=[{"name": "a"}, {"name": "a"}]), "nodes"),
    (lambda r: r["ray"].update(nodes=[{"name": "head"}]), "nodes"),
    (lambda r: r["ray"].update(nodes=[{"name": "Bad Name"}]), "name"),
    (lambda r: r["ray"].update(nodes=[{"name": "a", "resources": {"GPU": 1}}]), "resources"),
    (lambda r: r["ray"].update(nodes=[{"name": "a", "resources": {"x": 0}}]), "resources"),
    (lambda r: r["ray"].update(head_resources={"CPU": 1}), "head_resources"),
    (lambda r: r["router"].update(resources={"node:127.0.0.1": 1}), "resources"),
])
def test_bad_node_sections_are_refused_naming_the_field(change, field):
    raw = _raw()
    change(raw)
    assert field in _error(raw)


def _fake_ray(tmp_path, body: str) -> str:
    """A stand-in for the node process's interpreter: a shell script (it ignores its arguments)."""
    path = tmp_path / "ray"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is not running
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_stop_ends_every_process_of_each_node(tmp_path):
    """A node process that ignores SIGTERM and has a child (its raylet, say) is killed whole."""
    # The pid goes to a temporary name first and is renamed, so a file under the final name is never empty.
    ray_bin = _fake_ray(tmp_path, "trap '' TERM\nsleep 300 &\necho $! > \"$0.tmp.$$\"\n"
                                  "mv \"$0.tmp.$$\" \"$0.child.$$\"\nwait\n")
    nodes = LocalNodes.start([LocalNodeConfig(name="a"), LocalNodeConfig(name="b")], "127.0.0.1:1", "127.0.0.1",
                             tmp_path / "logs", python=ray_bin)
    deadline = time.monotonic() + 10
    while len(list(tmp_path.glob("ray.child.*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    children = [int(p.read_text()) for p in tmp_path.glob("ray.child.*")]
    parents = [n.proc.pid for n in nodes.nodes]
    assert len(children) == 2 and all(_alive(p) for p in children + parents)
    t0 = time.monotonic()
    nodes.stop(grace_s=0.5)
    assert time.monotonic() - t0 < 8
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in children + parents) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in children + parents)
    assert (tmp_path / "logs" / "node-a.log").exists()


def test_wait_joined_names_a_node_that_exited_or_never_joined(tmp_path):
    dead = LocalNodes.start([LocalNodeConfig(name="a")], "127.0.0.1:1", None, tmp_path, python=_fake_ray(tmp_path, "exit 3\n"))
    with pytest.raises(RuntimeError, match=r"ray node 'a' exited with 3"):
        dead.wait_joined(lambda: [], timeout_s=10)
    dead.stop()
    slow = LocalNodes.start([LocalNodeConfig(name="a"), LocalNodeConfig(name="b")], "127.0.0.1:1", None, tmp_path,
                            python=_fake_ray(tmp_path, "sleep 30\n"))
    try:
        with pytest.raises(RuntimeError, match=r"ray nodes \['b'\] did not join within 0.3 s"):
            slow.wait_joined(lambda: ["head", "a"], timeout_s=0.3, poll_s=0.05)
        slow.wait_joined(lambda: ["a", "b"], timeout_s=1)
    finally:
        slow.stop(grace_s=1)
