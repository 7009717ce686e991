"""Vulkan-specific checks the shared op table does not cover: device-array views
(the slices the forward pass takes), device listing, the sync mode, the instances'
portability enumeration (MoltenVK), and the one-line errors.
Tolerance for f32 ops against the f64 reference: NMSE < 1e-10 (as in test_ops)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from _backends import available_backends, make_backend, vulkan_reporting
from backends.reference import ReferenceBackend

pytestmark = pytest.mark.skipif("vulkan" not in available_backends(), reason="no Vulkan device / kp")
REF = ReferenceBackend()
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def vk():
    return make_backend("vulkan")


def nmse(a, b):
    return float(np.sum((np.asarray(a, np.float64) - b) ** 2) / np.sum(np.asarray(b, np.float64) ** 2))


def test_views_shape_and_download(vk):
    host = np.arange(7 * 10, dtype=np.float32).reshape(7, 10)
    a = vk.upload(host)
    assert a.shape == (7, 10) and a[:3].shape[0] == 3 and a[6:7].shape == (1, 10)
    np.testing.assert_array_equal(vk.download(a[2:5][:, 3:8]), host[2:5, 3:8])
    np.testing.assert_array_equal(vk.download(a[6:7]), host[6:7])
    b = vk.upload(np.arange(20, dtype=np.float32))
    np.testing.assert_array_equal(vk.download(b[5:9]), np.arange(5, 9, dtype=np.float32))


def test_column_slices_in_and_out(vk):
    """rms_norm / silu_gate / add / rope on column views leave the other columns alone."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, 200)).astype(np.float32)
    w = rng.standard_normal(300).astype(np.float32)
    out = np.full((7, 200), 5.0, np.float32)
    dx, dw, do = vk.upload(x), vk.upload(w), vk.upload(out)
    vk.rms_norm(dx[:, 64:128], dw[10:74], 1e-6, do[:, 100:164])
    want = np.empty((7, 64), np.float32)
    REF.rms_norm(x[:, 64:128], w[10:74], 1e-6, want)
    got = vk.download(do)
    assert nmse(got[:, 100:164], want) < 1e-10
    assert np.all(got[:, :100] == 5.0) and np.all(got[:, 164:] == 5.0)
    vk.silu_gate(dx[2:5][:, :50], dx[2:5][:, 50:100], do[2:5][:, :50])
    REF.silu_gate(x[2:5, :50], x[2:5, 50:100], want := np.empty((3, 50), np.float32))
    assert nmse(vk.download(do)[2:5, :50], want) < 1e-10
    vk.add(dx[:, 100:150], dx[:, 150:200], dx[:, 100:150])
    np.testing.assert_array_equal(vk.download(dx)[:, 100:150], x[:, 100:150] + x[:, 150:200])
    y = rng.standard_normal((3, 300)).astype(np.float32)
    dy = vk.upload(y)
    vk.rope(dy[1:3][:, 12:], np.array([7, 8], np.int32), 2, 64, 64, 10000.0, True)
    want = y[1:3, 12:].copy()
    REF.rope(want, np.array([7, 8], np.int32), 2, 64, 64, 10000.0, True)
    got = vk.download(dy)
    assert nmse(got[1:3, 12:], want) < 1e-10
    np.testing.assert_array_equal(got[0], y[0])
    np.testing.assert_array_equal(got[1:3, :12], y[1:3, :12])


def test_list_devices_and_name():
    from backends.vulkan import list_devices
    devs = list_devices()
    assert devs and {"name", "type", "vendor"} <= set(devs[0])
    assert all(d["type"] in ("cpu", "discrete", "integrated", "virtual", "other") for d in devs)


def test_missing_kp_is_one_line(monkeypatch):
    from backends.vulkan import backend as mod
    from engine.errors import BackendUnavailable
    monkeypatch.setattr(mod, "kp", None)
    monkeypatch.setattr(mod, "_KP_ERROR", "ModuleNotFoundError: No module named 'kp'", raising=False)
    with pytest.raises(BackendUnavailable, match="needs the Python package 'kp'") as e:
        mod.VulkanBackend()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("who", ["kp", "ctypes"])
def test_instances_enumerate_portability_drivers(who):
    """MoltenVK is a portability driver: the loader lists it only to an instance created
    with VK_KHR_portability_enumeration and its flag. Both instances (kp's, patched by
    tools/kp-0.9.0.patch, and device.py's) ask for them when the loader offers them;
    the loader's debug log says when it honours the flag."""
    import platform
    import subprocess
    import sys
    from backends.vulkan import device
    if device.PORTABILITY_EXT not in device._instance_extensions(device._loader(platform.system())):
        pytest.skip("this Vulkan loader has no VK_KHR_portability_enumeration")
    code = {"kp": "import kp; kp.Manager().destroy()",
            "ctypes": "from backends.vulkan.device import list_devices; assert list_devices()"}[who]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, VK_LOADER_DEBUG="all"), cwd=os.path.dirname(os.path.dirname(HERE)))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Portability enumeration bit was set" in r.stdout + r.stderr


