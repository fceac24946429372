import argparse

from tools.distill import cli


def test_arguments_parse_with_their_defaults():
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    a = p.parse_args(["--kind", "draft_model", "--time-budget-s", "60", "--resume", "--eval-only"])
    assert (a.kind, a.time_budget_s, a.resume, a.eval_only, a.eval_k) == ("draft_model", 60.0, True, True, 6)
    assert p.parse_args([]).kind == "eagle" and p.parse_args([]).eval_per_task == 8
    assert p.parse_args(["--eval-per-task", "3"]).eval_per_task == 3


def test_build_drafter_gives_both_kinds(target):
    head = cli.build_drafter("eagle", target, 1, seed=0)
    draft = cli.build_drafter("draft_model", target, 1, seed=0)
    assert sum(p.numel() for p in head.parameters()) > 0
    assert draft.config.num_hidden_layers == 1
    assert draft.model.embed_tokens.weight is target.model.embed_tokens.weight
