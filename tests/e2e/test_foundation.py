"""End to end, on the real local cluster: text through Ray Serve and vLLM with stats,
greedy losslessness of every CPU mode at every K, per-request K and mode inside one engine."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from tests.e2e.helpers import chat, chat_all, dev_prompts, held_batch, held_batch_intact

# A prompt whose answer copies it: n-gram lookup drafts deep on it.
COPY_PROMPT = ("Repeat the following paragraph word for word: The quick brown fox jumps over the lazy dog. "
               "A journey of a thousand miles begins with a single step. All that glitters is not gold.")

pytestmark = pytest.mark.engine

N_PROMPTS = 40
MAX_TOKENS = 32


def test_generate_cli_returns_text_and_stats(cluster):
    out = subprocess.run(
        [sys.executable, "-m", "cluster.ops.cli", "generate", "List three colours.", "--url", cluster.http_url,
         "--mode", "ngram", "--k", "3", "--max-tokens", "24"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip(), "no text"
    stats_line = out.stderr.strip().splitlines()[-1]
    assert '"mode": "ngram"' in stats_line and '"k": 3' in stats_line and '"drafted"' in stats_line


def test_status_reports_pools_and_redis(cluster):
    """The router's view and Ray Serve's (attached to the local Ray on loopback), within the bound."""
    out = subprocess.run([sys.executable, "-m", "cluster.ops.cli", "status", "--url", cluster.http_url,
                          "--config", str(cluster.config_path),
                          "--ray-timeout", "60"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert '"ngram"' in out.stdout and '"draft"' in out.stdout and '"redis_ok"' in out.stdout
    apps = json.loads(out.stdout).get("applications")
    assert apps, out.stdout[-2000:] + out.stderr[-2000:]
    assert all(d["status"].endswith("HEALTHY") for app in apps.values() for d in app["deployments"].values()), apps


def _first_divergence(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b)) if len(a) != len(b) else -1


def test_greedy_output_identical_with_speculation_on_and_off(cluster):
    """Every CPU mode at every K in 1..K_max against no speculation, on 40 dev-set prompts."""
    prompts = dev_prompts(N_PROMPTS)
    assert len(prompts) == N_PROMPTS
    models = httpx.get(f"{cluster.http_url}/v1/models", timeout=30).json()
    pools = models["data"][0]["specserve"]["pools"]
    configs = [{"mode": m, "k": k} for p in pools for m in p["modes"] if m != "none"
               for k in range(1, p["max_k_by_mode"][m] + 1)]
    assert {c["mode"] for c in configs} == {"ngram", "suffix", "eagle"}

    async def run_all():
        base = await chat_all(cluster.http_url, prompts, {"mode": "none"}, MAX_TOKENS, logprobs=True, top_logprobs=2)
        # 32 requests in flight at most, taken in configuration order, so neighbouring configurations
        # share the engines' batches: 4 per configuration at once (100, 84 of them on the n-gram pool)
        # queued one past router.first_token_timeout_s on the loaded 2-core CI machine, which tests the
        # burst, not losslessness.
        sem = asyncio.Semaphore(32)
        runs = await asyncio.gather(*[chat_all(cluster.http_url, prompts, c, MAX_TOKENS, sem=sem) for c in configs])
        return base, runs

    base, runs = asyncio.run(run_all())
    assert all(r["specserve"]["drafted"] == 0 for r in base)
    mismatches = []
    for cfg, results in zip(configs, runs):
        drafted = sum(r["specserve"]["drafted"] for r in results)
        assert drafted > 0, f"{cfg}: nothing was drafted, speculation did not run"
        for p, b, r in zip(prompts, base, results):
            assert r["specserve"]["mode"] == cfg["mode"] and r["specserve"]["k"] == cfg["k"]
            i = _first_divergence(b["specserve"]["token_ids"], r["specserve"]["token_ids"])
            if i >= 0:
                top = b["choices"][0]["logprobs"]["content"]  # vLLM's logprobs of the plain answer
                lps = sorted((t["logprob"] for t in top[i]["top_logprobs"]), reverse=True) if i < len(top) else []
                gap = lps[0] - lps[1] if len(lps) > 1 else None
                mismatches.append((cfg, p["id"], i, gap))
    assert not mismatches, f"{len(mismatches)} greedy mismatches (config, question, position, top-2 logprob gap): {mismatches[:20]}"


def test_suffix_requests_draft_from_earlier_outputs_beside_ngram_requests_in_one_engine(cluster):
    """Mode suffix is served by the n-gram pool's engine (cluster/engine/lookup_proposer.py): a
    second request whose answer repeats an earlier request's answer gets it as drafts, which prompt
    lookup cannot see; n-gram and suffix requests share the engine's batches, text unchanged.
    The suffix trees start empty of earlier answers, so the drafts counted here come from the first
    answer whatever the session's other tests served before."""
    first = "Write a haiku about a lighthouse keeper who counts the waves at night."
    second = "Write a haiku about a lighthouse keeper who counts the waves at night, please."

    async def run():
        async with httpx.AsyncClient() as client:
            forgot = await client.post(f"{cluster.http_url}/v1/specserve/forget_outputs", timeout=60)
            assert forgot.status_code == 200, forgot.text
            a = await chat(client, cluster.http_url, first, 48, {"mode": "ngram", "k": 4})
            b = await asyncio.gather(chat(client, cluster.http_url, second, 48, {"mode": "suffix", "k": 4}),
                                     chat(client, cluster.http_url, second, 48, {"mode": "ngram", "k": 4}),
                                     chat(client, cluster.http_url, second, 48, {"mode": "none"}))
            return a, b

    a, (suffix, ngram, plain) = asyncio.run(run())
    assert suffix["specserve"]["mode"] == "suffix" and suffix["specserve"]["pool"] == ngram["specserve"]["pool"]
    assert suffix["specserve"]["token_ids"] == ngram["specserve"]["token_ids"] == plain["specserve"]["token_ids"]
    shared = next((i for i, (x, y) in enumerate(zip(a["specserve"]["token_ids"], plain["specserve"]["token_ids"]))
                   if x != y), len(plain["specserve"]["token_ids"]))
    assert shared >= 16, "the two prompts should start their answers alike; pick others"
    assert suffix["specserve"]["accepted"] >= shared // 2 > ngram["specserve"]["accepted"], (suffix, ngram)