def test_failed_allocation_is_one_line(monkeypatch):
    """kp (built with tools/kp-0.9.0.patch) raises when vkAllocateMemory fails; the
    backend turns it into one line naming the size and the device."""
    from backends.vulkan import backend as mod
    from engine.errors import BackendUnavailable
    b = mod.VulkanBackend()

    class OutOfMemory:
        def tensor_t(self, *args):
            raise RuntimeError("Kompute: vkAllocateMemory failed: ErrorOutOfDeviceMemory")
    monkeypatch.setattr(b, "mgr", OutOfMemory())
    with pytest.raises(BackendUnavailable, match=r"cannot allocate 4\.0 MiB on .*ErrorOutOfDeviceMemory") as e:
        b.upload(np.zeros((1024, 1024), np.float32))
    assert "\n" not in str(e.value)


def test_gpu_required_but_only_cpu_device():
    from backends.vulkan.device import pick_device
    from engine.errors import BackendUnavailable
    with pytest.raises(BackendUnavailable, match="only a CPU Vulkan device"):
        pick_device([{"index": 0, "name": "llvmpipe", "type": "cpu", "vendor": "Mesa"}], allow_cpu=False)
    with pytest.raises(BackendUnavailable, match="no Vulkan device found"):
        pick_device([])


@pytest.mark.parametrize("device_type,device_local,synced", [("cpu", False, False), ("cpu", True, True),
                                                             ("integrated", False, True), ("discrete", True, True)])
def test_sync_follows_the_device_type_not_the_memory_type(monkeypatch, device_type, device_local, synced):
    """Host-visible buffers on a GPU still get barriers between dispatches: lavapipe,
    reported as a GPU, with either memory type."""
    mod, index = vulkan_reporting(monkeypatch, device_type)
    b = mod.VulkanBackend(device=index, device_local=device_local)
    assert (b._sync is not None) == synced and b._sync in (None, "barrier", "submit")
    assert (b._ttype == mod.kp.TensorTypes.device) == device_local
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = b.alloc((3, 4))
    b.add(b.upload(x), b.upload(x), out)
    recorded, record = [], b._record
    b._record = lambda op: (recorded.append(op), record(op))
    np.testing.assert_array_equal(b.download(out), 2 * x)
    if b._sync == "barrier" and not device_local:    # shaders wrote host-visible memory the host reads:
        assert b._host_barrier in recorded           # a fence wait alone does not make it visible


def test_small_uploads_join_the_pending_batch_on_gpus(monkeypatch):
    """On a GPU (device-local buffers and barriers, imitated on lavapipe) a small upload's
    staging copy is recorded into the pending batch, not submitted and awaited alone, so
    the host does not wait there for the work in flight (each prefill chunk uploads its
    token ids); the dispatches after it read its data."""
    mod, index = vulkan_reporting(monkeypatch, "discrete")
    b = mod.VulkanBackend(device=index, device_local=True)
    if b._sync != "barrier":
        pytest.skip("the kp barrier extension is not built (tools/build_kp_barrier.py)")
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = b.alloc((3, 4))
    b.synchronize()
    before = b.submissions
    b.add(b.upload(x), b.upload(x + 1), out)
    assert b.submissions == before
    np.testing.assert_array_equal(b.download(out), 2 * x + 1)
    assert b.submissions == before + 1


def test_small_device_limits_fail_with_the_named_limit(monkeypatch):
    """A device below what our shaders bind, allocate or dispatch fails in one line that
    names the limit, before anything is created (simulated limits on lavapipe)."""
    from engine.errors import BackendUnavailable
    mod, index = vulkan_reporting(monkeypatch, max_storage_buffers_per_stage=4)
    with pytest.raises(BackendUnavailable, match=r"allows 4 storage buffers .*maxPerStageDescriptorStorageBuffers"):
        mod.VulkanBackend(device=index)
    mod, index = vulkan_reporting(monkeypatch, max_workgroup_invocations=128)
    with pytest.raises(BackendUnavailable, match=r"at most 128 invocations .*maxComputeWorkGroupInvocations"):
        mod.VulkanBackend(device=index)
    mod, index = vulkan_reporting(monkeypatch, max_allocation_size=1 << 20, max_workgroup_count=(8, 8, 8))
    b = mod.VulkanBackend(device=index)
    b.alloc((256, 1024))                                   # exactly 1 MiB: allowed
    with pytest.raises(BackendUnavailable, match=r"buffer of 2 MiB .*maxMemoryAllocationSize, 1 MiB\)"):
        b.alloc((512, 1024))
    x = np.ones((1, 64), np.float32)
    out = b.alloc((1, 64))
    b.add(b.upload(x), b.upload(x), out)                   # a grid within 8 workgroups runs
    np.testing.assert_array_equal(b.download(out), 2 * x)
    big = b.upload(np.ones((64, 1024), np.float32))
    with pytest.raises(BackendUnavailable, match=r"needs \d+ workgroups along axis 0, .* allows 8 "
                                                 r"\(maxComputeWorkGroupCount\)"):
        b.add(big, big, b.alloc((64, 1024)))


