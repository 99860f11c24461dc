"""Test-wide settings: private temp and inductor cache folders (PyG and inductor write there)."""

import os
import tempfile
from pathlib import Path

_root = Path(__file__).resolve().parent.parent / ".tmp"
for var, sub in (("TMPDIR", "tmp"), ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
    if not os.environ.get(var):
        path = _root / sub
        path.mkdir(parents=True, exist_ok=True)
        os.environ[var] = str(path)
tempfile.tempdir = None  # re-read TMPDIR
