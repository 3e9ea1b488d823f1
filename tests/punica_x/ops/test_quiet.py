"""punica_x/ops/quiet.py: the share of our CPUs other processes keep busy, from /proc/stat."""

from __future__ import annotations

import pytest

from punica_x.ops import quiet


def stat(cpu0: tuple[int, ...], cpu1: tuple[int, ...]) -> str:
    total = tuple(a + b for a, b in zip(cpu0, cpu1, strict=True))
    lines = [("cpu", total), ("cpu0", cpu0), ("cpu1", cpu1)]
    return "\n".join(f"{n} " + " ".join(map(str, v)) for n, v in lines) + "\nintr 1 2 3\n"


@pytest.fixture
def fake_stat(tmp_path, monkeypatch):
    """Two /proc/stat snapshots (before, after); this process's own ticks held at 0."""
    path = tmp_path / "stat"
    monkeypatch.setattr(quiet, "PROC_STAT", str(path))
    monkeypatch.setattr(quiet, "_own_ticks", lambda: 0.0)
    snapshots = []

    def sleep(seconds):
        path.write_text(snapshots.pop(0))

    monkeypatch.setattr(quiet.time, "sleep", sleep)

    def set_(before: str, after: str, cpus=(0, 1)):
        path.write_text(before)
        snapshots[:] = [after]
        monkeypatch.setattr(quiet, "_affinity", lambda: set(cpus))

    return set_


# fields: user nice system idle iowait irq softirq steal; a snapshot's ticks since boot
ZERO = (0, 0, 0, 10, 0, 0, 0, 0)


def test_an_idle_machine_is_quiet(fake_stat):
    fake_stat(stat(ZERO, ZERO), stat((1, 0, 0, 109, 0, 0, 0, 0), (0, 0, 0, 110, 0, 0, 0, 0)))
    busy = quiet.others_busy()
    assert busy == pytest.approx(0.005) and quiet.is_quiet(busy)


def test_two_busy_cores_are_not_quiet_and_iowait_counts_as_idle(fake_stat):
    fake_stat(stat(ZERO, ZERO), stat((90, 0, 10, 10, 0, 0, 0, 0), (0, 0, 50, 10, 50, 0, 0, 0)))
    busy = quiet.others_busy()
    assert busy == pytest.approx(0.75) and not quiet.is_quiet(busy)


def test_only_the_cpus_this_process_may_run_on_count(fake_stat):
    fake_stat(
        stat(ZERO, ZERO),
        stat((100, 0, 0, 10, 0, 0, 0, 0), (0, 0, 0, 110, 0, 0, 0, 0)),
        cpus=(1,),
    )
    assert quiet.others_busy() == 0.0


def test_this_process_own_work_is_not_load(fake_stat, monkeypatch):
    fake_stat(stat(ZERO, ZERO), stat((100, 0, 0, 10, 0, 0, 0, 0), (0, 0, 0, 110, 0, 0, 0, 0)))
    own = iter([0.0, 100.0])
    monkeypatch.setattr(quiet, "_own_ticks", lambda: next(own))
    assert quiet.others_busy() == 0.0


def test_no_proc_stat_counts_as_quiet(tmp_path, monkeypatch):
    monkeypatch.setattr(quiet, "PROC_STAT", str(tmp_path / "absent"))
    assert quiet.others_busy(0.0) is None and quiet.is_quiet(None)


def test_waiting_for_quiet_samples_until_it_is_or_patience_runs_out(monkeypatch):
    samples = iter([0.9, 0.8, 0.1])
    monkeypatch.setattr(quiet, "others_busy", lambda window_s: next(samples))
    assert quiet.wait_for_quiet(60) == 0.1
    samples = iter([0.9, 0.8])
    assert quiet.wait_for_quiet(0) == 0.9  # no patience: the first sample