def test_a_failed_submission_is_one_line_and_leaves_nothing_pending():
    """kp (patched) raises when vkQueueSubmit / vkWaitForFences fail (device lost, out of
    memory); the backend turns that into one line naming the device (a lost device is a
    DeviceFault: the process must restart), and drops the batch."""
    from engine.errors import DeviceFault
    b = make_backend("vulkan")

    class Lost:
        def eval(self):
            raise RuntimeError("Kompute: vkQueueSubmit failed: ErrorDeviceLost")

        eval_async = eval

    for call in (b.flush, b.submit):
        b._seq = Lost()
        with pytest.raises(DeviceFault, match=r"^backend 'vulkan': .*: Kompute: vkQueueSubmit failed: "
                                              r"ErrorDeviceLost: the device was lost; restart the process"):
            call()
        assert b._seq is None and not b._in_flight
    b._seq = type("Other", (), {"eval": lambda self: (_ for _ in ()).throw(RuntimeError("not kp"))})()
    with pytest.raises(RuntimeError, match="not kp"):       # anything else is not ours to rename
        b.flush()


def test_a_submission_runs_while_python_goes_on(vk):
    """kp (patched) submits eval_async without waiting, and eval / eval_await release the
    GIL while the device works: after submit() the host records the next batch while the
    first runs (a prefill's chunks), and while it waits, a server's other threads run."""
    import threading
    import time
    x = vk.upload(np.ones((4096, 1024), np.float32))
    for _ in range(24):
        vk.add(x, x, x)
    t0 = time.perf_counter()
    vk.submit()
    submitted = time.perf_counter() - t0
    assert vk._in_flight and vk._in_flight[0][0].is_running()        # not awaited by submit
    count, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    before, t0 = count[0], time.perf_counter()
    vk.flush()                                                        # waits in eval_await
    waited, ran = time.perf_counter() - t0, count[0] - before
    stop.set()
    t.join()
    assert waited > 5 * submitted and ran > 1000, (submitted, waited, ran)
    np.testing.assert_array_equal(vk.download(x)[:2, :3], np.full((2, 3), 2.0 ** 24, np.float32))


# -- Gemma 3 ops: grouped rms_norm, scale, gelu_gate, sliding-window attention --------
# The views, aliasing and saturation cases the forward pass hits; the shared parity cases
# in test_ops.py cover the plain shapes. Oracle: backends/reference.py.
def ref(op, *args):
    """Run a reference op whose last argument is its output; return that output (f64)."""
    out = np.empty(np.shape(args[0]), np.float64)
    getattr(REF, op)(*args, out)
    return out


@pytest.mark.parametrize("n,n_heads,head_dim", [(1, 8, 256), (7, 9, 64), (5, 32, 128), (3, 1, 576)])
def test_rms_norm_per_head_in_place(vk, n, n_heads, head_dim):
    """Gemma 3's Q norm: weight [head_dim] over the q columns of a fused qkv buffer, in place;
    the K/V columns after them are left alone. (1 head: the usual row norm, in place.)"""
    rng = np.random.default_rng(n * head_dim + n_heads)
    width = n_heads * head_dim
    qkv = (rng.standard_normal((n, width + 2 * head_dim)) * 3).astype(np.float32)
    qkv[:, :head_dim] *= 100.0                                # groups of very different scale
    w = rng.standard_normal(head_dim).astype(np.float32)
    dx = vk.upload(qkv)
    vk.rms_norm(dx[:, :width], vk.upload(w), 1e-6, dx[:, :width])
    got = vk.download(dx)
    assert nmse(got[:, :width], ref("rms_norm", qkv[:, :width], w, 1e-6)) < 1e-10
    np.testing.assert_array_equal(got[:, width:], qkv[:, width:])


def test_rms_norm_groups_out_of_place_and_bad_group(vk):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 384)).astype(np.float32)
    w = rng.standard_normal(200).astype(np.float32)
    out = vk.alloc((4, 384))
    vk.rms_norm(vk.upload(x), vk.upload(w)[72:200], 1e-5, out)         # weight view, g = 128
    assert nmse(vk.download(out), ref("rms_norm", x, w[72:200], 1e-5)) < 1e-10
    with pytest.raises(ValueError, match="rms_norm"):
        vk.rms_norm(vk.upload(x), vk.upload(w[:100]), 1e-5, out)       # 100 does not divide 384


