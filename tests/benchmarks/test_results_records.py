"""Every record a results README cites is in the tree: a table's figures keep their raw JSON
(and PNG) beside them, under the README's folder or by a path from the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
CITED = re.compile(r"[A-Za-z0-9_./-]+\.(?:json|png)\b")


def cited(readme: Path) -> list[str]:
    """The .json / .png names a README cites, outside URLs."""
    text = re.sub(r"https?://\S+", "", readme.read_text())
    return sorted(set(CITED.findall(text)))


def missing(readme: Path) -> list[str]:
    here = readme.parent
    places = (here, ROOT, ROOT / "benchmarks", RESULTS)
    return [n for n in cited(readme) if not any((p / n).exists() for p in places)]


def test_every_record_a_results_readme_cites_exists():
    readmes = sorted(RESULTS.glob("**/README.md"))
    assert len(readmes) >= 5
    gaps = {str(r.relative_to(ROOT)): missing(r) for r in readmes}
    assert {k: v for k, v in gaps.items() if v} == {}


def test_a_cited_record_that_is_gone_is_found(tmp_path):
    """The check itself: a README citing a file that is not there is reported."""
    readme = tmp_path / "README.md"
    (tmp_path / "bench_here.json").write_text("{}")
    readme.write_text("| a | b |\n(`bench_here.json`, bench_gone.json, bench_gone.png)\n")
    assert missing(readme) == ["bench_gone.json", "bench_gone.png"]
