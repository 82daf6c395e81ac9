"""The repository is self-contained: what its docs, recipes and configs run or link to is inside it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.kernel_agnostic

ROOT = Path(__file__).resolve().parent.parent
# What a user reads or runs: docs, recipes, sweep configs, the build.
TEXT_SUFFIXES = {".md", ".sh", ".yaml", ".yml", ".toml", ".cfg"}
TEXT_NAMES = {"Makefile", "run"}
# Paths that only exist on some machine: a checkout's parent, a home, scratch space.
MACHINE_PATH = re.compile(r"(?<![\w.~$/-])/(?:work|root|home|tmp|mnt|srv|scratch)/[^\s'\"`)\]]*")
RELATIVE_UP = re.compile(r"(?<![\w./-])\.\./[^\s'\"`)\]>,;]*")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")
# A results folder named in a text; `git show COMMIT:benchmarks/results/...` (a run of the past) is not one.
RESULTS_FOLDER = re.compile(r"(?<![\w:/.-])benchmarks/results/([\w.-]+)")


def tracked_files() -> list[Path]:
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / f for f in files if (ROOT / f).is_file()]


def tracked_texts() -> list[Path]:
    return [p for p in tracked_files() if p.suffix in TEXT_SUFFIXES or p.name in TEXT_NAMES]


def inside(path: Path) -> bool:
    return path.resolve().is_relative_to(ROOT)


def resolves_inside(base: Path, target: str) -> bool:
    """`target` read from the file's folder (a link) or the repository root (a command run there) names
    something that exists inside the repository."""
    target = target.split("#")[0].rstrip(".:")
    return any(inside(b / target) and (b / target).exists() for b in (base, ROOT))


def test_there_are_texts_to_check():
    names = {p.relative_to(ROOT).as_posix() for p in tracked_texts()}
    assert {"README.md", "docs/benchmarks.md", "recipes/local-drafters.sh", "Makefile"} <= names
    assert any(n.startswith("benchmarks/") and n.endswith(".yaml") for n in names)


@pytest.mark.parametrize("path", tracked_texts(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_nothing_points_outside_the_repository(path: Path):
    text = path.read_text()
    bad = [m.group(0) for m in MACHINE_PATH.finditer(text)]
    bad += [m.group(0) for m in RELATIVE_UP.finditer(text) if not resolves_inside(path.parent, m.group(0))]
    assert not bad, f"{path.relative_to(ROOT)} points outside the repository: {sorted(set(bad))}"


@pytest.mark.parametrize(
    "path", [p for p in tracked_texts() if p.suffix == ".md"], ids=lambda p: p.relative_to(ROOT).as_posix()
)
def test_markdown_links_resolve(path: Path):
    targets = [t for t in MARKDOWN_LINK.findall(path.read_text()) if not re.match(r"[a-z]+:|#", t)]
    broken = [t for t in targets if not resolves_inside(path.parent, t)]
    assert not broken, f"{path.relative_to(ROOT)} links to what the repository lacks: {broken}"


@pytest.mark.parametrize(
    "path",
    tracked_texts() + [p for p in tracked_files() if p.suffix == ".py"],
    ids=lambda p: p.relative_to(ROOT).as_posix(),
)
def test_named_result_folders_exist(path: Path):
    """benchmarks/results/ keeps the latest result of each benchmark; earlier runs are cited by commit."""
    results = ROOT / "benchmarks" / "results"
    missing = sorted({m for m in RESULTS_FOLDER.findall(path.read_text()) if not (results / m).exists()})
    assert not missing, f"{path.relative_to(ROOT)} names results that are gone (cite the commit): {missing}"


def test_every_result_picture_is_shown_somewhere():
    shown = set()
    for doc in (p for p in tracked_texts() if p.suffix == ".md"):
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", doc.read_text()):
            shown.add((doc.parent / target).resolve())
    pictures = sorted((ROOT / "benchmarks" / "results").rglob("*.png"))
    assert pictures
    hidden = [p.relative_to(ROOT).as_posix() for p in pictures if p.resolve() not in shown]
    assert not hidden, f"embed these where their numbers are discussed: {hidden}"


def test_the_eval_sets_are_in_the_repository():
    data = ROOT / "benchmarks" / "data"
    for name, prompts in (("humaneval", 164), ("mbpp", 257), ("gsm8k", 1319), ("mt-bench", 80)):
        lines = (data / f"{name}.jsonl").read_text().splitlines()
        assert len(lines) == prompts
        assert '"turns"' in lines[0]
        assert f"`{name}.jsonl`" in (data / "README.md").read_text()  # its source and license are noted


def test_the_checks_catch_what_they_are_for(tmp_path: Path):
    doc = "run `bench spec --prompts ../shared/data/eval/humaneval.jsonl` or /work/shared/x.jsonl"
    assert [m.group(0) for m in MACHINE_PATH.finditer(doc)] == ["/work/shared/x.jsonl"]
    found = [m.group(0) for m in RELATIVE_UP.finditer(doc)]
    assert found == ["../shared/data/eval/humaneval.jsonl"]
    assert not resolves_inside(ROOT / "docs", found[0])
    assert resolves_inside(ROOT / "docs", "../README.md")
    assert resolves_inside(ROOT / "docs", "benchmarks/data/humaneval.jsonl")  # from the root
    assert not resolves_inside(ROOT, "../README.md")
    assert [m.group(0) for m in MACHINE_PATH.finditer("~/.cache/x $HOME/y /proc/cpuinfo")] == []
    named = "`benchmarks/results/quant-decode/`, `git show 8103c18:benchmarks/results/quant-decode-amx/x`"
    assert RESULTS_FOLDER.findall(named) == ["quant-decode"]
