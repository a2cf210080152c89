"""The README's two commands stay runnable: `make demo`'s recipe calls scripts/demo.py with arguments
its parser accepts, and `make test` runs pytest. (A stray argument once made `make demo` exit 2 at
once, unnoticed, because CI runs only `make test`.)"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _recipe(target: str) -> list[str]:
    """The command lines of `target` in the Makefile (read as text: no `make` needed to check it)."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    out: list[str] = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        out.append(line.strip())
    return out


def test_make_demo_runs_the_demo_with_arguments_it_accepts() -> None:
    lines = [line for line in _recipe("demo") if "scripts/demo.py" in line]
    assert len(lines) == 1, lines
    argv = shlex.split(lines[0])
    args = argv[argv.index("scripts/demo.py") + 1:]
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import demo
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    demo.parser().parse_args(args)  # SystemExit(2) on an argument the demo does not take


def test_make_test_runs_pytest_and_refuses_an_empty_run() -> None:
    recipe = "\n".join(_recipe("test"))
    assert "-m pytest" in recipe
    assert "-eq 5" in recipe  # pytest's "no tests collected" is a failure, not a pass
