"""The user documents (README.md, docs/*.md) stay true to the repository they ship in.

- Every relative link resolves to a file inside the repository, and a `#anchor` to a heading of
  that file (GitHub's slugs).
- Every `--flag` they name for `coordinator`, `worker` or ctl exists in that program's `--help`.
  A flag is attributed to a program by where it stands: a command line (in a code block or an
  inline code span) that starts with the program's name, or the first column of a flag table under
  the program's own heading in docs/operations.md. A flag named anywhere else must exist in one of
  the three programs or in a script of scripts/ (its `add_argument`s).
- No document carries the history of how the code was built (sittings, sessions, numbered stops).
- The README's test command is CI's, and the protocol version it shows is the one the code speaks.

The programs' help comes from subprocesses (`python -m worker` ends its process with os._exit), all
started at once and read once per test session.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLAG_DOCS = [ROOT / "README.md", ROOT / "docs" / "operations.md"]

HISTORY = re.compile(
    r"\bsittings?\b|\bsessions?\b|\bstop \d+\b|\bround of work\b|\bprobe files?\b|/tmp/\S*probe"
    r"|\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth) (?:day|run of work)\b",
    re.IGNORECASE)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
HELP_OPTION = re.compile(r"^\s{2}(?:-\w(?: \S+)?, )?(--[a-z][a-z0-9-]*)")
CTL_COMMANDS = ("status", "plan", "graph", "events", "drain", "slowdown", "save", "checkpoint", "layout", "stop", "report")
CTL_NAMES = ("adaptrain-ctl", "python scripts/ctl.py", "scripts/ctl.py")


# --- reading documents ------------------------------------------------------------------------

def _without_code_blocks(text: str) -> str:
    """The text with fenced code blocks blanked (line count kept), for links and headings."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return "\n".join(out)


