import sys
from pathlib import Path

# tests.support is importable as `support` from every test directory.
sys.path.insert(0, str(Path(__file__).resolve().parent))
