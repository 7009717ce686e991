"""Child process of test_vulkan_sync.py (validation layers are chosen when Vulkan
starts, so they need a process of their own).

    python _vulkan_sync_run.py MODEL.gguf barrier|submit|none [KV_DTYPE] [MERGE]

Runs the model on Vulkan with device-local buffers, split decode attention and the GPU
mat-vec layout (lanes along a row, row-major weights), as on a GPU, with the given inter-dispatch sync and KV row format (default bf16; e.g. tq4/tq3):
prefill, SnapKV compaction (with MERGE > 0 that many merged rows: their writes and the
attention bias buffer), a cache branch, decode. Prints one JSON line with the greedy tokens, the
last logits, and whether the Khronos validation layer's library is loaded."""
import json
import sys

import numpy as np

import backends
import engine
from backends.vulkan import backend as vk_backend


def run_sequence(model) -> dict:
    """Prefill 60 tokens (SnapKV compacts to 24 rows), branch the cache, decode 4 greedy
    tokens on the original and one on the branch. test_vulkan_sync runs it on CPU too."""
    ids = [int(i) for i in np.random.default_rng(0).integers(3, 200, 60)]
    cache, logits = model.prefill(ids)
    branch = cache.copy()
    tokens = []
    for _ in range(4):
        tokens.append(int(np.argmax(logits)))
        logits = model.forward.decode(tokens[-1], cache)
    logits_branch = model.forward.decode(tokens[0], branch)
    return {"tokens": tokens, "logits": np.asarray(logits, float).tolist(),
            "branch": np.asarray(logits_branch, float).tolist(), "rows": cache.length}


def main() -> None:
    path, mode = sys.argv[1], sys.argv[2]
    kv_dtype = sys.argv[3] if len(sys.argv) > 3 else "bf16"
    merge = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    if mode == "submit":
        vk_backend.OpGlobalBarrier = None                 # as if the extension were not built

    def get_backend(name="cpu", threads=None, quiet=False, auto_gpu_only=False):
        b = vk_backend.VulkanBackend(device_local=True)
        b.decode_lanes, b.decode_splits = False, vk_backend.shaders.DECODE_SPLITS   # a GPU's split decode
        b.matmul_cpu_layout = False                        # and mat-vec layout (row-major weights)
        if mode == "none":
            b._sync = None                                 # the race the barrier exists to prevent
        backends.check_complete(b)
        return b

    backends.get_backend = get_backend
    model = engine.load(path, backend="vulkan", snapkv_budget=24, snapkv_window=8, snapkv_min_tokens=16,
                        kv_dtype=kv_dtype, snapkv_merge=merge)
    assert model.backend._sync == (None if mode == "none" else mode), model.backend._sync
    with open("/proc/self/maps") as f:
        layer = "libVkLayer_khronos_validation" in f.read()
    print(json.dumps(dict(run_sequence(model), validation_layer=layer)))

if __name__ == "__main__":
    main()
