"""A benchmark run regenerates its section of the results README: its tables, command and
machine between markers, in place of the previous run's, the hand-written text kept."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

SCRIPT = """
import sys
sys.path.insert(0, {benchmarks!r})
from common.report import print_table, write_json
print_table([{{"x": 1, "y": {value}}}], ["x", "y"], "A table")
write_json("bench_probe", {{"value": {value}}}, group="probe")
"""


def run(tmp_path: Path, value: float) -> str:
    script = tmp_path / "bench_probe.py"
    script.write_text(SCRIPT.format(benchmarks=str(BENCHMARKS), value=value))
    env = {"PUNICA_X_RESULTS": str(tmp_path / "results"), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, str(script), "--flag"], check=True, env=env, timeout=120)
    return (tmp_path / "results" / "probe" / "README.md").read_text()


def test_a_run_replaces_its_own_section_and_keeps_the_rest(tmp_path):
    first = run(tmp_path, 1.5)
    assert "<!-- generated: bench_probe -->" in first and "| 1 | 1.500 |" in first
    assert "`python benchmarks/bench_probe.py --flag` on CPU:" in first
    readme = tmp_path / "results" / "probe" / "README.md"
    readme.write_text("# Probe machine\n\nHand-written notes.\n\n" + first + "\nMore notes.\n")
    second = run(tmp_path, 2.25)
    assert second.count("<!-- generated: bench_probe -->") == 1
    assert "| 1 | 2.250 |" in second and "1.500" not in second
    assert second.startswith("# Probe machine\n\nHand-written notes.")
    assert second.rstrip().endswith("More notes.")


def test_the_results_root_is_read_when_a_file_is_written(monkeypatch, tmp_path):
    """A test that sets $PUNICA_X_RESULTS after the report module was imported still keeps
    its files out of the repository's committed results."""
    from common import report

    monkeypatch.setenv("PUNICA_X_RESULTS", str(tmp_path / "elsewhere"))
    assert report.results_dir("probe") == tmp_path / "elsewhere" / "probe"
    monkeypatch.delenv("PUNICA_X_RESULTS")
    assert report.results_root() == BENCHMARKS / "results"
