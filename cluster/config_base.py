"""What every section of the cluster config is built on: `Strict`, the pydantic model that refuses a
field it does not know, and `CustomResources`, the custom Ray resources a node advertises or a replica
asks for (never one of RAY_BUILTIN_RESOURCES, Ray's own), validated so that an error names its field.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict


class Strict(BaseModel):
    """A config section: unknown fields are an error."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


RAY_BUILTIN_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


def _custom_resources(v: dict[str, float]) -> dict[str, float]:
    for res, amount in v.items():
        if res in RAY_BUILTIN_RESOURCES or res.startswith("node:"):
            raise ValueError(f"{res!r} is Ray's own resource; name a custom one (e.g. specserve_target)")
        if not res or len(res) > 64 or not all(c.isalnum() or c in "_-" for c in res):
            raise ValueError(f"resource name {res[:64]!r} must be 1-64 letters, digits, '_' or '-'")
        if not 0 < amount <= 1e6:
            raise ValueError(f"resource {res!r} must be within (0, 1e6], got {amount}")
    return v


# Custom Ray resources (a node's, or what a replica asks of one); an error names the field it is in.
CustomResources = Annotated[dict[str, float], AfterValidator(_custom_resources)]
