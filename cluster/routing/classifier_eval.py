"""Evaluation of the workload classifier on Spec-Bench: its categories mapped to our classes, accuracy per
category and copy group, and per-call latency; ``python -m cluster.routing.classifier_eval DATASET.jsonl`` prints it."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter, defaultdict
from typing import Iterable, Optional

from cluster.routing.classifier import classify
from cluster.percentile import percentile

# Spec-Bench category -> our class, with why.
SPEC_BENCH_TO_CLASS = {
    "translation": "translation",  # WMT de->en: "Translate German to English: ..."
    "summarization": "summarization",  # CNN/DailyMail: "Summarize: <article>"
    "qa": "qa",  # Natural Questions: short factoid questions, answered from memory
    "math_reasoning": "math",  # GSM8K: arithmetic word problems
    "rag": "rag",  # Natural Questions with retrieved passages pasted before the question
    "writing": "creative",  # MT-bench writing: blog posts, stories, headlines (free generation)
    "roleplay": "chat",  # MT-bench roleplay: persona set-ups for a conversation
    "reasoning": "reasoning",  # MT-bench reasoning: logic puzzles and riddles
    "math": "math",  # MT-bench math: geometry, probability, algebra
    "coding": "code",  # MT-bench coding: write a program/function
    "extraction": "extraction",  # MT-bench extraction: pull fields out of given texts
    "stem": "qa",  # MT-bench STEM: explain a scientific concept; knowledge QA, copies nothing
    "humanities": "qa",  # MT-bench humanities: discuss/explain from knowledge, like stem
}

# Classes grouped by how much the answer copies the prompt (the speculative mode follows from this).
COPY_GROUPS = {
    "copies_prompt": ("summarization", "rag", "extraction", "structured"),
    "code": ("code",),
    "stepwise": ("math", "reasoning"),
    "free_text": ("chat", "creative", "qa"),
    "translation": ("translation",),
}
_GROUP_OF = {c: g for g, cs in COPY_GROUPS.items() for c in cs}


def half_of(question_id: int) -> str:
    """Split for tuning vs held-out. The dev set holds only odd question_ids, so the halves are
    alternate ids: "A" (question_id // 2 even; rules were tuned on it) and "B" (held out)."""
    return "A" if (question_id // 2) % 2 == 0 else "B"


def evaluate(path: str, repeats: int = 5) -> dict:
    """Accuracy (overall, per half, per category, by copy group), a confusion matrix
    (category -> predicted class -> count) and per-call latency in microseconds."""
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    confusion: dict[str, Counter] = defaultdict(Counter)
    hits: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # key -> [correct, total]
    group_hits = [0, 0]
    latencies_us: list[float] = []
    for row in rows:
        text = row["turns"][0]
        cat = row["category"]
        expected = SPEC_BENCH_TO_CLASS[cat]
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            got = classify(text=text)
            latencies_us.append((time.perf_counter_ns() - t0) / 1000)
        confusion[cat][got] += 1
        ok = int(got == expected)
        for key in ("all", f"half_{half_of(int(row['question_id']))}", cat):
            hits[key][0] += ok
            hits[key][1] += 1
        group_hits[0] += int(_GROUP_OF[got] == _GROUP_OF[expected])
        group_hits[1] += 1
    latencies_us.sort()

    def acc(key: str) -> float:
        c, n = hits[key]
        return round(c / n, 4) if n else 0.0

    return {
        "n": len(rows),
        "accuracy": acc("all"),
        "accuracy_half_A_tuned": acc("half_A"),
        "accuracy_half_B_heldout": acc("half_B"),
        "copy_group_accuracy": round(group_hits[0] / group_hits[1], 4) if group_hits[1] else 0.0,
        "per_category": {
            cat: {"n": hits[cat][1], "expected": SPEC_BENCH_TO_CLASS[cat], "accuracy": acc(cat)}
            for cat in sorted(confusion)
        },
        "confusion": {cat: dict(confusion[cat].most_common()) for cat in sorted(confusion)},
        "latency_us": {
            "calls": len(latencies_us),
            **{f"p{q}": round(percentile(latencies_us, q, "nearest_rank"), 1) if latencies_us else 0.0 for q in (50, 99)},
            "max": round(latencies_us[-1], 1) if latencies_us else 0.0,
        },
    }


def format_report(report: dict) -> str:
    lines = [
        f"n={report['n']}  accuracy={report['accuracy']:.3f}  "
        f"half A (tuned)={report['accuracy_half_A_tuned']:.3f}  half B (held out)={report['accuracy_half_B_heldout']:.3f}  "
        f"copy-group accuracy={report['copy_group_accuracy']:.3f}",
        "latency per call (us): p50={p50} p99={p99} max={max} over {calls} calls".format(**report["latency_us"]),
        f"{'category':<15}{'n':>4} {'-> class':<15}{'acc':>6}  predicted",
    ]
    for cat, row in report["per_category"].items():
        pred = ", ".join(f"{c}:{k}" for c, k in report["confusion"][cat].items())
        lines.append(f"{cat:<15}{row['n']:>4} {row['expected']:<15}{row['accuracy']:>6.2f}  {pred}")
    return "\n".join(lines)


def main(argv: Optional[Iterable[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m cluster.routing.classifier_eval DATASET.jsonl", file=sys.stderr)
        return 2
    print(format_report(evaluate(args[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
