"""Fixtures of the Kubernetes manifest tests."""

import pytest

from tests.k8s.k8s_checks import build_all


@pytest.fixture(scope="session")
def built():
    """{overlay name: objects of the overlay's kustomize build}."""
    return build_all()
