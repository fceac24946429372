"""Fixtures shared across test folders (a folder's own fixtures live in its conftest)."""

from __future__ import annotations

import pytest

from tests.drafter_peer import tiny_llama


@pytest.fixture(scope="module")
def hf_model():
    """A tiny random Llama (no weights needed), for the drafter's tests."""
    return tiny_llama()
