import sys
from pathlib import Path

# The tests import their launch helpers as a plain module.
sys.path.insert(0, str(Path(__file__).resolve().parent))
