"""The repeated-structure workload (`tools.bench.repeated`): deterministic, one structure per category,
balanced fixed halves, the shipped file is the generator's output, and its categories map to the router."""

import doctest
import json
from collections import Counter
from pathlib import Path

import pytest

from tools.bench import repeated as R
from tools.bench.split import TUNE, UNTOUCHED, balance, keep, split_half
from tools.bench.workload import WORKLOAD_CLASS_OF, load_prompts, task_of
from cluster.speculation import WORKLOAD_CLASSES

SHIPPED = Path(R.__file__).resolve().parents[2] / "cluster" / "data" / "repeated-structure.jsonl"


def test_docstring_examples_hold():
    result = doctest.testmod(R, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_generate_is_seeded_distinct_and_one_structure_per_category():
    records = R.generate(20, seed=3)
    assert records == R.generate(20, seed=3) and records != R.generate(20, seed=4)
    assert Counter(r["category"] for r in records) == {c: 20 for c in R.CATEGORIES}
    assert len({r["question_id"] for r in records}) == len({r["turns"][0] for r in records}) == 80
    for category in R.CATEGORIES:
        texts = [r["turns"][0] for r in records if r["category"] == category]
        # The same instruction and worked example open every prompt of a category (all before the function
        # to edit, or before the last blank line), and every prompt ends with the same line (the reply's
        # slot, or the instruction).
        if category == "code_edit":
            heads = {t.split("Now the function:")[0] for t in texts}
        else:
            heads = {t.rsplit("\n\n", 1)[0] for t in texts}
        assert len(heads) == 1, category
        assert len({t.rsplit("\n", 1)[-1] for t in texts}) == 1, category
        assert max(len(t) for t in texts) < 1000  # under ~250 tokens of SmolLM2's tokenizer


def test_categories_are_tasks_with_a_router_class():
    for category in R.CATEGORIES:
        assert task_of(category) == category
        assert WORKLOAD_CLASS_OF[category] in WORKLOAD_CLASSES
    assert [WORKLOAD_CLASS_OF[c] for c in ("templated_extraction", "agent_loop", "code_edit", "form_chat")] == [
        "extraction", "structured", "code", "chat"]


def test_balanced_ids_split_every_category_into_equal_halves():
    for n in (1, 2, 7, 60):
        ids = R.balanced_ids("agent_loop", n)
        assert len(set(ids)) == n and Counter(map(split_half, ids)) == {
            h: k for h, k in ((TUNE, n - n // 2), (UNTOUCHED, n // 2)) if k}


def test_shipped_file_is_the_generators_output_and_splits_in_halves():
    lines = SHIPPED.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == R.generate(60, seed=7)  # the command in cluster/data/README.md
    prompts = load_prompts(SHIPPED)
    assert Counter(p.task for p in prompts) == {c: 60 for c in R.CATEGORIES}
    assert balance([p.category for p in prompts], [split_half(p.question_id) for p in prompts]) == {
        c: (30, 30) for c in R.CATEGORIES}
    tune, untouched = keep(prompts, TUNE), keep(prompts, UNTOUCHED)
    assert len(tune) == len(untouched) == 120 and not {p.question_id for p in tune} & {p.question_id for p in untouched}
    assert all(p.workload_class in WORKLOAD_CLASSES for p in prompts)
    assert "repeated-structure.jsonl" in (SHIPPED.parent / "README.md").read_text()


def test_main_writes_jsonl_and_rejects_a_bad_count(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    assert R.main(["--out", str(out), "--per-category", "4", "--seed", "7"]) == 0
    assert [json.loads(line) for line in out.read_text().splitlines()] == R.generate(4, seed=7)
    with pytest.raises(SystemExit):
        R.main(["--out", str(out), "--per-category", "0"])
    assert "--per-category" in capsys.readouterr().err


def test_a_comma_list_of_prompt_files_is_one_mixed_workload():
    from tools.bench.workload import DEFAULT_PROMPTS_PATH, load_prompts

    mixed = load_prompts(f"{DEFAULT_PROMPTS_PATH},{SHIPPED}")
    assert len(mixed) == len(load_prompts(DEFAULT_PROMPTS_PATH)) + len(load_prompts(SHIPPED))
    assert {"agent_loop", "translation"} <= {p.task for p in mixed}
