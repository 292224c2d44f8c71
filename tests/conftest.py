"""Test configuration: makes ``tests/scripts`` importable (``harness``: launch deployments; ``kvhelp``: what
the launched training scripts share with the tests) and keeps every process single-threaded (2-core CI)."""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
