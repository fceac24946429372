"""An engine replica's start: vLLM's AsyncLLM built for a pool's engine arguments (`start_vllm`), run in a
thread and bounded by the pool's `startup_timeout_s` (`within_startup_timeout`), past which the replica
fails with `EngineStartTimeout` naming that field. `deployments.app.EngineReplica` starts its engine
through them and hands it to `deployments.engine.EngineServer`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from cluster.ops.cpu_pinning import restore_node_cpus

log = logging.getLogger("specserve.engine")


class EngineStartTimeout(RuntimeError):
    """An engine replica did not prepare its model and start its engine within startup_timeout_s."""


def start_vllm(pool_name: str, kwargs: dict[str, Any]) -> Any:
    """vLLM's AsyncLLM for `kwargs` (blocks while it loads the model and warms up)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    t0 = time.monotonic()
    restore_node_cpus()  # `ray.pin_serving_cpus`: the engine's worker binds within the node's cores
    log.info("pool %s: starting vLLM engine %s", pool_name, kwargs)
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
    log.info("pool %s: engine up in %.1f s", pool_name, time.monotonic() - t0)
    return engine


async def within_startup_timeout(pool_name: str, timeout_s: float, start: Callable[[], Any]) -> Any:
    """Run the blocking `start` in a thread; past `timeout_s`, fail with EngineStartTimeout naming the
    field (vLLM's own wait for its engine core has no bound until the model is loaded). Serve then
    stops the replica, which takes its engine core with it, and starts another.

    >>> asyncio.run(within_startup_timeout("p", 5, lambda: "engine"))
    'engine'
    >>> asyncio.run(within_startup_timeout("p", 0.01, lambda: time.sleep(0.5)))
    Traceback (most recent call last):
    ...
    deployments.engine_start.EngineStartTimeout: pools.p.startup_timeout_s: the engine did not start within 0.01 s
    """
    try:
        return await asyncio.wait_for(asyncio.to_thread(start), timeout=timeout_s)
    except asyncio.TimeoutError:
        raise EngineStartTimeout(
            f"pools.{pool_name}.startup_timeout_s: the engine did not start within {timeout_s:g} s") from None