def test_after_forget_outputs_suffix_drafts_no_longer_come_from_earlier_answers(cluster):
    """`POST /v1/specserve/forget_outputs`: the n-gram pool's suffix trees drop finished requests'
    outputs, so the same request that drafted an earlier answer before it drafts from its prompt only
    after it (what `specserve bench` does before each load phase); the text stays the same."""
    first = "Write a haiku about a lighthouse keeper who counts the waves at night."
    later = "Write a haiku about a lighthouse keeper who counts the waves at night, please."

    async def run():
        async with httpx.AsyncClient() as client:
            a = await chat(client, cluster.http_url, first, 48, {"mode": "ngram", "k": 4})
            before = await chat(client, cluster.http_url, later, 48, {"mode": "suffix", "k": 4})
            forgot = await client.post(f"{cluster.http_url}/v1/specserve/forget_outputs", timeout=60)
            after = await chat(client, cluster.http_url, later, 48, {"mode": "suffix", "k": 4})
            return a, before, forgot, after

    a, before, forgot, after = asyncio.run(run())
    assert forgot.status_code == 200, forgot.text
    assert forgot.json()["pools"]["ngram"]["forgotten"] >= 2, forgot.json()
    assert before["specserve"]["token_ids"] == after["specserve"]["token_ids"]
    shared = next((i for i, (x, y) in enumerate(zip(a["specserve"]["token_ids"], after["specserve"]["token_ids"]))
                   if x != y), len(after["specserve"]["token_ids"]))
    assert shared >= 16, "the two prompts should start their answers alike; pick others"
    assert before["specserve"]["accepted"] >= shared // 2 > after["specserve"]["accepted"], (before, after)


