"""The router doors' bound on calls: `ongoing` run, `queued` wait, the rest are refused at once."""

import asyncio

import pytest

from cluster.api.admission import Admission, Full


async def _hold(adm: Admission, release: asyncio.Event, log: list):
    async with adm.slot():
        log.append("in")
        await release.wait()


def test_runs_up_to_ongoing_queues_up_to_queued_and_refuses_the_rest():
    async def main():
        adm, release, log = Admission(ongoing=2, queued=1), asyncio.Event(), []
        tasks = [asyncio.create_task(_hold(adm, release, log)) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert (adm.running, adm.waiting, log) == (2, 1, ["in", "in"])
        with pytest.raises(Full):
            async with adm.slot():
                pass
        assert adm.refused == 1
        release.set()
        await asyncio.gather(*tasks)
        assert (adm.running, adm.waiting, log) == (0, 0, ["in"] * 3)
        async with adm.slot():  # free again
            assert adm.running == 1
    asyncio.run(main())


def test_no_queue_refuses_as_soon_as_every_place_is_taken():
    async def main():
        adm, release = Admission(ongoing=1, queued=0), asyncio.Event()
        t = asyncio.create_task(_hold(adm, release, []))
        await asyncio.sleep(0.01)
        with pytest.raises(Full):
            async with adm.slot():
                pass
        release.set()
        await t
    asyncio.run(main())


def test_unbounded_queue_never_refuses():
    async def main():
        adm, release, log = Admission(ongoing=1, queued=-1), asyncio.Event(), []
        tasks = [asyncio.create_task(_hold(adm, release, log)) for _ in range(50)]
        await asyncio.sleep(0.01)
        assert (adm.running, adm.waiting, adm.refused) == (1, 49, 0)
        release.set()
        await asyncio.gather(*tasks)
        assert len(log) == 50
    asyncio.run(main())


def test_a_waiter_cancelled_leaves_no_trace_and_an_error_frees_its_place():
    async def main():
        adm, release = Admission(ongoing=1, queued=1), asyncio.Event()
        holder = asyncio.create_task(_hold(adm, release, []))
        await asyncio.sleep(0.01)
        waiter = asyncio.create_task(_hold(adm, asyncio.Event(), []))
        await asyncio.sleep(0.01)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert (adm.running, adm.waiting) == (1, 0)
        release.set()
        await holder
        with pytest.raises(RuntimeError):
            async with adm.slot():
                raise RuntimeError("the call failed")
        assert adm.running == 0 and not adm._free.locked()
    asyncio.run(main())


@pytest.mark.parametrize("ongoing,queued", [(0, 1), (1, -2)])
def test_bad_bounds_are_refused(ongoing, queued):
    with pytest.raises(ValueError):
        Admission(ongoing, queued)


def test_per_client_caps_each_address_apart_and_frees_on_leave():
    from cluster.api.admission import PerClient

    p = PerClient(2)
    assert p.enter("a") and p.enter("a") and p.enter("b")
    assert not p.enter("a") and p.refused == 1 and p.open == {"a": 2, "b": 1}
    p.leave("a")
    assert p.enter("a") and p.open["a"] == 2
    p.leave("b")
    assert "b" not in p.open  # no entry kept for an address with nothing open


def test_per_client_zero_is_no_bound():
    from cluster.api.admission import PerClient

    p = PerClient(0)
    assert all(p.enter("a") for _ in range(10_000)) and p.refused == 0
    with pytest.raises(ValueError):
        PerClient(-1)
