"""The docs and the command line agree: every flag that ``--help`` shows is
described in the docs, and every flag of the server's flag table exists.

``serve``'s flags are documented in ``docs/server.md``; the proxy's in
``docs/disaggregation.md``, ``docs/server.md`` (the shared log flags) and
``docs/security.md`` (the shared HTTP limits). The parser is the real one, built
in-process (no server starts).
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import pytest
from ec_frontend.entrypoints.cli import build_parser

DOCS = Path(__file__).resolve().parents[2] / "docs"
WHERE = {
    "serve": ("server.md",),
    "proxy": ("disaggregation.md", "server.md", "security.md"),
}


def _subcommand(name: str) -> argparse.ArgumentParser:
    (sub,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = sub.choices[name]
    return parser


def _shown_flags(parser: argparse.ArgumentParser) -> list[list[str]]:
    """Each option ``--help`` shows, as its long spellings (aliases together)."""
    flags = []
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
        if longs and action.help != argparse.SUPPRESS:
            flags.append(longs)
    return flags


@pytest.mark.parametrize("command", sorted(WHERE))
def test_every_flag_in_help_is_documented(command: str) -> None:
    text = "".join((DOCS / name).read_text() for name in WHERE[command])
    flags = _shown_flags(_subcommand(command))
    assert len(flags) > 30
    missing = [
        spellings[0]
        for spellings in flags
        if not any(re.search(re.escape(f) + r"(?![\w-])", text) for f in spellings)
    ]
    assert missing == [], f"flags of `{command} --help` not in {WHERE[command]}: {missing}"


def test_every_flag_of_the_server_table_exists() -> None:
    known = {o for a in _subcommand("serve")._actions for o in a.option_strings}
    rows = [
        line for line in (DOCS / "server.md").read_text().splitlines() if line.startswith("| `")
    ]
    mentioned = {flag for row in rows for flag in re.findall(r"`(--[a-z0-9-]+)", row)}
    assert len(mentioned) > 50
    assert sorted(mentioned - known) == []


def test_every_doc_stands_on_its_own() -> None:
    """The docs name files of this repository only, and each one they name exists
    (a glob or a ``<placeholder>`` must match something), or is a path the repository
    ignores, made by a run (``fuzz/corpus/<target>/``): a fresh clone has none yet."""
    root = DOCS.parent
    pages = [*sorted(DOCS.glob("*.md")), root / "README.md"]
    path = re.compile(r"`((?:docs|benches|tests|scripts|python|rust|fuzz|\.ci)/[^`\s:,)]*)")
    named, missing, outside = 0, [], []
    for page in pages:
        text = page.read_text()
        outside += [
            f"{page.name}: {m}" for m in re.findall(r"DESIGN\.md|STYLE\.md|\.\./shared", text)
        ]
        for match in path.finditer(text):
            ref = match.group(1).rstrip(".")
            named += 1
            pattern = re.sub(r"<[^>]*>|\{[^}]*\}", "*", ref)
            if not list(root.glob(pattern)) and not (root / ref).exists():
                missing.append(f"{page.name}: {ref}")
    generated = subprocess.run(
        ["git", "check-ignore", "--stdin", "--no-index"],
        input="\n".join(m.split(": ", 1)[1] for m in missing),
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    missing = [m for m in missing if m.split(": ", 1)[1] not in generated]
    assert named > 100
    assert outside == [] and missing == []
