from __future__ import annotations

import pytest

from punica_x.config import ModelConfig
from punica_x.models.loader import load_model


@pytest.fixture(scope="module")
def shared(tiny_model_dir):
    """The tiny model's weights, shared by every engine of a test module."""
    return load_model(ModelConfig(model=str(tiny_model_dir), dtype="float32"))