def test_scale(vk):
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((7, 300)) * 10).astype(np.float32)
    s = float(np.sqrt(np.float32(2304.0)))                             # Gemma's sqrt(n_embd)
    want = x * np.float32(s)                                           # one f32 multiply: exact
    out = vk.alloc((7, 300))
    vk.scale(vk.upload(x), s, out)
    np.testing.assert_array_equal(vk.download(out), want)
    dx = vk.upload(x)                                                  # in place, on a view
    vk.scale(dx[2:5][:, 100:200], -0.5, dx[2:5][:, 100:200])
    got = vk.download(dx)
    np.testing.assert_array_equal(got[2:5, 100:200], x[2:5, 100:200] * np.float32(-0.5))
    got[2:5, 100:200] = x[2:5, 100:200]
    np.testing.assert_array_equal(got, x)


@pytest.mark.parametrize("n,f", [(1, 1152), (7, 100), (40, 6912)])
def test_gelu_gate(vk, n, f):
    rng = np.random.default_rng(n + f)
    gate = (rng.standard_normal((n, f)) * 4).astype(np.float32)
    gate[0, :8] = [-1e4, 1e4, -100.0, 100.0, -10.0, 10.0, 0.0, -3.0]   # tanh saturation both ways
    up = rng.standard_normal((n, f)).astype(np.float32)
    out = vk.alloc((n, f))
    vk.gelu_gate(vk.upload(gate), vk.upload(up), out)
    got = vk.download(out)
    assert np.all(np.isfinite(got))
    want = ref("gelu_gate", gate, up)
    assert nmse(got, want) < 1e-10
    np.testing.assert_allclose(got[0, :8], want[0, :8], rtol=1e-6, atol=1e-30)


def test_gelu_gate_in_place_on_views(vk):
    """The forward pass's fused gate|up buffer: out aliases the gate columns."""
    rng = np.random.default_rng(6)
    gu = (rng.standard_normal((3, 200)) * 3).astype(np.float32)
    d = vk.upload(gu)
    vk.gelu_gate(d[:, :100], d[:, 100:], d[:, :100])
    got = vk.download(d)
    assert nmse(got[:, :100], ref("gelu_gate", gu[:, :100], gu[:, 100:])) < 1e-10
    np.testing.assert_array_equal(got[:, 100:], gu[:, 100:])


