"""`--threads N` holds the CPU backend to N threads: numba's kernels in every thread
that runs the model (numba's count is per thread; a server computes on its worker
thread) and the BLAS behind prefill's sgemms (process-wide). Run in a child process,
so the suite's own thread settings stay as they are."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = r"""
import sys, threading
import numba
from threadpoolctl import threadpool_info
import engine
from engine.generate import SamplingParams
from engine.serve.scheduler import Scheduler
from engine.serve.sequence import Finished, Job

model = engine.load(sys.argv[1], backend="cpu", threads=1, snapkv_budget=0)
blas = sorted({p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"})
seen, done = [], threading.Event()
real = model.forward.decode_batch
def decode_batch(tokens, caches, **kw):
    seen.append(numba.get_num_threads())
    return real(tokens, caches, **kw)
model.forward.decode_batch = decode_batch
def emit(event):
    if isinstance(event, Finished):
        done.set()
sched = Scheduler(model, max_running=2)
sched.start()
for ids in ([5, 6, 7], [8, 9, 10, 11]):
    sched.submit(Job(ids, SamplingParams(max_tokens=3, ignore_eos=True), None), emit)
assert done.wait(60)
sched.stop()
print(numba.get_num_threads(), blas, sorted(set(seen)))
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: every count is 1 already")
def test_threads_hold_numba_in_every_thread_and_the_blas(tiny_llama):
    r = subprocess.run([sys.executable, "-c", CHILD, str(tiny_llama)], capture_output=True, text=True,
                       cwd=ROOT, timeout=300, env={k: v for k, v in os.environ.items() if k != "SHARPI_THREADS"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("\n")[-2] == "1 [1] [1]", r.stdout


def test_float_weight_prefills_in_two_threads_do_not_share_scratch():
    """A server's worker and a caller may prefill at once: the float weights' mat-mat
    dequantizes row chunks into scratch and multiplies without the GIL, so each thread
    has its own (a shared one gave the other thread's weights)."""
    import threading

    import numpy as np
    from gguf import GGMLQuantizationType as Q

    from backends.cpu import quant
    rng = np.random.default_rng(0)
    rows, cols, n = 1024, 512, 32
    ws = [quant.load_weight(rng.standard_normal((rows, cols)).astype(np.float16).view(np.uint8), Q.F16,
                            (rows, cols)) for _ in range(2)]
    xs = [rng.standard_normal((n, cols)).astype(np.float32) for _ in range(2)]
    want = []
    for w, x in zip(ws, xs):
        want.append(np.empty((n, rows), np.float32))
        quant.matmul(w, x, want[-1])
    wrong = [0, 0]

    def worker(k):
        out = np.empty((n, rows), np.float32)
        for _ in range(60):
            quant.matmul(ws[k], xs[k], out)
            wrong[k] += not np.array_equal(out, want[k])
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == [0, 0]
