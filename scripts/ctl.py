# ctl from a checkout: `python scripts/ctl.py --control tcp://HOST:PORT COMMAND ...`, from any
# directory. The tool itself is coordinator/ctl.py (installed as `adaptrain-ctl`); this shim only
# makes the repository importable when adaptrain is not installed, and calls it.

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from coordinator.ctl import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