def windowed_pool(rng, n_rows, n_kv, page_size, head_dim, first_visible):
    """Pools with rows 0..n_rows-1 written and then rows below `first_visible` (and every
    unused slot) NaN: a read below the window shows up as NaN."""
    from backends.bf16 import BF16_QNAN, f32_to_bf16
    n_used = -(-n_rows // page_size)
    shape = (n_used + 2, n_kv, page_size, head_dim)
    k_pages, v_pages = np.full(shape, BF16_QNAN, np.uint16), np.full(shape, BF16_QNAN, np.uint16)
    page_table = rng.permutation(n_used + 2).astype(np.int32)[:n_used + 1]
    rows = np.arange(first_visible, n_rows)
    page, off = page_table[rows // page_size], rows % page_size
    for pages in (k_pages, v_pages):
        vals = rng.standard_normal((len(rows), n_kv, head_dim)) * 2.0
        pages[page, :, off, :] = f32_to_bf16(vals.astype(np.float32))
    return k_pages, v_pages, page_table


@pytest.mark.parametrize("n_q,n_kv,head_dim,page_size", [(9, 3, 64, 16), (32, 8, 128, 16), (8, 4, 256, 256)])
@pytest.mark.parametrize("start_row,n,window", [
    (0, 7, 3), (37, 7, 5), (5, 40, 16), (300, 64, 100), (250, 1, 64), (10, 5, 1), (3, 9, 512)])
def test_attention_prefill_window(vk, n_q, n_kv, head_dim, page_size, start_row, n, window):
    rng = np.random.default_rng(start_row * 31 + n + window + head_dim)
    first = max(0, start_row - window + 1)                  # lowest row any query of the chunk sees
    k_pages, v_pages, page_table = windowed_pool(rng, start_row + n, n_kv, page_size, head_dim, first)
    q = rng.standard_normal((n, n_q * head_dim)).astype(np.float32)
    scale = 1.0 / np.sqrt(head_dim)
    out = vk.alloc(q.shape)
    vk.attention_prefill(vk.upload(q), vk.upload(k_pages), vk.upload(v_pages), vk.upload(page_table),
                         start_row, n_q, scale, out, window=window)
    got = vk.download(out)
    assert np.all(np.isfinite(got)), "read below the window"
    want = np.empty(q.shape)
    REF.attention_prefill(q, k_pages, v_pages, page_table, start_row, n_q, scale, want, window=window)
    assert nmse(got, want) < 1e-8


@pytest.mark.parametrize("n_q,n_kv,head_dim,page_size", [(9, 3, 64, 16), (32, 8, 128, 16), (8, 4, 256, 256)])
@pytest.mark.parametrize("n_rows,window", [(1, 4), (7, 7), (17, 16), (300, 64), (1000, 513), (1000, 1)])
def test_attention_decode_window(vk, n_q, n_kv, head_dim, page_size, n_rows, window):
    rng = np.random.default_rng(n_rows + window + head_dim)
    first = max(0, n_rows - window)
    k_pages, v_pages, page_table = windowed_pool(rng, n_rows, n_kv, page_size, head_dim, first)
    q = rng.standard_normal((1, n_q * head_dim)).astype(np.float32)
    scale = 1.0 / np.sqrt(head_dim)
    out = vk.alloc(q.shape)
    vk.attention_decode(vk.upload(q), vk.upload(k_pages), vk.upload(v_pages), vk.upload(page_table),
                        n_rows, n_q, scale, out, window=window)
    got = vk.download(out)
    assert np.all(np.isfinite(got)), "read below the window"
    want = np.empty(q.shape)
    REF.attention_decode(q, k_pages, v_pages, page_table, n_rows, n_q, scale, want, window=window)
    assert nmse(got, want) < 1e-8


def test_attention_window_zero_is_full_causal(vk):
    """window=0 (the default) keeps the full causal attention."""
    rng = np.random.default_rng(12)
    k_pages, v_pages, page_table = windowed_pool(rng, 45, 3, 16, 64, 0)
    q = rng.standard_normal((5, 9 * 64)).astype(np.float32)
    dev = [vk.upload(a) for a in (q, k_pages, v_pages, page_table)]
    out0, out1 = vk.alloc(q.shape), vk.alloc(q.shape)
    vk.attention_prefill(*dev, 40, 9, 0.125, out0)
    vk.attention_prefill(*dev, 40, 9, 0.125, out1, window=0)
    want = np.empty_like(q)
    REF.attention_prefill(q, k_pages, v_pages, page_table, 40, 9, 0.125, want)
    np.testing.assert_array_equal(vk.download(out0), vk.download(out1))
    assert nmse(vk.download(out0), want) < 1e-8


def test_attention_decode_window_cost_is_window_not_context(vk):
    """The decode loop starts at the window, it does not mask the rows below it: at 16k rows
    a 64-row window costs a small fraction of full attention (about 1/100 on lavapipe)."""
    import time
    rng = np.random.default_rng(13)
    n_rows = 16384
    k_pages, v_pages, page_table = windowed_pool(rng, n_rows, 1, 256, 128, 0)
    q = rng.standard_normal((1, 4 * 128)).astype(np.float32)
    dev = [vk.upload(a) for a in (q, k_pages, v_pages, page_table)]
    out = vk.alloc(q.shape)

    def best_of_3(window):
        times = []
        for _ in range(4):                                     # the first run builds the pipeline
            t = time.perf_counter()
            vk.attention_decode(*dev, n_rows, 4, 0.088, out, window=window)
            vk.synchronize()
            times.append(time.perf_counter() - t)
        return min(times[1:])
    full, windowed = best_of_3(0), best_of_3(64)
    assert windowed < 0.25 * full, f"window 64: {windowed * 1e3:.2f} ms, full: {full * 1e3:.2f} ms"


# -- quantized KV rows: rounding edges and rows that do not fill whole words --------------
def q_edge_rows(head_dim: int) -> np.ndarray:
    """f32 [8, head_dim] rows whose 32-blocks hit q8_0 / q4_0 rounding edges: exact halves
    after scaling (C roundf goes away from zero), 0.49999997, a largest |x| that is
    negative or repeated, f16-subnormal and overflowing scales, zeros."""
    rng = np.random.default_rng(21)
    rows = rng.standard_normal((8, head_dim)).astype(np.float32)
    halves = np.array([0.5, 1.5, -2.5, 3.5, -0.5, 0.49999997, -126.5, 126.5], np.float32)
    rows[0, :8], rows[0, 8] = halves, 127.0                        # q8_0: d = 1, inv = 1
    rows[1, :8], rows[1, 8] = halves / 2, -8.0                     # q4_0: d = 1 (first max)
    rows[1, 9] = 8.0                                               # |x| ties: the first one wins
    rows[2] *= np.float32(2.0 ** -21)                              # f16-subnormal scales
    rows[3] *= np.float32(3e5)                                     # scales past f16 max: inf
    rows[4] = 0.0
    rows[5] *= np.float32(2.0 ** -30)                              # scales below f16's smallest
    rows[6] = np.float32(1.0) / np.arange(1, head_dim + 1, dtype=np.float32)
    rows[7] *= np.logspace(-4, 4, head_dim).astype(np.float32)
    return rows


def test_rows_past_the_page_table_are_refused(vk):
    """The shaders index the page table unchecked (no robust buffer access on a GPU):
    rows past its pages are an error before any dispatch."""
    n_kv, head_dim, page_size = 2, 64, 4
    pages = vk.upload(np.zeros((3, n_kv, page_size, head_dim), np.uint16))
    table = vk.upload(np.array([2, 0], np.int32))                 # 8 rows
    k = vk.upload(np.ones((2, n_kv * head_dim), np.float32))
    vk.kv_write(pages, pages, table, k, k, 6)                      # rows 6, 7: fit
    with pytest.raises(ValueError, match="vulkan kv_write: 9 rows need 3 pages"):
        vk.kv_write(pages, pages, table, k, k, 7)
    q, out = vk.upload(np.ones((1, 2 * n_kv * head_dim), np.float32)), vk.alloc((1, 2 * n_kv * head_dim))
    with pytest.raises(ValueError, match="vulkan attention"):
        vk.attention_decode(q, pages, pages, table, 9, 2 * n_kv, 0.125, out)
    vk.synchronize()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")          # the oracle's f16 overflow
@pytest.mark.parametrize("dtype", ["q8_0", "q4_0"])
def test_kv_write_q_blocks_bit_exact_at_rounding_edges(vk, dtype):
    from backends.kvformat import KvFormat
    head_dim, n_kv = 64, 2
    fmt = KvFormat.get(dtype, head_dim)
    rows = q_edge_rows(head_dim)                                   # 8 rows -> 4 tokens x 2 heads
    k = rows.reshape(4, n_kv * head_dim)
    pages = np.full(fmt.page_shape(2, n_kv, 3), 0xFF, np.uint8)
    table = np.array([1, 0], np.int32)
    dk, dv = vk.upload(pages), vk.upload(pages)
    vk.kv_write(dk, dv, vk.upload(table), vk.upload(k), vk.upload(k[:, ::-1].copy()), 0, dtype, dtype)
    got = vk.download(dk)
    want = pages.copy()
    REF.kv_write(want, pages.copy(), table, k, k[:, ::-1].copy(), 0, dtype, dtype)
    np.testing.assert_array_equal(got, want)
    # a row attended alone reads back exactly as KvFormat.dequantize (subnormal scales too;
    # rows with an inf scale left out)
    for t in range(4):
        row = want[table[t // 3], :, t % 3]                            # [n_kv, row_bytes]
        q = np.zeros((1, n_kv * head_dim), np.float32)
        out = vk.alloc((1, n_kv * head_dim))
        dpages = vk.upload(row.reshape(1, n_kv, 1, -1))
        vk.attention_decode(vk.upload(q), dpages, dpages, vk.upload(np.zeros(1, np.int32)), 1, n_kv, 1.0,
                            out, 0, dtype, dtype)
        got, exact = vk.download(out).reshape(n_kv, head_dim), fmt.dequantize(row)
        finite = np.isfinite(exact).all(axis=1)
        np.testing.assert_array_equal(got[finite], exact[finite])


def test_kv_ops_on_rows_of_odd_byte_widths(vk):
    """tq3 / tq4 at head_dim 24: rows of 11 and 14 bytes (scales straddle words, rows share
    words), pages of 33 / 42 bytes (pages share words): write, attend, vote, gather, copy."""
    import math

    from test_ops import assert_rows_written, filled_pool, make_pool, random_keep
    kv, n_q, n_kv, hd, ps, n_rows = ("tq3", "tq4"), 2, 1, 24, 3, 20
    rng = np.random.default_rng(8)
    k_pages, v_pages, table = make_pool(rng, n_rows, n_kv, ps, hd, kv=kv)
    k = rng.standard_normal((n_rows, hd)).astype(np.float32)
    v = rng.standard_normal((n_rows, hd)).astype(np.float32)
    dk, dv, dt = vk.upload(k_pages), vk.upload(v_pages), vk.upload(table)
    vk.kv_write(dk, dv, dt, vk.upload(k[:7]), vk.upload(v[:7]), 0, *kv)     # two chunks
    vk.kv_write(dk, dv, dt, vk.upload(k[7:]), vk.upload(v[7:]), 7, *kv)
    want_k, want_v = k_pages.copy(), v_pages.copy()
    REF.kv_write(want_k, want_v, table, k, v, 0, *kv)
    assert_rows_written(vk.download(dk), want_k, kv[0], hd)
    assert_rows_written(vk.download(dv), want_v, kv[1], hd)

    k_pages, v_pages, table = filled_pool(rng, n_rows, n_kv, ps, hd, kscale=2.0, kv=kv)
    dk, dv, dt = vk.upload(k_pages), vk.upload(v_pages), vk.upload(table)
    q = rng.standard_normal((5, n_q * hd)).astype(np.float32)
    out, want = vk.alloc(q.shape), np.empty(q.shape)
    vk.attention_prefill(vk.upload(q), dk, dv, dt, n_rows - 5, n_q, 1 / math.sqrt(hd), out, 0, *kv)
    REF.attention_prefill(q, k_pages, v_pages, table, n_rows - 5, n_q, 1 / math.sqrt(hd), want, 0, *kv)
    assert nmse(vk.download(out), want) < 1e-8
    qw = rng.standard_normal((n_q, 4, hd)).astype(np.float32)
    votes = vk.snapkv_votes(vk.upload(qw), dk, dt, n_rows, 0.3, kv[0])
    assert nmse(votes, REF.snapkv_votes(qw, k_pages, table, n_rows, 0.3, kv[0])) < 1e-8

    dst_k, dst_v = make_pool(rng, n_rows, n_kv, ps, hd, kv=kv)[:2]
    pages = np.sort(table[[0, 1, 2, 5]]).astype(np.int32)                   # neighbouring pages
    ck, cv = vk.upload(dst_k), vk.upload(dst_v)
    vk.kv_copy_pages(dk, dv, ck, cv, pages)
    REF.kv_copy_pages(k_pages, v_pages, dst_k, dst_v, pages)
    np.testing.assert_array_equal(vk.download(ck), dst_k)
    np.testing.assert_array_equal(vk.download(cv), dst_v)
    src, dst = pages[:2], pages[:1:-1].copy()                               # within one pool, to other pages
    vk.kv_copy_pages(ck, cv, ck, cv, src, dst)
    REF.kv_copy_pages(dst_k, dst_v, dst_k, dst_v, src, dst)
    np.testing.assert_array_equal(vk.download(ck), dst_k)
    np.testing.assert_array_equal(vk.download(cv), dst_v)

    keep = random_keep(rng, n_kv, n_rows, 9, window=3)
    vk.kv_gather(dk, dv, dt, keep)
    REF.kv_gather(k_pages, v_pages, table, keep)
    np.testing.assert_array_equal(vk.download(dk), k_pages)
    np.testing.assert_array_equal(vk.download(dv), v_pages)


@pytest.mark.parametrize("kv", [("bf16", "bf16"), ("q8_0", "q4_0"), ("tq4", "tq3"), ("rq4_0", "rq4_0")], ids="/".join)
@pytest.mark.parametrize("n_rows,window", [(1, 0), (7, 0), (300, 0), (2500, 0), (700, 256)])
def test_split_decode_attention_matches_the_reference(vk, kv, n_rows, window):
    """Flash-decoding, the GPU path (spans of the context, then a merge pass), forced on
    lavapipe: spans shorter than a tile, empty spans (fewer rows than spans), a sliding
    window and quantized rows give the reference's output."""
    check_attention(vk, kv, 9, 3, n_rows, window, splits=(16, 3))


@pytest.mark.parametrize("n_q,n_kv", [(9, 3), (4, 4), (16, 2), (16, 1)], ids=lambda v: str(v))
def test_grouped_query_workgroups_match_the_reference(vk, n_q, n_kv):
    """One workgroup serves all query heads of a KV head (up to MAX_GROUP of them), in
    prefill, decode and split decode; one head per KV head and groups too big for one
    workgroup (16) take a workgroup per query head."""
    for n_rows, window in ((37, 0), (300, 64)):
        check_attention(vk, ("bf16", "tq4"), n_q, n_kv, n_rows, window, splits=(1, 16), prefill=7)


@pytest.mark.parametrize("kv", [("bf16", "bf16"), ("q8_0", "tq4")], ids="/".join)
@pytest.mark.parametrize("n_rows,window,n_bias", [(300, 0, 100), (2500, 0, 300), (700, 256, 500)])
def test_row_bias_in_every_attention_variant(vk, kv, n_rows, window, n_bias):
    """Merged rows' log-counts reach the scores in prefill, decode and split decode, read
    through a strided view of the bias (offset and row stride), with a sliding window too."""
    check_attention(vk, kv, 9, 3, n_rows, window, splits=(1, 16), prefill=7, n_bias=n_bias)


def test_row_bias_shape_is_checked(vk):
    from test_ops import filled_pool
    rng = np.random.default_rng(5)
    k_pages, v_pages, page_table = (vk.upload(a) for a in filled_pool(rng, 8, 3, 16, 64))
    q, out = vk.upload(np.zeros((1, 9 * 64), np.float32)), vk.alloc((1, 9 * 64))
    for bad in (np.zeros((2, 8), np.float32), np.zeros(8, np.float32)):
        with pytest.raises(ValueError, match=r"row_bias must be f32 \[n_kv_heads=3, n_bias\]"):
            vk.attention_decode(q, k_pages, v_pages, page_table, 8, 9, 0.125, out, row_bias=vk.upload(bad))


def check_attention(vk, kv, n_q, n_kv, n_rows, window, splits, prefill=0, n_bias=0):
    """Decode over n_rows (the lanes layout, then the tiles at each split count), and a
    prefill of the last `prefill` queries, against the reference; with n_bias, a row bias
    on the first n_bias rows."""
    from test_ops import TOL_ATTN, filled_pool
    rng = np.random.default_rng(n_rows + window + n_q)
    k_pages, v_pages, page_table = filled_pool(rng, n_rows, n_kv, 16, 64, kscale=2.0, kv=kv)
    q = rng.standard_normal((max(prefill, 1), n_q * 64)).astype(np.float32)
    dev = [vk.upload(a) for a in (q, k_pages, v_pages, page_table)]
    bias = dev_bias = None
    if n_bias:
        padded = rng.uniform(-2.0, 9.0, (n_kv, n_bias + 5)).astype(np.float32)
        bias, dev_bias = padded[:, 3:3 + n_bias], vk.upload(padded)[:, 3:3 + n_bias]
    want = np.empty_like(q[-1:])
    REF.attention_decode(q[-1:], k_pages, v_pages, page_table, n_rows, n_q, 0.125, want, window, *kv,
                         row_bias=bias)
    lanes = vk.decode_lanes
    try:                        # attention_lanes.comp (CPU devices), then attention.comp's tiles
        for vk.decode_lanes, vk.decode_splits in [(True, 1)] + [(False, n) for n in splits]:
            out = vk.upload(np.zeros_like(want))
            vk.attention_decode(dev[0][-1:], *dev[1:], n_rows, n_q, 0.125, out, window, *kv, row_bias=dev_bias)
            assert nmse(vk.download(out), want) < TOL_ATTN, (vk.decode_lanes, vk.decode_splits)
    finally:
        vk.decode_lanes, vk.decode_splits = lanes, 1
    if prefill:
        start = n_rows - prefill
        want = np.empty_like(q)
        REF.attention_prefill(q, k_pages, v_pages, page_table, start, n_q, 0.125, want, window, *kv,
                              row_bias=bias)
        out = vk.upload(np.zeros_like(q))
        vk.attention_prefill(*dev, start, n_q, 0.125, out, window, *kv, row_bias=dev_bias)
        assert nmse(vk.download(out), want) < TOL_ATTN


def test_kv_copy_pages_over_the_grid_limit_takes_several_dispatches(vk, monkeypatch):
    """Pages sit on grid y, at most 65,535 a dispatch on every device: a longer list (a
    cache of more pages branched at once) is copied in several dispatches, here with the
    limit lowered to 7 pages over a list of 23, to another pool."""
    from backends.vulkan import shaders
    monkeypatch.setattr(shaders, "MAX_WORKGROUPS", 7)
    rng = np.random.default_rng(23)
    src_k, src_v = (rng.integers(0, 2**16, (60, 2, 4, 64), dtype=np.uint16) for _ in range(2))
    dst_k, dst_v = (np.zeros_like(a) for a in (src_k, src_v))
    pages = rng.permutation(60)[:46].astype(np.int32)
    src, dst = pages[:23], pages[23:]
    dk, dv = vk.upload(dst_k), vk.upload(dst_v)
    before = vk.launches
    vk.kv_copy_pages(vk.upload(src_k), vk.upload(src_v), dk, dv, src, dst)
    assert vk.launches - before == 4
    dst_k[dst], dst_v[dst] = src_k[src], src_v[src]
    np.testing.assert_array_equal(vk.download(dk), dst_k)
    np.testing.assert_array_equal(vk.download(dv), dst_v)


def test_an_interrupted_recording_is_dropped_not_run_by_a_later_flush(vk):
    """A decode step whose recording raises (an error, Ctrl-C in the middle) leaves
    nothing pending: its dispatches never run on the next flush."""
    x = vk.upload(np.ones((2, 4), dtype=np.float32))
    vk.synchronize()

    def run():
        vk.scale(x, 2.0, x)
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        vk.record_step(np.zeros(2, dtype=np.int32), run, 0)
    np.testing.assert_array_equal(vk.download(x), np.ones((2, 4), dtype=np.float32))
    vk.scale(x, 3.0, x)                                    # the backend records and runs on as before
    np.testing.assert_array_equal(vk.download(x), np.full((2, 4), 3.0, dtype=np.float32))
