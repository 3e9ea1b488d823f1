"""Thread runners' devices (scheduler/runners/devices.py, serve --devices): parsing, round-robin
assignment, and a server's runners built on them, sharing weights per device only."""

from __future__ import annotations

import pytest

from scheduler.runners.devices import device_of, parse_devices, visible_devices


def test_the_default_is_every_visible_gpu_else_the_cpu():
    assert visible_devices(0) == ("cpu",)
    assert visible_devices(2) == ("cuda:0", "cuda:1")
    assert parse_devices(None, 4) == ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    assert parse_devices("auto", 0) == ("cpu",)
    assert parse_devices("cpu", 8) == ("cpu",)
    assert parse_devices(" cuda:1, cuda:0 ", 2) == ("cuda:1", "cuda:0")


@pytest.mark.parametrize(
    "spec,match",
    [
        ("cuda:2", "not visible"),
        ("cuda:0,cuda:0", "twice"),
        ("cuda", "not cpu or cuda:N"),
        ("cpu,cuda:0", "not cpu or cuda:N"),
        ("gpu0", "not cpu or cuda:N"),
        ("cuda:-1", "not cpu or cuda:N"),
        ("", "not cpu or cuda:N"),
        ("cuda:0,", "not cpu or cuda:N"),
        ("cuda:99999999999", "not cpu or cuda:N"),
        ("x" * 5000, "devices must be"),
    ],
)
def test_bad_device_lists_are_refused_by_name(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_devices(spec, 2)


def test_runners_go_round_the_devices():
    devices = ("cuda:0", "cuda:1")
    got = [device_of(f"runner-{i}", devices) for i in range(5)]
    assert got == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert device_of("a-runner", devices) == "cuda:0"


def test_a_servers_runners_take_their_devices_and_share_weights_per_device(monkeypatch):
    """Four thread runners over two devices: runner-i on device i % 2, and the runners of
    one device (only they) share the first one's loaded weights."""
    from frontend.config import ServerConfig
    from frontend.state import cluster_spec
    from scheduler import build

    built = []

    class FakeRunner:
        def __init__(self, config, runner_id, shared=None):
            self.runner_id, self.device, self.shared = runner_id, config.model.device, shared
            self.engine = type("E", (), {"loaded": object()})()
            built.append(self)

    monkeypatch.setattr(build, "LocalRunner", FakeRunner)
    monkeypatch.setattr(build.Scheduler, "from_config", classmethod(lambda cls, *a, **k: a))
    with pytest.raises(ValueError, match="add --no-distkv"):
        ServerConfig(runners=4, devices=("cuda:0", "cuda:1"))
    config = ServerConfig(runners=4, devices=("cuda:0", "cuda:1"), distkv=False)
    _, runners, factory = build.build_scheduler(cluster_spec(config))
    assert [r.device for r in runners] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert runners[0].shared is None and runners[1].shared is None
    assert runners[2].shared is runners[0].engine.loaded
    assert runners[3].shared is runners[1].engine.loaded
    assert factory("runner-5").device == "cuda:1"  # scale-up goes round too


def test_serve_flags(capsys):
    from frontend.cli import build_parser, main, runner_devices

    args = build_parser().parse_args(["serve", "--devices", "cpu"])
    args.runner_backend = "thread"
    assert runner_devices(args) == ("cpu",)
    assert main(["serve", "--devices", "cuda:999"]) == 2
    assert "cuda:999 is not visible" in capsys.readouterr().err
    assert main(["serve", "--runner-backend", "ray", "--devices", "cpu"]) == 2
    assert "--devices is for thread runners" in capsys.readouterr().err
