"""Shared fixtures."""

from __future__ import annotations

import pytest
import torch

from conduit.spec import ExperienceSpec


@pytest.fixture
def small_spec() -> ExperienceSpec:
    """A spec with a vector, an integer id and a done flag."""
    return ExperienceSpec.of(obs=((4,), torch.float32), id=((), torch.int64),
                             done=((), torch.bool))


def make_rows(spec: ExperienceSpec, n: int, start: int = 0) -> dict[str, torch.Tensor]:
    """Rows whose content is a function of their global id, so any mix-up is visible."""
    ids = torch.arange(start, start + n, dtype=torch.int64)
    out: dict[str, torch.Tensor] = {}
    for name, fs in spec.fields.items():
        if name == "id":
            out[name] = ids
        elif fs.dtype == torch.bool:
            out[name] = (ids % 7 == 6).reshape(n, *([1] * len(fs.shape))).expand(n, *fs.shape)
        else:
            base = ids.to(torch.float64).reshape(n, *([1] * len(fs.shape)))
            out[name] = (base + torch.zeros(n, *fs.shape, dtype=torch.float64)).to(fs.dtype)
    return out
