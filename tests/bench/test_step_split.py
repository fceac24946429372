"""`python -m tools.bench.step_split`: tokens per step against time per step from a samples file."""

import json

from tools.bench import step_split
from tools.bench.metrics import Sample


def sample(config, task, repeat, n_tokens, steps, spec_steps, runs, decode_s, **kw):
    return Sample(**{"phase": "compare", "concurrency": 1, "ok": True, "config": config, "prompt_id": "p",
                     "category": task, "task": task, "repeat": repeat, "temperature": 0.0,
                     "token_ids": list(range(n_tokens)), "latency_s": 0.2 + decode_s, "ttft_s": 0.2,
                     "spec": {"steps": steps, "spec_steps": spec_steps, "run_lengths": runs}, **kw})


def test_split_separates_the_two_factors_and_skips_what_is_not_comparable(tmp_path, capsys):
    samples = [
        sample("ngram:2", "math", 0, 11, 6, 4, [0, 4], 0.6),  # 10 tokens in 6 steps, 100 ms each
        sample("ngram:2", "math", 1, 11, 6, 4, [0, 4], 0.9),  # a slower repeat: 150 ms
        sample("ngram:5", "qa", 0, 11, 10, 0, [], 0.8),
        sample("ngram:5", "qa", 0, 11, 10, 0, [], 9.0, ok=False),  # failed: not counted
        sample("ngram:5", "qa", 0, 11, 10, 0, [], 9.0, concurrency=4),  # another level
        sample("ngram:5", "qa", 0, 11, 10, 0, [], 9.0, temperature=0.7),  # sampled: not comparable
        sample("ngram:5", "qa", 0, 11, 10, 0, [], 9.0, phase="warmup"),
    ]
    rows = {(r["task"], r["config"]): r for r in step_split.split(samples, ks=(2, 3))}
    assert set(rows) == {("math", "ngram:2"), ("qa", "ngram:5"), ("ALL", "ngram:2"), ("ALL", "ngram:5")}
    m = rows[("math", "ngram:2")]
    assert (m["requests"], m["tokens_per_step"], m["ms_per_step"], m["ms_per_step_by_repeat"]) == (2, 1.667, 125.0, [100.0, 150.0])
    assert m["draftless"] == 4 and m["predicted"] == {2: 1.667, 3: 1.667}  # 8 runs of 1 and 4 draftless steps: what was measured
    q = rows[("qa", "ngram:5")]
    assert (q["requests"], q["tokens_per_step"], q["ms_per_step"], q["predicted"]) == (1, 1.0, 80.0, {})
    path = tmp_path / "samples.json"
    path.write_text(json.dumps({"meta": {}, "samples": [s.to_dict() for s in samples]}))
    assert step_split.main([str(path), "--tasks", "math", "--k", "2,3"]) == 0
    out = capsys.readouterr().out
    assert "| math | ngram:2 | 2 | 1.667 | 125.0 | 100.0 / 150.0 | 1.667 | 1.667 |" in out
    assert step_split.main([str(path), "--concurrency", "32"]) == 1


def test_same_k_pairs_auto_with_the_static_run_of_the_k_it_chose(tmp_path, capsys):
    chose = lambda k: {"mode": "ngram", "k": k}
    auto = [sample("auto", "math", 0, 11, 5, 4, [], 1.0, spec={"steps": 5, **chose(3)}),
            sample("auto", "qa", 1, 11, 10, 0, [], 1.0, spec={"steps": 10, **chose(6)})]  # no ngram:6 run: unpaired
    static = [sample("ngram:3", "math", 0, 11, 5, 4, [], 0.8), sample("ngram:4", "math", 0, 11, 2, 1, [], 0.1),
              sample("ngram:3", "math", 1, 11, 5, 4, [], 0.1)]  # another repeat: not its pair
    rows = step_split.same_k(auto + static)
    assert rows == [{"task": "ALL", "pairs": 1, "latency": 1.2, "ms_per_step": 1.25, "tokens_per_step": 1.0},
                    {"task": "math", "pairs": 1, "latency": 1.2, "ms_per_step": 1.25, "tokens_per_step": 1.0}]
    path = tmp_path / "samples.json"
    path.write_text(json.dumps({"meta": {}, "samples": [s.to_dict() for s in auto + static]}))
    assert step_split.main([str(path), "--same-k"]) == 0
    assert "| math | 1 | 1.200 | 1.250 | 1.000 |" in capsys.readouterr().out
    assert step_split.main([str(path), "--same-k", "--concurrency", "4"]) == 1
