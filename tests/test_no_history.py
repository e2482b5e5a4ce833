"""The project's files speak of the project as it is; its history belongs in git commits.

Docs (``docs/**/*.md``), ``README.md`` and every Python file of the three packages (programs
included) and of ``tests/`` are read as plain text (nothing is imported) and fail on words
that tell how the project was built: an issue number (``issue 20``, ``issue #20``, ``(#20)``,
``fixes #20``), a git commit hash, "(fixed)", "used to" as history ("it used to abort", "used
to raise"), "the old code", "review found", "fresh-eyes", "before/after the fix". A
regression test states the invariant it keeps, not the bug it once had. Each failure names
``file:line`` and the words.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
THIS = pathlib.Path(__file__).resolve()

_WORDS = "(?i:{})"
PATTERNS: dict[str, re.Pattern[str]] = {
    "an issue number": re.compile(_WORDS.format(r"\bissues?\s+#?\d+\b")),
    "an issue reference": re.compile(_WORDS.format(
        r"\((?:#\d+(?:,\s*)?)+\)"
        r"|\b(?:pr|pull request|fix|fixes|fixed|close|closes|closed|resolve|resolves|resolved"
        r"|see|refs?)\s+#\d+\b")),
    # 7-40 hex digits with at least one digit and one letter a-f, word-bounded: a commit hash
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"),
    "(fixed)": re.compile(_WORDS.format(r"\(fixed\)")),
    "'used to' as history": re.compile(_WORDS.format(
        r"\b(?:it|we|this|that|they|which|code|test|engine|server)\s+used\s+to\b"
        r"|\bused\s+to\s+(?:be|abort|raise|drop|give|die|crash|fail|return)\b")),
    "the old code": re.compile(_WORDS.format(r"\bthe\s+old\s+code\b")),
    "a review's findings": re.compile(_WORDS.format(r"\breview\s+found\b|\bfresh-eyes\b")),
    "before/after the fix": re.compile(_WORDS.format(r"\b(?:before|after)\s+the\s+fix\b")),
}

# Hex words that are not commit hashes (constants, digests in test data), each with its file.
ALLOWED: dict[str, set[str]] = {}


def _files() -> list[pathlib.Path]:
    files = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
    for package in ("servecore", "hybridattn", "mlxcache", "tests"):
        files += sorted((ROOT / package).rglob("*.py"))
    return [f for f in files if f.resolve() != THIS and f.is_file()]


def _problems(path: pathlib.Path) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    allowed = ALLOWED.get(rel, set())
    out = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for what, pattern in PATTERNS.items():
            for match in pattern.finditer(line):
                if match.group(0) in allowed:
                    continue
                out.append(f"{rel}:{number}: {what}: {match.group(0)!r}")
    return out


def test_the_files_it_reads_are_there():
    files = {f.relative_to(ROOT).as_posix() for f in _files()}
    assert {"README.md", "docs/index.md", "docs/benchmarks.md",
            "hybridattn/bench/serve.py", "tests/conftest.py"} <= files


@pytest.mark.parametrize("line, what", [
    ("the small prefill, beside issue 20's target", "an issue number"),
    ("see issue #7", "an issue number"),
    ("the routed experts (#12)", "an issue reference"),
    ("this fixes #3", "an issue reference"),
    ("git worktree add /tmp/base 64f4e51", "a commit hash"),
    ("the MLA call held four copies (fixed)", "(fixed)"),
    ("a worker thread used to abort at exit", "'used to' as history"),
    ("it used to drop every point", "'used to' as history"),
    ("it fails on the old code", "the old code"),
    ("what a review found", "a review's findings"),
    ("mlxcache kv_bits: fixes from a fresh-eyes review", "a review's findings"),
    ("5.1 ms before the fix", "before/after the fix"),
])
def test_each_pattern_catches_its_history(line, what):
    assert PATTERNS[what].search(line)


@pytest.mark.parametrize("line", [
    "MLA c_kv of layer #0 changed at slots [5]",   # a count, not an issue
    "the pool is used to hold one token per slot",  # 'used to' of purpose
    "colour #1f77b4, digest abc123",                # too short for a hash
    "deadbeef",                                     # no digit: a word, not a hash
    "a fixed-size state (fixed at construction)",
])
def test_what_is_not_history_passes(line):
    assert not any(p.search(line) for p in PATTERNS.values()), line


def test_no_file_speaks_of_how_the_project_was_built():
    problems = [p for f in _files() for p in _problems(f)]
    assert not problems, ("history belongs in git commits; state what holds now:\n"
                          + "\n".join(problems))