def test_per_request_k_is_applied_inside_one_engine_concurrently(cluster):
    """Requests with different K run in the ngram engine at the same time; drafts follow each K."""
    text = ("Copy this list exactly, twice: alpha, bravo, charlie, delta, echo, foxtrot, golf, hotel, "
            "india, juliet, kilo, lima, mike, november.")
    ks = [0, 1, 2, 4, 6, 6, 1, 0]

    async def run():
        async with httpx.AsyncClient() as client:
            async def one(k):
                t0 = time.monotonic()
                r = await chat(client, cluster.http_url, text, 64, {"mode": "ngram", "k": k})
                return r, t0, time.monotonic()
            return await asyncio.gather(*[one(k) for k in ks])

    results = asyncio.run(run())
    # They overlapped in time (all started before any finished), so they shared the engine's batches.
    assert max(t0 for _, t0, _ in results) < min(t1 for _, _, t1 in results)
    replicas = {r["specserve"]["replica"] for r, _, _ in results}
    assert len(replicas) == 1, f"expected one engine replica, got {replicas}"
    base_tokens = results[0][0]["specserve"]["token_ids"]
    by_k: dict[int, list[dict]] = {}
    for k, (r, _, _) in zip(ks, results):
        s = r["specserve"]
        assert s["token_ids"] == base_tokens, "greedy text changed with K"
        assert s["k"] == k
        if k == 0:
            assert s["drafted"] == 0 and s["spec_steps"] == 0
        else:
            assert s["drafted"] <= k * s["spec_steps"], s  # never more than K drafts in a step
            assert all(n == 0 for n in s["drafted_per_position"][k:]), s
            # Accepted runs (from vLLM's ordered per-step counts): every run takes a step at least,
            # and a run of L takes ceil((L + 1) / (K + 1)) steps at most where all K are drafted.
            runs = s["run_lengths"]
            assert bool(runs) == (s["spec_steps"] > 0), s
            assert sum(runs) <= sum(g * -(-(n + 1) // (k + 1)) for n, g in enumerate(runs)) <= s["spec_steps"], s
        by_k.setdefault(k, []).append(s)
    # More K, more drafts verified per step, fewer steps.
    assert min(s["drafted"] for s in by_k[6]) > max(s["drafted"] for s in by_k[1])
    assert max(s["steps"] for s in by_k[6]) < min(s["steps"] for s in by_k[0])
    assert max(s["drafted"] / s["spec_steps"] for s in by_k[1]) <= 1.0


def test_router_decided_requests_get_their_k_per_step_in_the_engine(cluster):
    """`auto` on the ngram pool: the request carries its class's α and the pool's max_k as a
    ceiling, and the engine's scheduler picks K at every step (cluster/engine/step_k.py): on a copy it
    drafts past any small fixed K, in fewer steps than plain decoding, with the same greedy text."""
    text = COPY_PROMPT

    async def run():
        async with httpx.AsyncClient() as client:
            plain = await chat(client, cluster.http_url, text, 64, {"mode": "none"})
            auto = await chat(client, cluster.http_url, text, 64)
            return plain, auto

    plain, auto = (r["specserve"] for r in asyncio.run(run()))
    assert auto["token_ids"] == plain["token_ids"], "greedy text changed"
    # the pool's engine drafts by n-gram lookup or suffix tree, as the policy scores them for the class
    assert auto["decided_by"] == "policy" and auto["pool"] == "ngram" and auto["mode"] in ("ngram", "suffix")
    assert 0.0 < auto["decision"]["k_step_alpha"] < 1.0, auto["decision"]
    pos = auto["drafted_per_position"]
    assert len(pos) <= auto["k"] and len(pos) > 2 and pos[2] > 0, auto  # deep drafts on the copy
    assert auto["steps"] < 0.8 * plain["steps"], (auto, plain)


def test_above_the_pools_batch_bound_the_engine_measures_both_arms_and_the_text_stays(cluster):
    """`step_k_max_batch` is where the engine's draft gate starts (`cluster/engine/draft_gate.py`):
    router-decided copies in a batch above it decode plainly at first and try drafting in about
    `step_k_explore` of the steps, until the engine has measured both arms at that batch size, which
    its log says ("now compares its arms"); from then on the faster arm runs. Whatever the arm, the
    greedy text is the copy's text alone.

    The batch is held above the bound by plain streams on the same engine (`held_batch`, a caller's
    K = 0: not the gate's requests, and never drafting), started first: copies sent at once do not
    reliably run together, since one that reaches the engine a little early drafts in a small batch
    and is done in a fraction of a second."""
    bound = cluster.raw["pools"]["ngram"]["step_k_max_batch"]
    compared = re.compile(r"draft gate: batch (\d+)(?:-\d+|\+)? now compares its arms")

    def buckets_above_bound() -> set[int]:
        text = cluster.log_path.read_text(errors="replace")
        return {int(m.group(1)) for m in compared.finditer(text) if int(m.group(1)) > bound}

    async def run():
        async with httpx.AsyncClient() as client:
            alone = (await chat(client, cluster.http_url, COPY_PROMPT, 64))["specserve"]
            copies = []
            async with held_batch(cluster.http_url, "ngram", bound + 1, {"mode": "ngram", "k": 0}) as fillers:
                for _ in range(8):  # each round ~50 steps above the bound; warming takes ~40
                    copies += await asyncio.gather(*(chat(client, cluster.http_url, COPY_PROMPT, 64) for _ in range(4)))
                    if buckets_above_bound():
                        break
                intact = held_batch_intact(fillers)
            return alone, [c["specserve"] for c in copies], intact

    alone, copies, intact = asyncio.run(run())
    assert intact, "the engine's batch fell to the bound before the copies ended"
    assert alone["drafted"] >= 20, alone
    assert all(c["token_ids"] == alone["token_ids"] for c in copies), "greedy text changed"
    assert all(c["decided_by"] == "policy" and c["pool"] == "ngram" and c["mode"] in ("ngram", "suffix") for c in copies)
    assert buckets_above_bound(), f"no batch size above {bound} was measured on both arms:\n{cluster.log_tail()}"


def test_engines_run_at_normal_priority(cluster):
    """Ray starts workers at nice 15; an engine there yields its core to any ordinary process
    (a client, a stock server beside it) and once missed its health check that way."""
    import os

    out = subprocess.run(["ps", "-eo", "pid,ni,comm"], capture_output=True, text=True, check=True).stdout
    engines = [line.split() for line in out.splitlines() if "VLLM::" in line]
    mine = [(int(pid), int(ni)) for pid, ni, _ in engines if _descends_from(int(pid), cluster.proc.pid)]
    assert mine, "no vLLM engine process under the cluster's `specserve up`"
    assert all(ni == 0 for _, ni in mine), mine
    assert all(os.getpriority(os.PRIO_PROCESS, pid) == 0 for pid, _ in mine)


def test_the_processes_that_start_replicas_keep_the_workers_cores(cluster):
    """`ray.pin_serving_cpus` moves the serving processes off the model workers' cores, but not the
    raylet or Ray's idle workers: a replica they start later (a replacement, an autoscaled one)
    inherits their cores, and vLLM binds its model worker within them. A raylet moved onto the
    serving core put a replacement's worker there (tests/e2e/test_failover.py measures the cost)."""
    from cluster.ops.cpu_pinning import program

    assert cluster.raw["ray"]["pin_serving_cpus"]
    deadline = time.monotonic() + 30  # the first pinning pass: 5 s after serving at most
    while "pinned" not in cluster.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, cluster.log_tail()
        time.sleep(1)
    procs = [(p, program(p.cmdline()[0])) for p in psutil.Process(cluster.proc.pid).children(recursive=True)
             if p.cmdline()]
    workers = {c for p, name in procs if name.startswith("VLLM::Worker") for c in p.cpu_affinity()}
    starters = {name: set(p.cpu_affinity()) for p, name in procs if name in ("raylet", "ray::IDLE")}
    assert workers and "raylet" in starters, [name for _, name in procs]
    assert all(workers <= cores for cores in starters.values()), (sorted(workers), starters)


def test_engine_cores_sleep_while_their_workers_compute(cluster):
    """`engine_core_wait: block` (both pools of the embedded config): the engine core waits for its
    model worker on the notification socket, not by spinning on the core it shares with the serving
    path. Spinning, vLLM's engine core used about 0.7 of the worker's CPU time at one stream."""
    out = subprocess.run(["ps", "-eo", "pid,comm"], capture_output=True, text=True, check=True).stdout
    procs = [(int(pid), comm) for pid, comm in (line.split(None, 1) for line in out.splitlines()[1:])
             if comm.startswith("VLLM::") and _descends_from(int(pid), cluster.proc.pid)]
    cores = [pid for pid, comm in procs if "EngineCor" in comm]  # comm is cut at 15 characters
    workers = [pid for pid, comm in procs if "Worker" in comm]
    assert cores and workers, procs
    handles = {pid: psutil.Process(pid) for pid in cores + workers}
    before = {pid: sum(p.cpu_times()[:2]) for pid, p in handles.items()}  # user + system seconds
    with httpx.Client() as client:
        for i in range(3):
            r = client.post(f"{cluster.http_url}/v1/chat/completions", timeout=300, json={
                "messages": [{"role": "user", "content": f"Write a short story about lighthouse keeper {i}."}],
                "max_tokens": 96, "temperature": 0.0, "specserve": {"speculative": {"mode": "none"}}})
            assert r.status_code == 200, r.text
    core = sum(sum(handles[p].cpu_times()[:2]) - before[p] for p in cores)
    worker = sum(sum(handles[p].cpu_times()[:2]) - before[p] for p in workers)
    assert worker > 0.5, (core, worker)  # half a second of model work at least
    assert core < 0.3 * worker, (core, worker)


def _descends_from(pid: int, ancestor: int) -> bool:
    """Whether `pid` is `ancestor` or below it (Ray's raylet is started by `specserve up`)."""
    seen = 0
    while pid > 1 and seen < 64:
        if pid == ancestor:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        seen += 1
    return False


def test_under_load_streamed_tokens_come_in_chunks_that_follow_the_batch(cluster):
    """`stream_chunks_per_step` (4 in the embedded config): streams running beside 12 other requests
    in one engine get their tokens a few at a time (the first alone, at once), the same tokens a lone
    non-streamed request gets; one stream alone gets one chunk per engine output.

    The batch is held by plain streams started first (`held_batch`), as in the batch-bound test:
    streams sent at once do not reliably run together."""
    from cluster.client import AsyncSpecServeClient
    from cluster.client_wire import collect_stream

    kwargs = dict(prompt="Write a long story about a lighthouse keeper.", max_tokens=48, temperature=0.0,
                  speculative={"mode": "none"}, extra={"ignore_eos": True})
    held = 12

    async def run():
        async with AsyncSpecServeClient(cluster.http_url) as client:
            async def streamed():
                t = time.perf_counter()
                return collect_stream([c async for c in client.generate_stream(**kwargs)], t)

            whole = await client.generate(**kwargs)
            alone = await streamed()
            async with held_batch(cluster.http_url, "ngram", held, {"mode": "none"}) as fillers:
                crowd = await asyncio.gather(*(streamed() for _ in range(4)))
                intact = held_batch_intact(fillers)
            return whole, alone, crowd, intact

    whole, alone, crowd, intact = asyncio.run(run())
    assert len(whole.token_ids) == 48
    assert alone.token_ids == whole.token_ids and alone.chunk_tokens == [1] * 48
    assert intact, "the held batch ended before the streams did"
    assert all(r.token_ids == whole.token_ids for r in crowd), "streamed tokens differ from the unary request's"
    assert all(r.chunk_tokens[0] == 1 for r in crowd), [r.chunk_tokens[:3] for r in crowd]
    # vLLM's events (one per engine output) reach the client in deliveries: the events the replica
    # gathered into one chunk arrive together, apart from the next delivery by at least a step.
    deliveries = [deliveries_of(r.chunk_times_s) for r in crowd]
    # 13-16 running: ceil(b / 4) = 4 tokens a delivery (vLLM may merge outputs the replica reads late).
    assert sum(deliveries) < 0.5 * len(crowd) * 48, deliveries
    assert deliveries_of(alone.chunk_times_s) > 0.75 * 48  # alone: one delivery per engine output


def deliveries_of(times_s: list[float], gap_s: float = 0.004) -> int:
    """Groups of event arrivals, each within `gap_s` of the one before (a delivery of several events).

    >>> deliveries_of([0.1, 0.1005, 0.2, 0.3, 0.3001])
    3
    """
    return sum(1 for i, t in enumerate(times_s) if i == 0 or t - times_s[i - 1] > gap_s)
