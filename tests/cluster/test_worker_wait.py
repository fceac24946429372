"""`cluster.engine.worker_wait`: the engine core's wait for its workers, on vLLM's real notification
sockets (`SpinCondition`, zmq over ipc), blocking against vLLM's own spin."""

import threading
import time

import pytest

from cluster.engine import worker_wait


@pytest.fixture
def pair():
    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    from vllm.utils.network_utils import get_open_zmq_ipc_path

    ctx = zmq.Context()
    address = get_open_zmq_ipc_path()
    writer = SpinCondition(is_reader=False, context=ctx, notify_address=address)
    reader = SpinCondition(is_reader=True, context=ctx, notify_address=address)
    time.sleep(0.2)  # the subscription reaches the publisher
    yield writer, reader
    ctx.destroy(linger=0)


def _cpu_share_of(wait, seconds: float = 0.3) -> float:
    """CPU time of this thread over wall time while it calls `wait` in a loop, as a reader does."""
    cpu0, t0 = time.thread_time(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        wait()
    return (time.thread_time() - cpu0) / (time.perf_counter() - t0)


def test_blocking_wait_sleeps_where_vllms_wait_spins(pair):
    _, reader = pair
    reader.record_read()  # vLLM spins for a second after a read, as between steps
    spinning = _cpu_share_of(reader.wait)
    blocking = _cpu_share_of(lambda: worker_wait.blocking_wait(reader, None, poll_ms=5))
    assert spinning > 0.25 and spinning > 3 * blocking, (spinning, blocking)  # the machine's other load shares it
    assert blocking < 0.2, blocking


def test_blocking_wait_returns_within_its_poll_bound_without_a_notification(pair):
    _, reader = pair
    t0 = time.perf_counter()
    worker_wait.blocking_wait(reader, None, poll_ms=20)
    took = time.perf_counter() - t0
    assert 0.015 <= took < 0.5, took
    t0 = time.perf_counter()
    worker_wait.blocking_wait(reader, 0, poll_ms=20)  # vLLM's timeout wins where shorter
    assert time.perf_counter() - t0 < 0.015


def test_blocking_wait_wakes_at_the_writers_notification_and_consumes_it(pair):
    writer, reader = pair
    threading.Timer(0.05, writer.notify).start()
    t0 = time.perf_counter()
    worker_wait.blocking_wait(reader, None, poll_ms=2000)
    assert 0.03 < time.perf_counter() - t0 < 1.0
    t0 = time.perf_counter()
    worker_wait.blocking_wait(reader, None, poll_ms=100)  # consumed: the next wait sleeps its bound
    assert time.perf_counter() - t0 >= 0.08


def test_block_on_replies_replaces_the_wait_once(monkeypatch):
    from vllm.distributed.device_communicators import shm_broadcast

    monkeypatch.setattr(shm_broadcast.SpinCondition, "wait", shm_broadcast.SpinCondition.wait)
    assert worker_wait.block_on_replies() is True
    assert getattr(shm_broadcast.SpinCondition.wait, "specserve_blocking", False)
    assert worker_wait.block_on_replies() is False


def test_the_pools_setting_reaches_the_engine_core():
    from cluster.config import load_config
    from deployments.vllm_args import engine_kwargs

    config = load_config("cluster/configs/local-cpu.yaml")
    for name, pool in config.pools.items():
        kw = engine_kwargs(pool, "/m", None, pool.model, cpu_build=True)
        assert kw["additional_config"]["specserve"]["engine_core_wait"] == "block", name
    spin = config.pools["ngram"].model_copy(update={"engine_core_wait": "spin"})
    assert engine_kwargs(spin, "/m", None, "m", cpu_build=True)["additional_config"]["specserve"]["engine_core_wait"] == "spin"
