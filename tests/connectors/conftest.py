"""Fixtures of the connector tests."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
from ec_frontend.engine.request import Request
from ec_frontend.engine.sampling_params import SamplingParams
from ec_frontend.model.processor import MultiModalFeature


class EngineHelpers:
    @staticmethod
    def fake_request(rid: str, num_prompt: int, *, images: Any = ()) -> Request:
        feats = [
            MultiModalFeature(
                hashlib.sha256(name.encode()).hexdigest()[:32], off, ln, (1, 2, 2 * ln),
                torch.zeros(4 * ln, 8),
            )
            for name, off, ln in images
        ]  # fmt: skip
        return Request(rid, [1] * num_prompt, SamplingParams(), mm_features=feats)


@pytest.fixture(scope="session")
def h_engine() -> type[EngineHelpers]:
    return EngineHelpers
