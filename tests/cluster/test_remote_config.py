"""Config and placement of disaggregated drafting: `drafters:` deployments, pools with
`method: remote_draft` naming one, errors that name the field, and the engine/deployment options."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tools.bench.remote import bench_config
from cluster.config import ConfigError, parse_config
from cluster.ops.placement import drafter_deployment_options, required_resources
from cluster.speculation import SpecMode
from deployments.engine import engine_kwargs
from tests.paths import LOCAL_CPU

LOCAL = LOCAL_CPU


def remote_raw() -> dict:
    return bench_config(yaml.safe_load(LOCAL.read_text()), 1, 2, 3, 4, timeout_s=0.5)


def test_a_remote_pool_is_the_draft_pool_with_its_drafter_in_a_deployment():
    cfg = parse_config(remote_raw())
    remote, draft = cfg.pools["remote"], cfg.pools["draft"]
    assert remote.method == SpecMode.REMOTE_DRAFT and remote.remote_drafter == "bench"
    assert cfg.drafters["bench"].model == draft.drafter
    assert [m.value for m in remote.modes] == ["remote_draft", "none"]
    assert remote.max_k == draft.max_k


@pytest.mark.parametrize("mutate, field", [
    (lambda r: r["pools"]["remote"].update(remote_drafter="nope"), "pools.remote.remote_drafter"),
    (lambda r: r["pools"]["remote"].pop("remote_drafter"), "remote_drafter"),
    (lambda r: r["pools"]["draft"].update(remote_drafter="bench"), "remote_drafter"),
    (lambda r: r["drafters"]["bench"].update(model="nope"), "drafters.bench.model"),
    (lambda r: r["drafters"]["bench"].update(resources={"GPU": -1}), "drafters.bench.resources"),
    (lambda r: r["pools"]["remote"].update(remote_timeout_s=0), "pools.remote.remote_timeout_s"),
    (lambda r: r["drafters"]["bench"].update(max_k=2), "pools.remote.max_k"),  # the pool asks for more
    (lambda r: r["drafters"]["bench"].update(wire={"max_tokens_per_call": 100}), "wire.max_tokens_per_call"),
    (lambda r: r["drafters"]["bench"].update(wire={"max_frame_bytes": 64 << 20}), "drafters.bench.wire.max_frame_bytes"),
    (lambda r: r["drafters"]["bench"].update(max_context=16384, wire={"max_tokens_per_call": 16384,
                                                                      "max_frame_bytes": 65536}), "wire.max_frame_bytes"),
    (lambda r: r["drafters"]["bench"].update(wire={"recv_timeout_s": 0}), "drafters.bench.wire.recv_timeout_s"),
])
def test_bad_remote_configs_name_the_field(mutate, field):
    raw = remote_raw()
    mutate(raw)
    with pytest.raises(ConfigError) as e:
        parse_config(raw)
    assert field in str(e.value)


def test_engine_of_a_remote_pool_loads_the_remote_proposer_with_its_timeout():
    pool = parse_config(remote_raw()).pools["remote"]
    kw = engine_kwargs(pool, "/m", None, "m")
    assert kw["speculative_config"] == {"method": "custom_class", "num_speculative_tokens": pool.max_k,
                                        "model": "cluster.engine.remote_proposer.RemoteDraftProposer"}
    assert kw["worker_extension_cls"] == "cluster.engine.remote_proposer.RemoteDraftWorkerExtension"
    assert kw["additional_config"]["specserve"]["remote_drafter"] == {"timeout_s": 0.5, "reprobe_s": 1.0}


def test_the_engine_config_names_no_secret():
    """vLLM logs its config: the wire's secret reaches the engine through its environment only."""
    pool = parse_config(remote_raw()).pools["remote"]
    assert "secret" not in str(engine_kwargs(pool, "/m", None, "m")).lower()


def test_a_drafter_replica_gets_its_wire_bounds_from_the_config(monkeypatch):
    import deployments.app as app

    seen = {}
    monkeypatch.setattr(app.DrafterServer, "__init__", lambda self, *a, **kw: seen.update(kw))
    monkeypatch.setattr("cluster.ops.models.resolve_model", lambda name, config: f"/models/{name}")
    monkeypatch.setattr("cluster.ops.logsafe.setup_replica_logging", lambda: None)  # the test process's logging stays
    raw = remote_raw()
    raw["drafters"]["bench"].update(max_k=6, wire={"max_connections": 9, "idle_timeout_s": 60})
    cfg = parse_config(raw)
    app.DrafterReplica("bench", cfg.drafters["bench"], cfg)
    assert seen["max_k"] == 6
    assert seen["wire"] == {"max_frame_bytes": 1 << 20, "max_tokens_per_call": 16384, "max_connections": 9,
                            "idle_timeout_s": 60.0, "recv_timeout_s": 5.0}


def test_drafter_deployment_options_carry_custom_resources_of_its_node_group():
    raw = remote_raw()
    raw["drafters"]["bench"]["resources"] = {"CPU": 2, "GPU": 1, "drafter_node": 1}
    raw["drafters"]["bench"]["replicas"] = 3
    cfg = parse_config(raw)
    opts = drafter_deployment_options("bench", cfg.drafters["bench"], {"X": "1"})
    assert opts["name"] == "drafter-bench" and opts["num_replicas"] == 3
    a = opts["ray_actor_options"]
    assert (a["num_cpus"], a["num_gpus"], a["resources"]) == (2.0, 1.0, {"drafter_node": 1})
    assert a["runtime_env"]["env_vars"]["X"] == "1"
    assert required_resources(cfg)["drafter_node"] == 3
