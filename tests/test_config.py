from tests.paths import LOCAL_CPU
from pathlib import Path

import pytest
import yaml

from cluster.config import ConfigError, load_config, parse_config
from cluster.speculation import SpecMode
from tests.paths import LOCAL_CPU

CONFIGS = Path(__file__).resolve().parents[1] / "cluster" / "configs"


def base() -> dict:
    return yaml.safe_load(LOCAL_CPU.read_text())


def test_shipped_configs_load():
    for path in CONFIGS.glob("*.yaml"):
        cfg = load_config(path)
        assert cfg.pools, path


def test_local_config_pools_and_modes():
    cfg = load_config(LOCAL_CPU)
    assert [m.value for m in cfg.pools["ngram"].modes] == ["ngram", "suffix", "none"]
    # auto drafts by suffix or not at all on the n-gram pool; explicit n-gram requests still work
    from cluster.routing.route import pool_views
    views = {v.name: v for v in pool_views(cfg)}
    assert views["ngram"].auto_skips == (SpecMode.NGRAM,) and views["draft"].auto_skips == ()
    cfg2 = parse_config({**base(), "pools": {**base()["pools"], "ngram": {**base()["pools"]["ngram"], "suffix": {}}}})
    assert {v.name: v for v in pool_views(cfg2)}["ngram"].auto_skips == ()
    assert cfg.pools["draft"].drafter == "smollm2-135m-eagle"
    assert cfg.pools["draft"].method.value == "eagle"
    assert cfg.models["smollm2-135m-eagle"].source.startswith("shipped:smollm2-135m:")
    assert cfg.served_models() == ["smollm2-135m"]


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda c: c["pools"]["ngram"].update(method="medusa2"), "pools.ngram.method"),
        (lambda c: c["pools"]["ngram"].update(max_k=0), "pools.ngram"),
        (lambda c: c["pools"]["ngram"].update(max_k=99), "pools.ngram.max_k"),
        (lambda c: c["pools"]["draft"].pop("drafter"), "pools.draft"),
        (lambda c: c["pools"]["ngram"].update(model="nope"), "pools.ngram.model"),
        (lambda c: c["pools"]["ngram"].update(bundles=[]), "pools.ngram.bundles"),
        (lambda c: c["pools"]["ngram"].update(bundles=[{"CPU": -1}]), "pools.ngram.bundles"),
        (lambda c: c["pools"]["ngram"].update(placement_strategy="ANY"), "pools.ngram.placement_strategy"),
        (lambda c: c["pools"]["ngram"].update(replicass=2), "pools.ngram.replicass"),
        (lambda c: c["router"].update(default_mode="fast"), "router.default_mode"),
        (lambda c: c["router"].update(default_k={"ngram": 40}), "router.default_k"),
        (lambda c: c["api"].update(http_port=70000), "api.http_port"),
        (lambda c: c["models"]["smollm2-135m-eagle"].update(source="shipped:missing:data/drafters/x"),
         "models.smollm2-135m-eagle.source"),
        (lambda c: c["models"]["smollm2-135m-eagle"].update(source="truncate:missing:4"),
         "models.smollm2-135m-eagle.source"),
        (lambda c: c["pools"]["ngram"].update(autoscaling={"min_replicas": 3, "max_replicas": 1}),
         "pools.ngram.autoscaling"),
        (lambda c: c["pools"]["ngram"]["engine_kwargs"].update(trust_remote_code=True), "pools.ngram"),
    ],
)
def test_bad_config_names_the_field(mutate, field):
    raw = base()
    mutate(raw)
    with pytest.raises(ConfigError) as e:
        parse_config(raw)
    assert field in str(e.value), str(e.value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_trust_remote_code_only_on_models_that_say_so():
    """Off unless a model asks for it; in the shipped configs only MiMo-7B does (its config class is
    code in its checkpoint), with the reason beside it."""
    for path in CONFIGS.glob("*.yaml"):
        cfg = load_config(path)
        trusted = sorted(name for name, m in cfg.models.items() if m.trust_remote_code)
        assert trusted == (["mimo-7b-rl"] if path.stem == "gpu-example" else []), path
    text = (CONFIGS / "gpu-example.yaml").read_text()
    before = text[:text.index("trust_remote_code: true")].rsplit("mimo-7b-rl:", 1)[1]
    assert "transformers" in before  # the reason is written beside it


def test_the_router_admits_what_its_pools_admit_unless_told():
    """Unset, a router replica admits every pool's capacity at its most replicas (so the pool's own
    queue bound, which answers 429, is reachable) plus its own calls; a set value is kept."""
    from cluster.config import ROUTER_OWN_CALLS

    raw = yaml.safe_load(LOCAL_CPU.read_text())
    cfg = parse_config(raw)
    assert cfg.router.max_ongoing_requests is None
    assert cfg.router_max_ongoing() == ROUTER_OWN_CALLS + (64 + 256) + (32 + 128)
    raw["pools"]["ngram"]["autoscaling"] = {"min_replicas": 1, "max_replicas": 3}
    assert parse_config(raw).router_max_ongoing() == ROUTER_OWN_CALLS + (3 * 64 + 256) + (32 + 128)
    raw["pools"]["draft"]["max_queued_requests"] = -1  # unbounded: adds only what its replicas run
    assert parse_config(raw).router_max_ongoing() == ROUTER_OWN_CALLS + (3 * 64 + 256) + 32
    raw["router"]["max_ongoing_requests"] = 100
    assert parse_config(raw).router_max_ongoing() == 100
    raw["router"]["max_ongoing_requests"] = 0
    with pytest.raises(ConfigError, match="max_ongoing_requests"):
        parse_config(raw)
