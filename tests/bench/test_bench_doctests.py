"""The examples in the bench's pure modules' docstrings are executed, so they cannot drift from the code."""

import doctest
import importlib

import pytest


@pytest.mark.parametrize("name", ["tools.bench.plan", "tools.bench.anchors", "tools.bench.trace", "tools.bench.phases", "tools.bench.prior_alpha",
                                  "tools.bench.verdict", "tools.bench.bootstrap", "tools.bench.stalls", "tools.bench.autogroup"])
def test_docstring_examples_hold(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
