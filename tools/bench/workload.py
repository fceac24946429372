"""Benchmark prompts: Spec-Bench-format JSONL in, a seeded, per-task selection of `Prompt`s out.

A line is `{"question_id", "category", "turns": [...]}`; only the first turn is sent, as one user
message (the server applies the chat template). Spec-Bench's six *tasks* are the reporting groups:
its eight MT-bench categories form the task `mt_bench`; every other category is its own task.
The default file ships with the package (`cluster/data/specbench-dev.jsonl`, Apache-2.0, see
`cluster/data/SPEC-BENCH-LICENSE`). A second one, `cluster/data/repeated-structure.jsonl`
(`tools.bench.repeated`), holds four categories of prompts whose outputs repeat one structure, each its own task.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

DEFAULT_PROMPTS_PATH = Path(__file__).resolve().parents[2] / "cluster" / "data" / "specbench-dev.jsonl"

MT_BENCH_CATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)

# Spec-Bench category -> the router's workload class, for the optional `--hint-workload-class`.
WORKLOAD_CLASS_OF = {
    "writing": "creative", "roleplay": "creative", "reasoning": "reasoning", "math": "math",
    "coding": "code", "extraction": "extraction", "stem": "qa", "humanities": "qa",
    "translation": "translation", "summarization": "summarization", "qa": "qa",
    "math_reasoning": "math", "rag": "rag",
    # The repeated-structure workload (tools/bench/repeated.py): each category is its own task.
    "templated_extraction": "extraction", "agent_loop": "structured", "code_edit": "code", "form_chat": "chat",
    # The constrained workload (tools/bench/structured.py).
    "json_extraction": "structured", "tool_call": "structured",
}


@dataclass(frozen=True)
class Prompt:
    question_id: str
    category: str  # the file's category
    task: str  # the reporting group (Spec-Bench task)
    text: str  # the first turn
    # OpenAI request fields the line carries (`request`, as JSON text: the prompt stays hashable), added
    # to every request's body, the cluster's and the stock servers' (tools/bench/structured.py).
    request_json: str = ""

    @property
    def request(self) -> dict:
        return json.loads(self.request_json) if self.request_json else {}

    @property
    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.text}]

    @property
    def workload_class(self) -> Optional[str]:
        return WORKLOAD_CLASS_OF.get(self.category)


class WorkloadError(ValueError):
    """A prompt file that does not have the Spec-Bench format; the message names the line."""


def task_of(category: str) -> str:
    return "mt_bench" if category in MT_BENCH_CATEGORIES else category


def parse_lines(lines: list[str], source: str = "<prompts>") -> list[Prompt]:
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            turns = obj["turns"]
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0]:
                raise ValueError("`turns` must be a non-empty list whose first item is a non-empty string")
            request = obj.get("request") or {}
            if not isinstance(request, dict):
                raise ValueError("`request` must be an object of OpenAI request fields")
            prompts.append(Prompt(question_id=str(obj["question_id"]), category=str(obj["category"]),
                                  task=task_of(str(obj["category"])), text=turns[0],
                                  request_json=json.dumps(request, sort_keys=True) if request else ""))
        except (ValueError, KeyError, TypeError) as e:
            raise WorkloadError(f"{source}:{n}: {type(e).__name__}: {e} "
                                "(expected question_id, category, turns, optionally request)") from None
    if not prompts:
        raise WorkloadError(f"{source}: no prompts")
    return prompts


def load_prompts(path: Optional[str | Path] = None) -> list[Prompt]:
    """One file's prompts; a comma list of files (`a.jsonl,b.jsonl`: a mixed workload) gives them all,
    in order."""
    if isinstance(path, str) and "," in path:
        return [p for part in path.split(",") if part.strip() for p in load_prompts(part.strip())]
    path = Path(path) if path else DEFAULT_PROMPTS_PATH
    return parse_lines(path.read_text(encoding="utf-8").splitlines(), str(path))


def _by_task(prompts: list[Prompt], tasks: Optional[list[str]],
             max_prompt_chars: Optional[int]) -> dict[str, list[Prompt]]:
    """The prompts `tasks` keeps (a task or a file category) that are not longer than `max_prompt_chars`,
    per task, each group in question_id order (so a draw does not depend on the file's order)."""
    by_task: dict[str, list[Prompt]] = {}
    for p in prompts:
        if tasks and p.task not in tasks and p.category not in tasks:
            continue
        if max_prompt_chars and len(p.text) > max_prompt_chars:
            continue
        by_task.setdefault(p.task, []).append(p)
    return {task: sorted(group, key=lambda p: p.question_id) for task, group in sorted(by_task.items())}


def select(prompts: list[Prompt], per_task: int, seed: int = 0, tasks: Optional[list[str]] = None,
           max_prompt_chars: Optional[int] = None) -> list[Prompt]:
    """Up to `per_task` prompts of each task (seeded draw, stable under file order), grouped by task.

    Prompts longer than `max_prompt_chars` are skipped (they would not fit the engines' context).
    `tasks` filters by task or by file category.
    """
    chosen = []
    for task, group in _by_task(prompts, tasks, max_prompt_chars).items():
        rng = random.Random(f"{seed}:{task}")
        chosen.extend(rng.sample(group, min(per_task, len(group))))
    return chosen


def select_per_repeat(prompts: list[Prompt], per_task: int, repeats: int, seed: int = 0,
                      tasks: Optional[list[str]] = None, max_prompt_chars: Optional[int] = None) -> list[list[Prompt]]:
    """`repeats` disjoint draws of `per_task` prompts of each task, each draw grouped by task like
    `select`'s (`--fresh-per-repeat`: a drafter that remembers earlier outputs, such as SuffixDecoding,
    must not meet its own answer to the same prompt again in the next repeat). Seeded and stable under
    file order like `select`; with `repeats` 1 the draw is `select`'s. Raises ValueError when a task
    has fewer than `repeats` x `per_task` prompts.
    """
    draws: list[list[Prompt]] = [[] for _ in range(repeats)]
    for task, group in _by_task(prompts, tasks, max_prompt_chars).items():
        need = repeats * per_task
        if len(group) < need:
            raise ValueError(f"--fresh-per-repeat: task {task} has {len(group)} prompts (after --split, --tasks and "
                             f"--max-prompt-chars), {repeats} repeats x --prompts-per-task {per_task} need {need}")
        drawn = random.Random(f"{seed}:{task}").sample(group, need)
        for r in range(repeats):
            draws[r].extend(drawn[r * per_task:(r + 1) * per_task])
    return draws


def interleave_tasks(prompts: list[Prompt]) -> list[Prompt]:
    """The prompts in round-robin order over their tasks (first of each task, then second, ...),
    task order and order within a task kept. `select` groups by task; the load phases send the
    first n of a cycled list, and grouped, a phase of 18 would hold only the first two tasks."""
    by_task: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_task.setdefault(p.task, []).append(p)
    groups = list(by_task.values())
    return [g[i] for i in range(max((len(g) for g in groups), default=0)) for g in groups if i < len(g)]


def round_prompts(prompts: list[Prompt], n: int, round_: int, start: int = 0) -> list[Prompt]:
    """Round `round_`'s n prompts: the n after the previous rounds' in `prompts`, from `start` (where
    this series of rounds begins), cycled, so rounds share no prompt while `prompts` lasts (the load
    sweep's rounds and the trace replay's).

    >>> p = [Prompt(c, "qa", "qa", c) for c in "abcde"]
    >>> [[x.question_id for x in round_prompts(p, 2, r)] for r in range(3)]
    [['a', 'b'], ['c', 'd'], ['e', 'a']]
    >>> [x.question_id for x in round_prompts(p, 2, 0, start=3)]
    ['d', 'e']
    """
    return [prompts[(start + round_ * n + i) % len(prompts)] for i in range(n)]


def load_prompt_pool(prompts_all: list[Prompt], compared: list[Prompt]) -> list[Prompt]:
    """The prompts the load phases draw from: those the one-stream comparisons do not send, when any
    are left. A stock suffix server cannot forget: a load phase that resent a compared prompt would
    meet its own earlier answer there, drafted whole (the cluster's trees keep theirs too unless
    prompts come round again: `phases.must_forget`).

    >>> p = [Prompt(c, "qa", "qa", c) for c in "abc"]
    >>> [x.question_id for x in load_prompt_pool(p, p[:1])], len(load_prompt_pool(p, p))
    (['b', 'c'], 3)
    """
    sent = {c.text for c in compared}
    return [p for p in prompts_all if p.text not in sent] or prompts_all
