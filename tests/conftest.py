"""Test-wide settings: private temp and inductor cache folders (PyG and inductor write there), and under
pytest-xdist each worker's share of torch's threads."""

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

# Under pytest-xdist (README's test command: `-n auto`), each worker gets its share of the cores: torch's own
# default, all cores per process, would put two workers' thread pools on each core and spin them against each other.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    import torch

    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    _threads = max(1, _cores // _workers)
    torch.set_num_threads(_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))  # the processes tests start (launches, fresh imports)
