"""The examples in the bench's pure modules' docstrings are executed, so they cannot drift from the code."""

import doctest
import importlib

import pytest


@pytest.mark.parametrize("name", ["cluster.bench.plan", "cluster.bench.anchors", "cluster.bench.trace", "cluster.bench.phases", "cluster.bench.prior_alpha",
                                  "cluster.bench.verdict", "cluster.bench.bootstrap", "cluster.bench.stalls", "cluster.bench.autogroup"])
def test_docstring_examples_hold(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
