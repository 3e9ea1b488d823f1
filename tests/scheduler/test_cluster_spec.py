"""scheduler/build.py: the scheduler-side description of a cluster refuses what cannot start."""

from __future__ import annotations

import pytest

from punica_x.api import EngineConfig
from scheduler.build import ClusterSpec


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"backend": "k8s"}, "backend must be one of"),
        ({"backend": None}, "backend must be one of"),
        ({"runners": 0}, "at least one runner"),
        ({"runners": -3}, "at least one runner"),
    ],
)
def test_a_spec_that_cannot_start_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        ClusterSpec(EngineConfig(), **options)


def test_the_defaults_are_one_thread_runner():
    spec = ClusterSpec(EngineConfig())
    assert (spec.runners, spec.backend, spec.devices, spec.ray_address) == (1, "thread", (), None)
    assert spec.scheduler.distkv and spec.scheduler.fair_share
