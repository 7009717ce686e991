#!/usr/bin/env python3
"""Seconds per test file from a pytest run with --durations=0, as tests/durations.json
(tests/conftest.py runs the longest files first, so `make test`'s two workers end
together rather than one waiting on a long file picked up last).

    .venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=0 > run.log
    .venv/bin/python tools/test_durations.py run.log            # writes tests/durations.json
"""
from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*([0-9.]+)s (?:setup|call|teardown)\s+(\S+?)::")


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 1
    seconds: dict[str, float] = defaultdict(float)
    for line in Path(sys.argv[1]).read_text(errors="replace").splitlines():
        m = LINE.match(line)
        if m:
            seconds[m.group(2)] += float(m.group(1))
    if not seconds:
        print(f"no durations in {sys.argv[1]} (run pytest with --durations=0)", file=sys.stderr)
        return 1
    out = Path(__file__).resolve().parents[1] / "tests" / "durations.json"
    ranked = dict(sorted(((f, round(s, 1)) for f, s in seconds.items()), key=lambda kv: -kv[1]))
    out.write_text(json.dumps(ranked, indent=1) + "\n")
    print(f"{len(ranked)} files, {sum(ranked.values()):.0f} s in all; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