def _code_blocks(text: str) -> list[str]:
    """The lines inside fenced code blocks, with backslash continuations joined."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            lines.append(line)
    joined: list[str] = []
    for line in lines:
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1] + " " + line.strip()
        else:
            joined.append(line)
    return joined


def _inline_code(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", _without_code_blocks(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in _without_code_blocks(path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Each relative link of `path` that does not resolve inside `root` (or to a heading there)."""
    bad = []
    for target in LINK.findall(_without_code_blocks(path.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path.resolve()
        if not dest.is_relative_to(root.resolve()):
            bad.append(f"{path.name}: {target} (outside the repository)")
        elif not dest.exists():
            bad.append(f"{path.name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{path.name}: {target} (no heading #{anchor} in {dest.name})")
    return bad


# --- the programs' flags ------------------------------------------------------------------------

def _help_commands() -> dict[str, list[str]]:
    py = sys.executable
    commands = {"coordinator": [py, "-m", "coordinator", "--help"],
                "coordinator keygen": [py, "-m", "coordinator", "keygen", "--help"],
                "worker": [py, "-m", "worker", "--help"],
                "ctl": [py, "scripts/ctl.py", "--help"]}
    commands.update({f"ctl {c}": [py, "scripts/ctl.py", c, "--help"] for c in CTL_COMMANDS})
    return commands


@cache
def program_flags() -> dict[str, frozenset[str]]:
    """Flags each program (and each ctl command, and `coordinator keygen`) declares in its --help."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "COLUMNS": "200"}
    procs = {name: subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for name, cmd in _help_commands().items()}
    flags: dict[str, frozenset[str]] = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and "usage:" in out, f"{name} --help failed: {err[-500:]}"
        flags[name] = frozenset(m.group(1) for line in out.splitlines() if (m := HELP_OPTION.match(line)))
    return flags


@cache
def script_flags() -> frozenset[str]:
    """Flags the other scripts declare (benchmarks, demo): a flag in prose may be theirs."""
    found: set[str] = set()
    for path in (ROOT / "scripts").glob("*.py"):
        found.update(re.findall(r"add_argument\(\s*\"(--[a-z][a-z0-9-]*)\"", path.read_text(encoding="utf-8")))
    return frozenset(found)


def _command_of(line: str) -> tuple[str, str] | None:
    """(program, the rest) when `line` is a command of coordinator, worker or ctl."""
    line = line.split(" #", 1)[0].strip().removeprefix("$ ")
    for name in CTL_NAMES:
        if line.startswith(name + " ") or line == name:
            return "ctl", line[len(name):]
    for name in ("coordinator", "worker"):
        for prefix in (name, f"python -m {name}"):
            if line.startswith(prefix + " "):
                return name, line[len(prefix):]
    return None


def _flags_for(program: str, rest: str) -> frozenset[str]:
    flags = program_flags()
    words = rest.split()
    if program == "coordinator" and words[:1] == ["keygen"]:
        return flags["coordinator keygen"]
    if program == "ctl":
        command = next((w for w in words if w in CTL_COMMANDS), None)
        if command is not None:
            return flags["ctl"] | flags[f"ctl {command}"]
        return flags["ctl"].union(*(flags[f"ctl {c}"] for c in CTL_COMMANDS))
    return flags[program]


def _section_program(heading: str) -> str | None:
    words = heading.strip("# ").strip("`")
    return {"coordinator": "coordinator", "worker": "worker", "adaptrain-ctl": "ctl"}.get(words)


def unknown_flags(path: Path) -> list[str]:
    """Each `--flag` that `path` names for a program whose --help does not have it."""
    text = path.read_text(encoding="utf-8")
    bad: list[str] = []
    known_anywhere = script_flags().union(*program_flags().values())
    # Command lines, in code blocks and inline code.
    command_spans = []
    for line in [*_code_blocks(text), *_inline_code(text)]:
        found = _command_of(line)
        if found is None:
            continue
        program, rest = found
        command_spans.append(line)
        allowed = _flags_for(program, rest)
        bad += [f"{path.name}: {flag} in `{line.strip()[:60]}`: not in {program}'s --help"
                for flag in FLAG.findall(rest.split(" #", 1)[0]) if flag not in allowed]
    # Flag tables under a program's own heading.
    section: str | None = None
    for line in _without_code_blocks(text).splitlines():
        if line.startswith("#"):
            section = _section_program(line) if line.startswith("## ") else section
            continue
        if section and line.startswith("| `--"):
            first_cell = line.split("|")[1]
            if section == "ctl":
                allowed = _flags_for("ctl", "")
            else:
                allowed = program_flags()[section]
            bad += [f"{path.name}: {flag} in the {section} flag table: not in its --help"
                    for flag in FLAG.findall(first_cell) if flag not in allowed]
    # Anything else must at least exist somewhere.
    prose = _without_code_blocks(text)
    for span in command_spans:
        prose = prose.replace(span, "")
    bad += [f"{path.name}: {flag}: no program or script of this repository has it"
            for flag in FLAG.findall(prose) if flag not in known_anywhere]
    return sorted(set(bad))


# --- the tests -------------------------------------------------------------------------------

@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path) == []


@pytest.mark.process
@pytest.mark.parametrize("path", FLAG_DOCS, ids=lambda p: p.name)
def test_flags_exist_in_the_programs_help(path: Path) -> None:
    assert unknown_flags(path) == []


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_no_building_history(path: Path) -> None:
    hits = [f"{path.name}:{n}: {m.group(0)!r}" for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            for m in HISTORY.finditer(line)]
    assert hits == []


def test_readme_test_command_is_ci_s() -> None:
    last = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip()][-1]
    commands = [line.split("#", 1)[0].strip() for line in _code_blocks((ROOT / "README.md").read_text())]
    assert last in commands, f"the README's code blocks lack CI's command {last!r}"
    assert "make demo" in commands


def test_protocol_version_shown_is_the_code_s() -> None:
    from transport.messages import PROTOCOL_VERSION

    for path in DOCS:
        for shown in re.findall(r"protocol=(\d+)", path.read_text(encoding="utf-8")):
            assert int(shown) == PROTOCOL_VERSION, f"{path.name} shows protocol={shown}, the code speaks {PROTOCOL_VERSION}"


# --- the checks themselves catch what they are for ------------------------------------------

@pytest.mark.process
def test_checks_catch_a_broken_link_an_unknown_flag_and_history(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## What \"exact\" means\n")
    doc = tmp_path / "README.md"
    doc.write_text(
        "# x\n\n[ok](docs/a.md#what-exact-means) [ok](#x) [web](https://example.com)\n"
        "[gone](docs/missing.md) [anchor](docs/a.md#nowhere) [out](../outside.md)\n\n"
        "```bash\nworker --join tcp://h:1 --keys k --no-such-flag   # comment --also-ignored\n"
        "coordinator --bind tcp://h:1 \\\n    --join-abandons auto --lease 2\n```\n\n"
        "Run `adaptrain-ctl events --follow` or `adaptrain-ctl status --explain`; prose names `--bind` and"
        " `--made-up`. In the eleventh " + "sit" + "ting we measured.\n")  # (a word this repo's own checks flag)
    links = broken_links(doc, root=tmp_path)
    assert [b.split(": ", 1)[1].split(" ")[0] for b in links] == ["docs/missing.md", "docs/a.md#nowhere",
                                                                  "../outside.md"]
    flags = unknown_flags(doc)
    assert any("--no-such-flag" in b and "worker" in b for b in flags), flags
    assert any("--explain" in b and "ctl" in b for b in flags), flags  # a `plan` flag, not `status`'s
    assert any("--made-up" in b for b in flags), flags
    assert not any(f in b for b in flags for f in ("--join-abandons", "--lease", "--follow", "--bind",
                                                   "--also-ignored")), flags
    assert HISTORY.search(doc.read_text())
