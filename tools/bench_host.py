"""Host cost of a decode token on a GPU backend's host layer, without a GPU.

    .venv/bin/python tools/bench_host.py --backend cuda [--model smollm2] [--tokens 64]
        [--prompt 32] [--replay on|off] [--profile 15]

Loads the model on the real CudaBackend (the real op modules, argument lists and
launch geometry, the real `ex.function` lookup of runtime.HarnessExecutor) over a
no-op executor (NullExecutor): kernels are looked up as usual but a launch only
counts itself, arrays are numpy zeros/empty of the right shape, uploads are empty
arrays of the host's shape, downloads zeros, the GEMM nothing. Runs a prefill of a
short prompt and then --tokens decode steps (ForwardPass.decode), and reports per
decode token: kernel launches, graph launches (a replayed step, engine/replay.py: on a
GPU one CUDA graph launch, counted as such here), function lookups (module
get_function calls plus module builds), and host microseconds (median over the tokens,
time.perf_counter). --replay off: every kernel launched from Python each token.
--profile K: a cProfile of the decode loop (a second run), the top K functions by
tottime and the top K source files by their functions' tottime.
The last line is the host microseconds per token alone. Not a test (see
tests/cuda/test_host_launches.py); numbers and history in docs/cuda.md.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backends.cuda.runtime import HarnessExecutor  # noqa: E402


class Counts:
    def __init__(self):
        self.launches = 0       # NullFunction calls
        self.graphs = 0         # replays (one graph launch each on a GPU)
        self.lookups = 0        # NullModule.get_function calls
        self.builds = 0         # modules built (NullHarness.build)

    def snapshot(self) -> tuple[int, int, int, int]:
        return self.launches, self.lookups, self.builds, self.graphs


class NullFunction:
    """A kernel: calling it launches nothing and checks nothing; it counts."""
    __slots__ = ("counts", "name")

    def __init__(self, counts: Counts, name: str):
        self.counts, self.name = counts, name

    def __call__(self, grid, block, args, shared_mem=0, stream=None) -> None:
        self.counts.launches += 1


class NullModule:
    def __init__(self, counts: Counts):
        self.counts = counts

    def get_function(self, name: str) -> NullFunction:
        self.counts.lookups += 1                # cupy: a new Function (cuModuleGetFunction) per call
        return NullFunction(self.counts, name)


class NullHarness:
    """Stands in for backends/cuda/harness.py: `build` compiles nothing."""

    def __init__(self, counts: Counts):
        self.counts = counts

    def build(self, path, defines) -> NullModule:
        self.counts.builds += 1
        return NullModule(self.counts)


class NullExecutor(HarnessExecutor):
    """HarnessExecutor's `function` (the lookup the host layer really does) over modules
    that launch nothing; memory as numpy arrays whose contents nobody computes."""

    name = "null"
    label = "the no-op CUDA executor (tools/bench_host.py)"

    def __init__(self):
        super().__init__()
        self.counts = Counts()
        self._harness = NullHarness(self.counts)

    def zeros(self, shape, dtype=np.float32) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def empty(self, shape, dtype=np.float32) -> np.ndarray:
        return np.empty(shape, dtype=dtype)

    def asarray(self, host) -> np.ndarray:
        host = np.asarray(host)
        return np.empty(host.shape, dtype=host.dtype)

    def to_host(self, arr) -> np.ndarray:
        return np.zeros(arr.shape, dtype=arr.dtype)

    def gemm(self, x, w, out) -> None:
        self.unrecordable()

    def replay(self, recorded) -> None:
        """One graph launch on a GPU (CupyExecutor.replay): counted, nothing run."""
        self.counts.graphs += 1


@contextlib.contextmanager
def null_executor():
    """CudaBackend() built inside the block gets a NullExecutor."""
    from backends.cuda import backend as cuda_backend
    real = cuda_backend.make_executor
    cuda_backend.make_executor = lambda *a, **k: NullExecutor()
    try:
        yield
    finally:
        cuda_backend.make_executor = real


def load(model: str | None = None, ctx: int = 512, replay: str = "on"):
    """engine.load(model, backend="cuda") over a NullExecutor (no SnapKV)."""
    import engine
    with null_executor():
        m = engine.load(model, backend="cuda", ctx=ctx, snapkv_budget=0, decode_replay=replay)
    assert isinstance(m.backend.ex, NullExecutor)
    return m


def run(m, tokens: int, prompt: int = 128, profile=None) -> dict:
    """Prefill `prompt` token ids, then `tokens` decode steps; per-token counts and times
    (128 rows and more: every layer's decode attention has 2+ splits, so a steady launch count).
    `profile`: a cProfile.Profile enabled around each decode step."""
    fp, counts = m.forward, m.backend.ex.counts
    cache = fp.new_cache()
    ids = np.arange(10, 10 + prompt, dtype=np.int32)
    fp.prefill(ids, cache)
    launches, lookups, graphs, times = [], [], [], []
    token = 42
    for _ in range(tokens):
        before = counts.snapshot()
        if profile is not None:
            profile.enable()
        t0 = time.perf_counter()
        fp.decode(token, cache)
        dt = time.perf_counter() - t0
        if profile is not None:
            profile.disable()
        after = counts.snapshot()
        launches.append(after[0] - before[0])
        lookups.append((after[1] - before[1]) + (after[2] - before[2]))
        graphs.append(after[3] - before[3])
        times.append(dt)
    return {"launches": launches, "lookups": lookups, "graphs": graphs, "us": [t * 1e6 for t in times]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="cuda", choices=["cuda"])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128, help="prompt token ids prefilled first")
    p.add_argument("--replay", default="on", choices=["on", "off"],
                   help="decode through recorded steps (SHARPI_DECODE_REPLAY)")
    p.add_argument("--profile", type=int, default=0, metavar="K",
                   help="also profile the decode loop (a second run): top K by tottime")
    a = p.parse_args()
    m = load(a.model, ctx=a.prompt + a.tokens + 64, replay=a.replay)
    r = run(m, a.tokens, a.prompt)
    us = statistics.median(r["us"])
    print(f"model {Path(m.path).name}: {m.config.n_layers} layers, {a.tokens} decode tokens after a "
          f"{a.prompt}-token prefill, backend cuda, executor {m.backend.ex.name}, replay {a.replay}")
    print(f"launches/token: {statistics.median(r['launches']):g} "
          f"(first {r['launches'][0]}, min {min(r['launches'])}, max {max(r['launches'])})")
    print(f"graph launches/token: {statistics.median(r['graphs']):g}")
    print(f"lookups/token:  {statistics.median(r['lookups']):g} (first {r['lookups'][0]}, "
          f"after {max(r['lookups'][1:], default=0)} at most)")
    print(f"host us/token:  median {us:.1f}, min {min(r['us']):.1f}, max {max(r['us']):.1f}")
    if a.profile:
        import cProfile
        import io
        import pstats
        prof = cProfile.Profile()
        run(m, a.tokens, a.prompt, profile=prof)
        s = io.StringIO()
        stats = pstats.Stats(prof, stream=s)
        stats.sort_stats("tottime").print_stats(a.profile)
        print(s.getvalue().rstrip())
        by_file, calls = {}, {}                          # tottime and calls per source file
        for (file, _, func), (_, nc, tt, _, _) in stats.stats.items():
            key = func if file == "~" else str(Path(file).resolve()).replace(str(ROOT) + "/", "")
            by_file[key] = by_file.get(key, 0.0) + tt
            calls[key] = calls.get(key, 0) + nc
        total = sum(by_file.values()) or 1.0
        print("tottime by file (share, calls per token):")
        for key in sorted(by_file, key=by_file.get, reverse=True)[:a.profile]:
            print(f"  {by_file[key] / total * 100:5.1f}%  {calls[key] / a.tokens:7.0f}  {key}")
    print(f"{us:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
