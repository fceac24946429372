"""The Serve config rendered into the CPU overlay's RayService, run locally with Ray's own
`serve run`, serves requests (the same config Kubernetes would run; only the listen address and
ports are changed so it can run beside the session's cluster). Its in-cluster Redis does not exist
here, so this also shows the router serving on defaults without its tuning state."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.conftest import ROOT, _free_port

pytestmark = pytest.mark.engine

RENDERED = ROOT / "k8s" / "rendered" / "cpu-dev.yaml"


def _serve_config() -> dict:
    for doc in yaml.safe_load_all(RENDERED.read_text()):
        if doc and doc.get("kind") == "RayService":
            return yaml.safe_load(doc["spec"]["serveConfigV2"])
    raise AssertionError("no RayService in the cpu-dev overlay")


def test_rendered_cpu_serve_config_serves_with_serve_run(tmp_path: Path):
    serve = _serve_config()
    http_port, grpc_port = _free_port(), _free_port()
    serve["http_options"].update(host="127.0.0.1", port=http_port)
    serve["grpc_options"]["port"] = grpc_port
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(serve))
    log_path = tmp_path / "serve-run.log"
    serve_bin = str(Path(sys.executable).parent / "serve")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([serve_bin, "run", str(path), "--address", "local"], stdout=log,
                                stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 600
        body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
        while True:
            assert proc.poll() is None, f"serve run exited:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"not serving after 600 s:\n{log_path.read_text()[-3000:]}"
            try:
                r = httpx.post(f"http://127.0.0.1:{http_port}/v1/chat/completions", json=body, timeout=120)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(5)
        s = r.json()["specserve"]
        assert r.json()["choices"][0]["message"]["content"] and s["pool"] in ("ngram", "draft")
        models = httpx.get(f"http://127.0.0.1:{http_port}/v1/models", timeout=30).json()
        assert models["data"][0]["id"] == "smollm2-135m"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
