#!/usr/bin/env python3
"""Precompile every Vulkan shader variant (shaders/*.comp x #define variants) to
SPIR-V with glslangValidator, into the cache the backend reads
($SNAPKV_SPIRV_CACHE, else ~/.cache/snapkv-engine/spirv).

    python tools/build_shaders.py [--list]

Exit 0 when every variant compiled; one line on stderr and exit 1 otherwise.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="print the variants and exit")
    args = ap.parse_args()
    from backends.vulkan import shaders
    from engine.errors import EngineError

    todo = shaders.variants()
    if args.list:
        for name, defines in todo:
            print(name, " ".join(defines))
        return 0
    t0 = time.perf_counter()
    try:
        for name, defines in todo:
            shaders.spirv(name, defines)
    except (EngineError, RuntimeError) as e:
        print(f"build_shaders: {e}", file=sys.stderr)
        return 1
    print(f"build_shaders: {len(todo)} variants in {shaders._cache_dir()} "
          f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
