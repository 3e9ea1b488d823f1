"""benchmarks/common/shapes.py: random-weight models built once in the cache, also when two
benchmarks start together on a fresh cache and race to build the same one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from common import shapes  # noqa: E402


def test_a_model_another_process_finished_first_is_used(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("PUNICA_X_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "cache" / "models" / "random-smollm2-135m"

    def other_process_wins(model, std, folder):  # it publishes while this one writes
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"mine")

    monkeypatch.setattr(shapes, "_write_random_weights", other_process_wins)
    assert shapes.random_model("smollm2-135m", str(tiny_model_dir)) == target
    assert (target / "config.json").read_text() == "{}"  # the winner's copy, untouched
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no .tmp- left


def test_a_failed_publish_without_a_winner_raises(tmp_path, monkeypatch):
    target = tmp_path / "target"
    target.mkdir()
    (target / "stray").write_text("x")  # not empty, and no config.json: nobody finished
    tmp = tmp_path / ".tmp-1"
    tmp.mkdir()
    with pytest.raises(OSError):
        shapes._publish(tmp, target)
