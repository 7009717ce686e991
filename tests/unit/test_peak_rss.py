"""peak_rss_mib reports a process's own peak: `engine bench` reads it in llama.cpp's
benchmark child, which Linux starts with the parent's ru_maxrss (it survives fork and
exec), so a child smaller than the engine's process used to report the engine's peak."""
import subprocess
import sys
from pathlib import Path

import numpy as np

from engine.model import peak_rss_mib

ROOT = Path(__file__).resolve().parents[2]


def test_a_child_of_a_large_process_reports_its_own_peak():
    held = np.ones(400 * 2 ** 20, np.uint8)          # 400 MiB resident in this process
    assert peak_rss_mib() >= 400
    r = subprocess.run([sys.executable, "-c", "from engine.model import peak_rss_mib; print(peak_rss_mib())"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert 0 < float(r.stdout) < 300, r.stdout      # the import's own few tens of MiB, not our 400+
    del held
