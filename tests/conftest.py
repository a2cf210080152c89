import sys
from pathlib import Path

# scripts/ is not a package: the system tests use its LocalJob launcher.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
