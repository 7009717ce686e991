"""VulkanBackend: device-resident arrays and GLSL compute shaders driven through kp.

Execution model: every op records its dispatch(es) into one pending kp.Sequence;
the sequence is submitted when the host needs a result (`download`, `synchronize`,
`snapkv_votes`, `update`) and, without waiting, at the end of each prefill chunk
(`submit`, so no submission runs for a whole prompt). A decode token (all layers, the
head, and on device-local buffers the logits' copy back) is one submission, and
nothing crosses host<->device per token except the token id (a push constant), the
logits, and a page table's few ints when a layer adds a page. Algorithms (kp.Algorithm:
a pipeline with its bound buffers) are cached by (shader variant, bound buffers, grid);
the forward pass reuses its scratch buffers and the KV cache updates its page tables in
place (`update`), so after the first token every dispatch hits the cache. kp, patched
(tools/kp-0.9.0.patch), compiles one pipeline per shader variant and shares it among
the algorithms that bind different buffers, so a new cache or a new prompt compiles
nothing. Counters: `submissions`, `launches` (dispatches recorded by the ops; a
replayed step records none), `algorithms_created`, `pipelines_compiled`,
`bytes_to_device`, `bytes_to_host` (tests/backends/test_vulkan_model.py).

On GPUs consecutive dispatches are separated by a global compute/transfer
memory barrier, `OpGlobalBarrier` from our small extension `_kp_barrier`
(native/kp_barrier.cpp, built by `make setup`): kp 0.9's Python API has no
barrier of its own, and its dispatches only order transfer->shader, so without
one a shader may read what the previous dispatch is still writing (Vulkan sync
validation reports it; tests/backends/test_vulkan_sync.py). Without the
extension every dispatch is submitted alone, which is correct and slow. The CPU
device (lavapipe) runs dispatches in order and needs neither.

KV pages come in every row format of backends/kvformat.py (keys and values may
differ): a pool is one buffer holding the pages' bytes unchanged, and each KV shader
is compiled per format (shaders.kv_defines). tq and rq4_0 rows live in a rotated basis:
a small kv_rotate dispatch rotates rows before kv_write, queries before attention and
votes over such keys, and attention outputs over such values back, with R =
KvFormat.rotation uploaded once per rotation and head_dim (rq4_0 rows are then q4_0
rows to the shaders); their rotated copies go to two scratch buffers the
backend keeps (so the pipelines that bind them stay cached).
"""
from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from contextlib import contextmanager

import numpy as np

from engine.errors import BackendUnavailable, DeviceFault, DeviceOutOfMemory, EngineError

from . import shaders
from ..base import GATE_DEFINES, check_kv_dtypes, check_table, rope_inv_freq, step_slot
from ..kvformat import KV_DTYPES, KvFormat, is_rotated, rotation_kind
from .arrays import PER_WORD, Buffer, DeviceArray, to_words
from .device import (check_buffer, check_device, check_grid, list_devices, manager, max_buffer_bytes,
                     pick_device)
from .weights import VulkanWeight, load_weight

try:
    import kp
except Exception as _e:   # pragma: no cover - depends on the machine
    kp = None
    _KP_ERROR = f"{type(_e).__name__}: {_e}"

try:
    from ._kp_barrier import OpGlobalBarrier
    KP_BARRIER_ERROR = None
except ImportError as _e:  # not built (tools/build_kp_barrier.py): submit each dispatch alone on GPUs
    OpGlobalBarrier = None
    KP_BARRIER_ERROR = str(_e)

F32 = np.dtype(np.float32)
_MAX_ALGOS = 4096
STAGED_MAX_BYTES = 1 << 16        # GPU buffers up to this size keep kp's host staging copy
READBACK_KEEP_BYTES = 16 << 20    # device-only buffers up to this size keep their host readback copy
_NO_SPEC = np.zeros(0, dtype=np.uint32)
GATHER_GROUPS = 65535             # kv_gather workgroups along x (the least maxComputeWorkGroupCount[0])


def _u32(*values) -> np.ndarray:
    return np.array(values, dtype=np.uint32)


def _fbits(x: float) -> int:
    return int(np.float32(x).view(np.uint32))


def sync_mode(device_type: str, device_local: bool, have_barrier: bool) -> str | None:
    """How dependent dispatches are ordered: "barrier" (one sequence, a global barrier
    between dispatches), "submit" (one submission each), or None. Only a CPU device
    (lavapipe) runs dispatches in order, and needs none unless asked for device-local
    buffers, which imitate a GPU (tests/backends/test_vulkan_sync.py). The memory type
    never decides it: a GPU's host-visible buffers need the barriers too."""
    if device_type == "cpu" and not device_local:
        return None
    return "barrier" if have_barrier else "submit"


class VulkanBackend:
    """backend name "vulkan". `device`: Vulkan device index (default: discrete GPU,
    then integrated, ..., CPU/lavapipe last); `allow_cpu=False` refuses a CPU-only
    Vulkan implementation (for `--backend auto`). `device_local`: device-local buffers
    with staging copies (default: on GPUs, not on a CPU device, where buffers are
    host-visible); barriers between dispatches: see sync_mode."""

    name = "vulkan"
    kv_dtypes = KV_DTYPES
    max_head_dim = 256        # the attention kernels' per-thread slices (base.check_head_dim)
    rope_write_keys = shaders.ROPE_WRITE_KEYS   # rope_kv_write's key formats (kv_write.comp ROPE)

    def __init__(self, device: int | None = None, allow_cpu: bool = True, device_local: bool | None = None):
        if kp is None:
            raise BackendUnavailable(f"backend 'vulkan' needs the Python package 'kp' (Kompute), "
                                     f"which does not import: {_KP_ERROR}")
        devices = list_devices()
        if device is None:
            info = pick_device(devices, allow_cpu)
        else:
            match = [d for d in devices if d["index"] == device]
            if not match:
                raise BackendUnavailable(f"backend 'vulkan': no Vulkan device {device} "
                                         f"({len(devices)} found)")
            info = match[0]
        check_device(info)
        if not shaders.compiler_available() and not shaders.all_cached():
            shaders.spirv(*shaders.variants()[0])          # raises, naming glslangValidator
        self.device = info
        self.mgr = manager(info["index"])
        self._cpu_device = info["type"] == "cpu"
        if device_local is None:
            device_local = not self._cpu_device
        # host-visible buffers on a CPU device (no staging copy); device-local elsewhere
        self._ttype = kp.TensorTypes.device if device_local else kp.TensorTypes.host
        # between dependent dispatches: "barrier" (one sequence), "submit" (one sequence each), or none
        self._sync = sync_mode(info["type"], device_local, OpGlobalBarrier is not None)
        self._barrier = OpGlobalBarrier() if self._sync == "barrier" else None
        self._host_barrier = OpGlobalBarrier(host=True) if self._sync == "barrier" else None   # after read-backs
        self.submissions = 0                               # queue submissions (sequence evals)
        self.launches = 0                                  # dispatches recorded by the ops
        self.algorithms_created = 0                        # kp.Algorithm objects made (cache misses)
        self._algos: OrderedDict = OrderedDict()           # key -> kp.Algorithm
        self._by_serial: dict[int, set] = {}               # buffer serial -> cache keys using it
        self._seq = None
        self._keepalive: list = []                         # transient buffers of the pending batch
        self._pending_serials: set = set()                 # buffers the pending batch binds
        self._in_flight: list = []                         # (sequence, transient buffers, serials) not awaited
        self._step = None                                  # the step buffer of the recording under way
        self._max_position = 0                             # ... and the positions it may hold
        self._read_back = None                             # (serial, host tensor) the last replay copied back
        self._dummy = self._buffer(np.zeros(1, np.uint32))
        self._rope_tables: dict = {}                       # (rot_dim, inv_freq) -> (DeviceArray, max positions)
        self._rot_tables: dict = {}                        # head_dim -> f32 [2, hd, hd] (R^T, R) DeviceArray
        self._kept: dict = {}                              # role -> scratch Buffer (_kept_scratch)
        self.matmul_cpu_layout = self._cpu_device          # matmul.comp's ROW_PER_LANE layout
        # 64-bit shader integers (kp patched by tools/kp-0.9.0.patch enables them where the
        # device has them): q4_0/q4_1/q8_0 weights padded for 64-bit loads on CPU devices
        self.shader_int64 = bool(getattr(self.mgr, "shader_int64", lambda: False)())
        # threads a CPU device runs workgroups on (lavapipe: LP_NUM_THREADS, else one per CPU)
        self.cpu_threads = int(os.environ.get("LP_NUM_THREADS") or os.cpu_count() or 1)
        # decode attention: on CPU devices attention_lanes.comp (a lane per row, no barriers;
        # spans of the context for the device's threads), else attention.comp's tiles in this
        # many spans of the context (GPUs: enough workgroups to fill the device at a few
        # heads); either way merged by attention_combine.comp
        self.decode_lanes = self._cpu_device
        self.decode_splits = 1 if self._cpu_device else shaders.DECODE_SPLITS
        self.max_buffer_bytes = max_buffer_bytes(info)     # larger weights are split by rows
        self.max_kv_buffer_bytes = self.max_buffer_bytes   # larger KV pools are split by layers
        self._readback: dict[int, Buffer] = {}             # device-only buffer serial -> host copy
        self.bytes_to_device = 0                           # host<->device traffic counters
        self.bytes_to_host = 0
        self._step_arrays: dict[int, DeviceArray] = {}     # step buffers by length, reused (their
                                                           # pipelines stay cached)

    def check_fits(self, weight_bytes: int, kv_bytes: int, ctx: int, work_bytes: int = 0, chunk: int = 0,
                   largest_buffer: int = 0) -> bool:
        """Before anything is allocated: a prefill chunk of `chunk` tokens within the
        dispatch limits (its tokens go along grid y) and its largest buffer within one
        binding; on a GPU, the weights, one KV cache for `ctx` tokens and the chunk's
        buffers (`work_bytes`) within its largest device-local heap (EngineError with the
        numbers). Returns whether device memory was checked (a CPU device's is the
        host's: the caller checks that)."""
        name, mib = self.device["name"], 2 ** 20
        most = ((self.device.get("limits") or {}).get("max_workgroup_count") or (65535,) * 3)[1]
        if chunk > most:
            raise EngineError(f"a prefill chunk of {chunk} tokens is more than {name} dispatches at once "
                              f"({most} workgroups along y): lower --prefill-chunk")
        if largest_buffer > self.max_buffer_bytes:
            raise EngineError(f"a prefill chunk of {chunk} tokens needs a {largest_buffer / mib:.0f} MiB buffer, "
                              f"more than one shader binding of {name} covers ({self.max_buffer_bytes / mib:.0f} "
                              f"MiB): lower --prefill-chunk")
        heap = self.device.get("device_local_bytes")
        if self._cpu_device or not heap:
            return False
        need = weight_bytes + kv_bytes + work_bytes
        if need > heap:
            raise EngineError(f"model does not fit on {name}: weights {weight_bytes / mib:.0f} MiB + KV cache "
                              f"for {ctx} tokens {kv_bytes / mib:.0f} MiB + buffers for a {chunk}-token prefill "
                              f"chunk {work_bytes / mib:.0f} MiB = {need / mib:.0f} MiB, but its memory is "
                              f"{heap / mib:.0f} MiB (lower --ctx or --prefill-chunk, or use --kv-budget)")
        return True

    # -- recorded steps (backends/base.py, engine/replay.py) ---------------------------
    def record_step(self, values: np.ndarray, run, max_position: int, readback=None):
        """run() as one step whose StepValue arguments the shaders read from a step buffer
        (int32, `values`; one per length, reused), recorded as a sequence of its own and
        kept for `replay`:
        a barrier first where dispatches need them, then (device-local buffers) the step
        buffer's staging copy, so a replay only rewrites the host side (the recorded ops
        hold their algorithms and buffers), and last the copy back of `readback` (the array
        downloaded after each step; on device-local buffers), so a replayed token stays one
        submission with its download. None when the step could not be recorded whole
        (something in it submitted work: a buffer grown on the way, or one submission per
        dispatch without the barrier extension); the next step then records again."""
        values = np.ascontiguousarray(values, dtype=np.int32)
        step = self._step_arrays.get(values.size)
        if step is None:                                   # staged: replay writes its host side
            step = self._step_arrays[values.size] = self.upload(values, staged=True)
        else:
            self.update(step, values)
        self.flush()                                       # the recording starts a batch of its own
        submissions = self.submissions
        self._seq = self.mgr.sequence()
        if self._barrier is not None:                      # after whatever ran before it
            self._seq.record(self._barrier)
        if self._ttype == kp.TensorTypes.device:           # the values written before each replay
            self._seq.record(kp.OpTensorSyncDevice([step.buffer.tensor]))
        self._step, self._max_position = step, max_position
        try:
            run()
            back = None if readback is None else (readback.buffer.serial, self._record_readback(readback.buffer))
        except BaseException:                              # (an error, Ctrl-C) the partial step is dropped,
            self._seq = None                               # never submitted by a later flush
            self._pending_serials.clear()
            self._keepalive.clear()
            raise
        finally:
            self._step, self._max_position = None, 0
        whole = self.submissions == submissions and self._seq is not None
        seq, keep, serials = self._seq, list(self._keepalive), self._pending_serials | {step.buffer.serial}
        self.flush()                                       # the step runs now
        return (seq, step, keep, serials, back) if whole else None

    def replay(self, recording, values: np.ndarray) -> None:
        """The recorded sequence submitted again with `values` in its step buffer, not
        awaited (the next download waits for it)."""
        seq, step, keep, serials, back = recording
        self.flush()
        self._await_in_flight()                            # a replay still running reads the step buffer
        words, _ = to_words(np.ascontiguousarray(values, dtype=np.int32))
        step.buffer.tensor.data()[:words.size] = words     # host-visible memory, or the staging copy
        self.bytes_to_device += words.nbytes
        with self._device_errors():
            seq.eval_async()
        self.submissions += 1
        self._in_flight.append((seq, keep, serials))
        self._read_back = back                             # (serial, host tensor) the sequence copied back

    def _slot(self, value) -> int:
        """A StepValue(s) argument's (first) slot + 1 while a step is recorded (what the
        shaders take: STEP[x - 1 + t]), else 0."""
        slot = step_slot(value)
        return 0 if self._step is None or slot is None else slot + 1

    @property
    def _step_buffer(self) -> Buffer:
        return self._dummy if self._step is None else self._step.buffer

    @property
    def pipelines_compiled(self) -> int | None:
        """Compute pipelines compiled in this process (all backends), or None with a kp
        built without tools/kp-0.9.0.patch's pipeline sharing."""
        count = getattr(kp, "compiled_pipelines", None)
        return None if count is None else count()

    # -- buffers ----------------------------------------------------------------------
    def _buffer(self, words: np.ndarray, zeros: bool = False, staged: bool = False) -> Buffer:
        """A buffer holding `words` (with `zeros`, zeros: `words` then only gives the size and
        is never read). On a CPU device the buffer is host-visible memory itself. On a GPU
        a buffer of at most STAGED_MAX_BYTES keeps kp's host staging copy (page tables,
        token ids: rewritten and read back in place); a larger one lives in device memory
        only (weights, KV pools, activations: no second copy of the model and the cache in
        host memory), filled by a copy from a transient host buffer, or zeroed on the device.
        `staged`: keep the staging copy whatever the size (a recorded step's buffer, which
        a replay rewrites through it)."""
        check_buffer(self.device, words.nbytes)
        words = np.ascontiguousarray(words, dtype=np.uint32)
        device_only = self._ttype == kp.TensorTypes.device and words.nbytes > STAGED_MAX_BYTES and not staged
        buf = Buffer(self._tensor(words, kp.TensorTypes.storage if device_only else self._ttype),
                     words.size, device_only)
        weakref.finalize(buf, self._forget, buf.serial)
        if device_only:
            self._copy_words(None if zeros else self._host_buffer(words), buf)
            if not zeros:
                self.flush()                               # the transient host copy goes now
        elif self._ttype == kp.TensorTypes.device and self._sync == "barrier" and self._step is None:
            read_back = self._read_back                    # (a new buffer leaves a replay's copy back valid)
            self._record(kp.OpTensorSyncDevice([buf.tensor]))   # the staging copy joins the pending batch:
            self._read_back = read_back                    # no wait for the device's work in flight
            self._pending_serials.add(buf.serial)
        elif self._ttype == kp.TensorTypes.device:         # alone (in a recording: that step is not kept,
            self.mgr.sequence().eval(kp.OpTensorSyncDevice([buf.tensor]))   # record_step)
            self.submissions += 1
        return buf

    def _tensor(self, words: np.ndarray, ttype):
        try:                   # kp (tools/kp-0.9.0.patch) raises when vkAllocateMemory etc. fail
            return self.mgr.tensor_t(words, ttype)
        except RuntimeError as e:
            raise BackendUnavailable(f"backend 'vulkan': cannot allocate {words.nbytes / 2**20:.1f} MiB "
                                     f"on {self.device['name']}: {e}") from None

    def _host_buffer(self, words: np.ndarray) -> Buffer:
        """A host-visible buffer of `words` (the source or destination of a device-only
        buffer's copy), alive until the pending batch completes."""
        buf = Buffer(self._tensor(words, kp.TensorTypes.host), words.size)
        weakref.finalize(buf, self._forget, buf.serial)
        self._keepalive.append(buf)
        return buf

    def _copy_words(self, src: Buffer | None, dst: Buffer) -> None:
        """Record dst[:n] = src[:n] word for word (src None: zeros; n the smaller buffer's
        words) into the pending batch."""
        n = dst.n_words if src is None else min(src.n_words, dst.n_words)
        self._dispatch("copy_words", () if src is not None else ("FILL",), [src or self._dummy, dst],
                       (min(-(-n // 256), shaders.MAX_WORKGROUPS), 1, 1), _u32(n))

    def _forget(self, serial: int) -> None:
        """Drop every cached pipeline that binds a buffer that no longer exists."""
        for key in self._by_serial.pop(serial, ()):
            self._algos.pop(key, None)

    def _transient(self, host: np.ndarray) -> DeviceArray:
        """Upload per-call host data (ids, keep sets, page lists) for the pending batch."""
        arr = self.upload(host)
        self._keepalive.append(arr.buffer)
        return arr

    def _scratch(self, n_words: int) -> Buffer:
        buf = self._buffer(np.zeros(max(1, n_words), np.uint32), zeros=True)
        self._keepalive.append(buf)
        return buf

    # -- memory -----------------------------------------------------------------------
    def alloc(self, shape, dtype=np.float32) -> DeviceArray:
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        dt = to_words(np.zeros(1, dtype=dtype))[1]
        n_words = max(1, -(-int(np.prod(shape)) // PER_WORD[dt]))
        return DeviceArray(self._buffer(np.zeros(n_words, np.uint32), zeros=True), dt, shape)

    def upload(self, host, staged: bool = False) -> DeviceArray:
        """host data in a new buffer (`staged`: _buffer's, kept host-writable at any size)."""
        host = np.asarray(host)
        words, dt = to_words(host)
        self.bytes_to_device += words.nbytes
        return DeviceArray(self._buffer(words, staged=staged), dt, host.shape)

    def update(self, arr, host) -> None:
        """Overwrite a whole uploaded array with host data of its shape and dtype, in
        place: its buffer, and every cached pipeline that binds it, stay (the KV cache's
        page tables). Waits for the work already issued, which may read the old
        contents; on device-local buffers the copy joins the pending batch."""
        host = np.asarray(host)
        words, dt = to_words(host)
        if dt != arr.dtype or host.shape != arr.shape or arr.offset != 0 or words.size > arr.buffer.n_words:
            raise ValueError(f"vulkan update: {host.dtype} {host.shape} into {arr!r}")
        serial = arr.buffer.serial
        if serial in self._pending_serials:                # recorded work still to read the old contents
            self.flush()
        elif any(serial in serials for _, _, serials in self._in_flight):
            self._await_in_flight()
        buf = arr.buffer
        self.bytes_to_device += words.nbytes
        if buf.device_only:
            self._copy_words(self._host_buffer(words), buf)
            self._pending_serials.add(serial)
            return
        buf.tensor.data()[:words.size] = words             # host-visible memory (or the staging copy)
        if self._ttype == kp.TensorTypes.device:
            self._record(kp.OpTensorSyncDevice([buf.tensor]))
            self._pending_serials.add(serial)

    def _record_readback(self, buf: Buffer):
        """Record the copy of buf back to the host (into the pending batch) where buffers are
        device-local; the host tensor to read after it runs."""
        if buf.device_only:                            # the copy back rides with the compute
            host = self._readback.get(buf.serial)
            if host is None:
                host = self._host_buffer(np.zeros(buf.n_words, np.uint32))
                if 4 * buf.n_words <= READBACK_KEEP_BYTES:   # the logits: read every token
                    self._readback[buf.serial] = host
                    weakref.finalize(buf, self._readback.pop, buf.serial, None)
            self._copy_words(buf, host)
            self._record_host_barrier()
            return host.tensor
        if self._ttype == kp.TensorTypes.device:
            self._record(kp.OpTensorSyncLocal([buf.tensor]))
            self._record_host_barrier()
        elif self._host_barrier is not None:           # a GPU's host-visible buffer the shaders wrote:
            self._record(self._host_barrier)          # a fence wait alone does not make it host-visible
        return buf.tensor

    def _record_host_barrier(self) -> None:
        """After a copy back into host memory: make it visible to host reads (a fence wait
        alone does not, by the specification)."""
        if self._host_barrier is not None and self._seq is not None:
            self._seq.record(self._host_barrier)

    def download(self, arr) -> np.ndarray:
        if isinstance(arr, np.ndarray):
            return np.array(arr, copy=True)
        buf = arr.buffer
        if self._read_back is not None and self._read_back[0] == buf.serial:   # a replay copied it back
            t = self._read_back[1]
        else:
            t = self._record_readback(buf)
        self.flush()
        out = arr.host_view(t.data())
        self.bytes_to_host += out.nbytes
        return out

    def load_weight(self, raw, qtype, shape) -> VulkanWeight:
        return load_weight(self, raw, qtype, shape)

    def alloc_kv_pool(self, n_pages, n_kv_heads, page_size, head_dim, k_dtype="bf16", v_dtype="bf16"):
        check_kv_dtypes(self, k_dtype, v_dtype)
        if head_dim % 2 or head_dim > self.max_head_dim:     # Model checks it at load (check_head_dim)
            raise BackendUnavailable(f"backend '{self.name}' needs an even head_dim <= {self.max_head_dim}, got {head_dim}")
        formats = (KvFormat.get(k_dtype, head_dim), KvFormat.get(v_dtype, head_dim))
        for f in formats:
            nbytes = n_pages * n_kv_heads * page_size * f.row_bytes
            if self.max_buffer_bytes and nbytes > self.max_buffer_bytes:    # one layer's pages alone
                raise BackendUnavailable(
                    f"backend 'vulkan': one layer's KV pages need a {nbytes / 2**20:.0f} MiB buffer, more than "
                    f"one shader binding of {self.device['name']} covers ({self.max_buffer_bytes / 2**20:.0f} MiB: "
                    f"maxStorageBufferRange or the allocation limit); lower --ctx or use a smaller --kv-dtype")
        return tuple(self.alloc(f.page_shape(n_pages, n_kv_heads, page_size), f.storage) for f in formats)

    def synchronize(self) -> None:
        self.flush()

    # -- dispatch ---------------------------------------------------------------------
    def _dispatch(self, shader: str, defines: tuple, buffers: list, grid: tuple, push: np.ndarray,
                  spec: tuple = ()) -> None:
        """Record one dispatch of shaders/<shader>.comp into the pending sequence; `spec`:
        its specialization constants (uint32, constant_id 0, 1, ...)."""
        grid = tuple(int(g) for g in grid)
        if min(grid) == 0:
            return
        key = (shader, defines, tuple(b.serial for b in buffers), grid, push.size, spec)
        algo = self._algos.get(key)
        if algo is None:
            check_grid(self.device, shader, grid)
            algo = self.mgr.algorithm([b.tensor for b in buffers], shaders.spirv(shader, defines),
                                      list(grid), _u32(*spec) if spec else _NO_SPEC, push)
            self.algorithms_created += 1
            self._algos[key] = algo
            for b in buffers:
                self._by_serial.setdefault(b.serial, set()).add(key)
            if len(self._algos) > _MAX_ALGOS:
                old, _ = self._algos.popitem(last=False)
                for s in old[2]:
                    self._by_serial.get(s, set()).discard(old)
        else:
            self._algos.move_to_end(key)
        self._record(kp.OpAlgoDispatch(algo, push))
        self.launches += 1
        self._pending_serials.update(key[2])
        if self._sync == "submit":
            self.flush()

    def _record(self, op) -> None:
        """Append an operation to the pending batch, after a barrier in "barrier" mode
        (also at the start of a batch: a pipeline barrier's first scope covers everything
        submitted before it on the queue, in flight or awaited, and a fence wait alone
        orders nothing between submissions by the specification). Work after a replay
        makes its copy back stale."""
        self._read_back = None
        if self._seq is None:
            self._seq = self.mgr.sequence()
        if self._sync == "barrier":
            self._seq.record(self._barrier)
        self._seq.record(op)

    def submit(self) -> None:
        """Start the pending batch without waiting for it (prefill submits each chunk, so
        no single submission runs long enough for an OS GPU watchdog); flush waits."""
        if self._seq is not None:
            seq, self._seq = self._seq, None
            with self._device_errors():
                seq.eval_async()
            self.submissions += 1
            self._in_flight.append((seq, self._keepalive, self._pending_serials))
            self._keepalive, self._pending_serials = [], set()

    def flush(self) -> None:
        """Submit the pending batch and wait for it and for everything still in flight."""
        try:
            if self._seq is not None:
                seq, self._seq = self._seq, None
                with self._device_errors():
                    seq.eval()
                self.submissions += 1
            self._await_in_flight()
        finally:
            self._pending_serials.clear()
            self._keepalive.clear()

    def _await_in_flight(self) -> None:
        in_flight, self._in_flight = self._in_flight, []
        with self._device_errors():
            for seq, _, _ in in_flight:                    # completed in submission order
                seq.eval_await()

    @contextmanager
    def _device_errors(self):
        """A failed submission or wait (kp, patched by tools/kp-0.9.0.patch, raises on a
        failed Vulkan call: device lost, out of memory) as one line naming the device."""
        try:
            yield
        except RuntimeError as e:
            if not str(e).startswith("Kompute: "):
                raise
            where = f"backend 'vulkan': {self.device['name']}: {e}"
            if "ErrorDeviceLost" in str(e):        # the device reset (a fault, a watchdog): sticky
                raise DeviceFault(f"{where}: the device was lost; restart the process (a long prefill "
                                  f"chunk may meet a display driver's watchdog: lower --prefill-chunk)") from None
            if "ErrorOutOf" in str(e):             # ErrorOutOfDeviceMemory / ErrorOutOfHostMemory
                raise DeviceOutOfMemory(f"{where} (lower --ctx or --prefill-chunk, or use --kv-budget)") from None
            raise BackendUnavailable(where) from None

    @staticmethod
    def _f32(a, what: str, ndim: int = 2) -> DeviceArray:
        if not isinstance(a, DeviceArray):
            raise TypeError(f"vulkan {what}: expected a backend array (alloc/upload), got {type(a).__name__}")
        if a.dtype != F32 or a.ndim != ndim:
            raise TypeError(f"vulkan {what}: expected f32 {ndim}-d, got {a.dtype} {a.shape}")
        return a

    # -- ops --------------------------------------------------------------------------
    def embedding(self, table: VulkanWeight, ids, out) -> None:
        at = self._slot(ids)                               # a recorded step's tokens (StepValues)
        ids = np.asarray(ids, dtype=np.int32).reshape(-1)
        out = self._f32(out, "embedding")
        n, cols = len(ids), table.shape[1]
        if out.shape != (n, cols):
            raise ValueError(f"vulkan embedding: out {out.shape} != ({n}, {cols})")
        if at:
            id_buf, id0, use = self._step_buffer, 0, at
        elif n == 1:
            id_buf, id0, use = self._dummy, int(ids[0]), 0
        else:
            id_buf, id0, use = self._transient(ids).buffer, 0, 1
        nsub = -(-cols // 32)
        for r0, n_rows, buf in table.parts:                # each part writes the ids in its rows
            push = _u32(n, cols, table.row_bytes, id0, use, out.offset, out.row_stride, r0, n_rows)
            self._dispatch("embedding", table.defines, [buf, id_buf, out.buffer], (-(-nsub // 64), n, 1), push)

    def rms_norm(self, x, weight, eps: float, out) -> None:
        self._rms_norm(x, None, weight, eps, out)

    def add_rms_norm(self, x, r, weight, eps: float, out) -> None:
        self._rms_norm(x, r, weight, eps, out)

    def _rms_norm(self, x, r, weight, eps: float, out) -> None:
        """out = rms_norm(x) * weight, after x += r when r is given (one dispatch)."""
        op = "rms_norm" if r is None else "add_rms_norm"
        x, out, weight = self._f32(x, op), self._f32(out, op), self._f32(weight, op, 1)
        n, d = x.shape
        g = weight.shape[0]                                # group width: d (row norm) or head_dim
        if g == 0 or d % g or out.shape != (n, d) or (r is not None and self._f32(r, op).shape != (n, d)):
            raise ValueError(f"vulkan {op}: x {x.shape}, weight {weight.shape}, out {out.shape}"
                             + ("" if r is None else f", r {r.shape}"))
        push = _u32(n, g, x.offset, x.row_stride, weight.offset, out.offset, out.row_stride, _fbits(eps),
                    0 if r is None else r.offset, 0 if r is None else r.row_stride)
        buffers = [x.buffer, weight.buffer, out.buffer] + ([] if r is None else [r.buffer])
        self._dispatch("rms_norm", () if r is None else ("ADD",), buffers, (d // g, n, 1), push)

    def scale(self, x, s: float, out) -> None:
        self._eltwise("scale", x, None, out, s)

    def matmul(self, w: VulkanWeight, x, out, bias=None) -> None:
        self._matmul(w, x, out, bias)

    def gated_matmul(self, w: VulkanWeight, gate_up, out, act: str, scratch) -> None:
        """The FFN's down projection over [gate | up] rows: one dispatch for a single token
        (matmul.comp GATE_*), else the gate into `scratch`, then matmul."""
        if act not in GATE_DEFINES:
            raise ValueError(f"vulkan gated_matmul: unknown activation {act!r} ({', '.join(GATE_DEFINES)})")
        gate_up = self._f32(gate_up, "gated_matmul")
        cols = w.shape[1]
        if gate_up.shape[0] == 1:
            self._matmul(w, gate_up, out, None, act)
            return
        if gate_up.shape[1] != 2 * cols:
            raise ValueError(f"vulkan gated_matmul: gate_up {gate_up.shape}, W {w.shape}")
        (self.silu_gate if act == "silu" else self.gelu_gate)(gate_up[:, :cols], gate_up[:, cols:], scratch)
        self._matmul(w, scratch, out, None)

    def _matmul(self, w: VulkanWeight, x, out, bias=None, gate: str | None = None) -> None:
        """matmul; with `gate` (gated_matmul's activation) x holds [gate | up] rows."""
        x, out = self._f32(x, "matmul"), self._f32(out, "matmul")
        rows, cols = w.shape
        n = x.shape[0]
        if x.shape[1] != (cols if gate is None else 2 * cols) or out.shape != (n, rows):
            raise ValueError(f"vulkan matmul: x {x.shape}, W {w.shape}, out {out.shape}")
        gated = () if gate is None else (GATE_DEFINES[gate],)
        if bias is None:
            b_buf, b_off, has_b = self._dummy, 0, 0
        else:
            bias = self._f32(bias, "matmul bias", 1)
            b_buf, b_off, has_b = bias.buffer, bias.offset, 1
        if w.block_major and not self.matmul_cpu_layout:
            raise ValueError("vulkan matmul: a block-major weight (loaded for the ROW_PER_LANE layout) "
                             "cannot run in the GPU layout")
        for r0, n_rows, buf in w.parts:                    # each part: its columns of out
            defines, lpr_log2, grid, spec = shaders.matmul_geometry(
                n_rows, cols, n, self.cpu_threads if self.matmul_cpu_layout else None)
            push = _u32(n_rows, cols, n, w.row_bytes, x.offset, x.row_stride, out.offset + r0, out.row_stride,
                        b_off + r0, has_b, lpr_log2)
            self._dispatch("matmul", w.defines + gated + defines, [buf, x.buffer, out.buffer, b_buf], grid, push,
                           spec)

    def _rope_table(self, base: float, rot_dim: int, max_pos: int, factors=None) -> DeviceArray:
        """(cos, sin) f32 [cap, rot_dim/2, 2], computed in float64; grown on demand."""
        inv_freq = rope_inv_freq(base, rot_dim, factors)                        # f64 [rot_dim/2]
        key = (int(rot_dim), inv_freq.tobytes())
        have = self._rope_tables.get(key)
        if have is not None and have[1] > max_pos:
            return have[0]
        cap = max(4096, 1 << int(max_pos).bit_length())
        angle = np.arange(cap, dtype=np.float64)[:, None] * inv_freq[None, :]
        table = np.stack([np.cos(angle), np.sin(angle)], axis=-1).astype(np.float32)
        arr = self.upload(table)
        self._rope_tables[key] = (arr, cap)
        return arr

    def rope(self, x, positions, n_heads: int, head_dim: int, rot_dim: int,
             freq_base: float, neox: bool, freq_factors=None) -> None:
        x = self._f32(x, "rope")
        at = self._slot(positions)                         # a recorded step's positions (StepValues)
        positions = np.asarray(positions, dtype=np.int32).reshape(-1)
        n = x.shape[0]
        if n == 0:
            return
        if x.shape[1] < n_heads * head_dim or rot_dim > head_dim or rot_dim % 2:
            raise ValueError(f"vulkan rope: x {x.shape}, {n_heads} heads of {head_dim}, rot_dim {rot_dim}")
        table, pos_buf, use, pos0 = self._rope_inputs(positions, at, freq_base, rot_dim, freq_factors)
        push = _u32(n, n_heads, head_dim, rot_dim, int(bool(neox)), x.offset, x.row_stride, pos0, use)
        self._dispatch("rope", (), [x.buffer, table.buffer, pos_buf], (n_heads, n, 1), push)

    def _rope_inputs(self, positions: np.ndarray, at: int, freq_base: float, rot_dim: int, freq_factors) -> tuple:
        """(table, positions buffer, use_pos, pos0) of rope.comp's inputs: the (cos, sin) table
        covering the positions (and those a recorded step may hold); the positions as a
        recorded step's slots (at: the first slot + 1), none for consecutive ones (pos0 +
        t), else a transient buffer."""
        table = self._rope_table(freq_base, rot_dim, max(int(positions.max()), self._max_position - 1),
                                 freq_factors)
        pos0 = int(positions[0])
        if at:
            return table, self._step_buffer, at, pos0
        if np.array_equal(positions, pos0 + np.arange(len(positions), dtype=np.int32)):
            return table, self._dummy, 0, pos0
        return table, self._transient(positions).buffer, 1, pos0

    # -- KV rows ------------------------------------------------------------------------
    @staticmethod
    def _kv_format(pages, dtype: str, head_dim: int, what: str) -> KvFormat:
        """The pool's KvFormat, checked against the pages' storage and row width."""
        fmt = KvFormat.get(dtype, head_dim)
        if not isinstance(pages, DeviceArray) or pages.ndim != 4:
            raise TypeError(f"vulkan {what}: expected 4-d KV pages (alloc_kv_pool/upload), got {pages!r}")
        if pages.dtype != np.dtype(fmt.storage) or pages.shape[3] != fmt.row_width:
            raise ValueError(f"vulkan {what}: {dtype} pages at head_dim {head_dim} have rows of "
                             f"{fmt.row_width} {np.dtype(fmt.storage)}, got {pages.dtype} {pages.shape}")
        if head_dim % 2 or head_dim > 256:
            raise ValueError(f"vulkan {what}: head_dim must be even and <= 256, got {head_dim}")
        return fmt

    @staticmethod
    def _row_bytes(pages) -> int:
        return pages.shape[3] * pages.dtype.itemsize

    def _rot_table(self, dtype: str, head_dim: int) -> DeviceArray:
        """f32 [2, head_dim, head_dim]: R^T then R of a rotated dtype (KvFormat.rotation;
        tq4 and tq3 share one), uploaded once."""
        r = KvFormat.get(dtype, head_dim).rotation
        key = (rotation_kind(dtype), head_dim)
        table = self._rot_tables.get(key)
        if table is None:
            table = self._rot_tables[key] = self.upload(np.stack([r.T, r]))
        return table

    def _kept_scratch(self, role: str, n_words: int) -> Buffer:
        """A scratch buffer of at least n_words, one per role, kept (so the pipelines that
        bind it stay cached) and grown to the next power of two when too small."""
        buf = self._kept.get(role)
        if buf is None or buf.n_words < n_words:
            if buf is not None:
                self._keepalive.append(buf)                # still bound by pending dispatches
            buf = self._kept[role] = self._buffer(np.zeros(1 << max(10, (n_words - 1).bit_length()), np.uint32),
                                                  zeros=True)
        return buf

    def _rot_buffer(self, role: str, n: int, width: int) -> DeviceArray:
        """Scratch f32 [n, width] for rotated rows ("a": queries, "b": attention output)."""
        return DeviceArray(self._kept_scratch(role, n * width), F32, (n, width))

    def _rotate(self, x: DeviceArray, y: DeviceArray, dtype: str, n_heads: int, head_dim: int,
                back: bool) -> None:
        """Each head_dim-wide head of x's rows -> y: R x (into the basis of dtype's rows) or
        R^T x (back)."""
        table = self._rot_table(dtype, head_dim)
        push = _u32(head_dim, x.offset, x.row_stride, y.offset, y.row_stride,
                    head_dim * head_dim if back else 0)
        self._dispatch("kv_rotate", (), [x.buffer, table.buffer, y.buffer], (n_heads, x.shape[0], 1), push)

    def kv_write(self, k_pages, v_pages, page_table, k, v, start_row: int,
                 k_dtype: str = "bf16", v_dtype: str = "bf16") -> None:
        check_kv_dtypes(self, k_dtype, v_dtype)
        k, v = self._f32(k, "kv_write"), self._f32(v, "kv_write")
        n_kv = k_pages.shape[1]
        n, width = k.shape
        head_dim = width // n_kv
        if v.shape != (n, width) or width != n_kv * head_dim:
            raise ValueError(f"vulkan kv_write: k {k.shape}, v {v.shape} for {n_kv} KV heads")
        self._kv_format(k_pages, k_dtype, head_dim, "kv_write")
        self._kv_format(v_pages, v_dtype, head_dim, "kv_write")
        if n == 0:
            return
        if is_rotated(k_dtype):                           # rows are coded in the rotated basis
            k, k_src = self._rot_buffer("a", n, width), k
            self._rotate(k_src, k, k_dtype, n_kv, head_dim, back=False)
        if is_rotated(v_dtype):
            v, v_src = self._rot_buffer("b", n, width), v
            self._rotate(v_src, v, v_dtype, n_kv, head_dim, back=False)
        page_size = k_pages.shape[2]
        check_table(page_table, page_size, start_row + n, "vulkan kv_write")   # (the shaders index it unchecked)
        at = self._slot(start_row)                         # a recorded step's row: STEP[at - 1]
        push = _u32(n, n_kv, head_dim, page_size, start_row, k.offset, k.row_stride, v.offset, v.row_stride, at)
        self._dispatch("kv_write", shaders.kv_defines(k_dtype, v_dtype),
                       [k_pages.buffer, v_pages.buffer, page_table.buffer, k.buffer, v.buffer,
                        self._step_buffer if at else self._dummy], (n_kv, n, 2), push)

    def rope_kv_write(self, qkv, positions, n_heads: int, rot_dim: int, freq_base: float, neox: bool,
                      freq_factors, k_pages, v_pages, page_table, start_row: int, k_dtype: str = "bf16",
                      v_dtype: str = "bf16", centre=None) -> None:
        """kv_write.comp's ROPE variant: q rotated in place, keys rotated and centred as
        they are encoded, one dispatch (values of a rotated format: kv_rotate first)."""
        check_kv_dtypes(self, k_dtype, v_dtype)
        qkv = self._f32(qkv, "rope_kv_write")
        at_pos = self._slot(positions)                     # a recorded step's positions (StepValues)
        positions = np.asarray(positions, dtype=np.int32).reshape(-1)
        n_kv = k_pages.shape[1]
        n, width = qkv.shape
        head_dim = width // (n_heads + 2 * n_kv)
        q_dim, kv_dim = n_heads * head_dim, n_kv * head_dim
        if k_dtype not in self.rope_write_keys or width != q_dim + 2 * kv_dim or n_heads % n_kv \
                or rot_dim > head_dim or rot_dim % 2 or len(positions) != n \
                or (centre is not None and centre.shape != (1, kv_dim)):
            raise ValueError(f"vulkan rope_kv_write: qkv {qkv.shape}, {n_heads} query heads over {n_kv} KV "
                             f"heads, keys {k_dtype}, rot_dim {rot_dim}, {len(positions)} positions")
        self._kv_format(k_pages, k_dtype, head_dim, "rope_kv_write")
        self._kv_format(v_pages, v_dtype, head_dim, "rope_kv_write")
        if n == 0:
            return
        check_table(page_table, k_pages.shape[2], start_row + n, "vulkan rope_kv_write")
        k, v = qkv[:, q_dim:q_dim + kv_dim], qkv[:, q_dim + kv_dim:]
        if is_rotated(v_dtype):                           # rows are coded in the rotated basis
            v, v_src = self._rot_buffer("b", n, kv_dim), v
            self._rotate(v_src, v, v_dtype, n_kv, head_dim, back=False)
        table, pos_buf, use, pos0 = self._rope_inputs(positions, at_pos, freq_base, rot_dim, freq_factors)
        centre = None if centre is None else self._f32(centre, "rope_kv_write")
        at = self._slot(start_row)                         # a recorded step's row: STEP[at - 1]
        group = n_heads // n_kv
        push = _u32(n, n_kv, head_dim, k_pages.shape[2], start_row, k.offset, k.row_stride, v.offset, v.row_stride,
                    at, qkv.offset, group, rot_dim, int(bool(neox)), pos0, use,
                    0 if centre is None else centre.offset, int(centre is not None))
        self._dispatch("kv_write", ("ROPE",) + shaders.kv_defines(k_dtype, v_dtype),
                       [k_pages.buffer, v_pages.buffer, page_table.buffer, qkv.buffer, v.buffer,
                        self._step_buffer if at else self._dummy, table.buffer, pos_buf,
                        self._dummy if centre is None else centre.buffer], (n_kv, n, 2 + group), push)

    def _attention(self, q, k_pages, v_pages, page_table, start_row, n_q_heads, scale, out, window,
                   k_dtype, v_dtype, row_bias, step_at: int = 0):
        """step_at > 0: a recorded decode step's rows attended are STEP[step_at - 1]."""
        check_kv_dtypes(self, k_dtype, v_dtype)
        q, out = self._f32(q, "attention"), self._f32(out, "attention")
        n_kv = k_pages.shape[1]
        n, width = q.shape
        head_dim = width // max(n_q_heads, 1)
        if n_q_heads <= 0 or n_q_heads % n_kv or width != n_q_heads * head_dim or out.shape != q.shape \
                or window < 0:
            raise ValueError(f"vulkan attention: q {q.shape}, out {out.shape}, {n_q_heads} query heads "
                             f"over {n_kv} KV heads, window {window}")
        self._kv_format(k_pages, k_dtype, head_dim, "attention")
        self._kv_format(v_pages, v_dtype, head_dim, "attention")
        bias_buf, bias_off, bias_stride, n_bias = self._row_bias(row_bias, n_kv)
        if n == 0:
            return
        check_table(page_table, k_pages.shape[2], start_row + n, "vulkan attention")
        if is_rotated(k_dtype):                           # score in the keys' basis: (R q) . y
            q, q_src = self._rot_buffer("a", n, width), q
            self._rotate(q_src, q, k_dtype, n_q_heads, head_dim, back=False)
        o = self._rot_buffer("b", n, width) if is_rotated(v_dtype) else out
        page_size = k_pages.shape[2]
        push = _u32(n, n_q_heads, n_kv, head_dim, page_size, start_row, q.offset, q.row_stride,
                    o.offset, o.row_stride, _fbits(scale), window, bias_off, bias_stride, n_bias, step_at)
        step_buf = self._step_buffer if step_at else self._dummy
        defines = shaders.kv_defines(k_dtype, v_dtype)
        group = n_q_heads // n_kv if n_q_heads // n_kv <= shaders.MAX_GROUP else 1   # heads per workgroup
        workgroups = n_q_heads // group                    # one per KV head, or per query head
        qpw = min(shaders.MAX_GROUP // group, n)           # queries per workgroup: a K/V row read serves all
        spec = (group, qpw) if group * qpw > 1 else ()
        splits = self.decode_splits if n == 1 else 1
        pages = [q.buffer, k_pages.buffer, v_pages.buffer, page_table.buffer]
        if n == 1 and self.decode_lanes and group * n_kv == n_q_heads:    # CPU devices: a lane per row
            splits = self.cpu_threads * shaders.ATTENTION_LANES              # of a span per device thread
            first = ("attention_lanes", defines, (n_kv, self.cpu_threads, 1), (group, head_dim))
        elif splits > 1:                                   # flash-decoding: spans, then a merge
            first = ("attention", defines + (f"SPLIT={splits}u",), (workgroups, splits, 1), spec)
        else:
            first = None
        if first is None:                                  # one pass: a workgroup per (KV) head and queries
            self._dispatch("attention", defines, pages + [o.buffer, bias_buf, step_buf],
                           (workgroups, -(-n // qpw), 1), push, spec)
        else:                                              # partial results per span, merged per head
            shader, variant, grid, constants = first
            part = self._kept_scratch("partials", n_q_heads * splits * (head_dim + 2))
            self._dispatch(shader, variant, pages + [part, bias_buf, step_buf], grid, push, constants)
            self._dispatch("attention_combine", (), [part, o.buffer], (n_q_heads, 1, 1),
                           _u32(head_dim, splits, o.offset))
        if o is not out:                                   # sum_j p_j y_j back from the values' basis
            self._rotate(o, out, v_dtype, n_q_heads, head_dim, back=True)

    def _row_bias(self, row_bias, n_kv: int) -> tuple:
        """(buffer, offset, row stride, n_bias) of attention's row bias, f32 [n_kv, n_bias]
        added to the scores of rows 0 .. n_bias-1 (merged rows' log-counts); None: the
        dummy buffer and n_bias = 0."""
        if row_bias is None:
            return self._dummy, 0, 0, 0
        if not isinstance(row_bias, DeviceArray):
            raise TypeError(f"vulkan attention: row_bias must be a backend array (upload), "
                            f"got {type(row_bias).__name__}")
        if row_bias.dtype != F32 or row_bias.ndim != 2 or row_bias.shape[0] != n_kv:
            raise ValueError(f"vulkan attention: row_bias must be f32 [n_kv_heads={n_kv}, n_bias], "
                             f"got {row_bias.dtype} {row_bias.shape}")
        return row_bias.buffer, row_bias.offset, row_bias.row_stride, row_bias.shape[1]

    def attention_prefill(self, q, k_pages, v_pages, page_table, start_row: int,
                          n_q_heads: int, scale: float, out, window: int = 0,
                          k_dtype: str = "bf16", v_dtype: str = "bf16", row_bias=None) -> None:
        self._attention(q, k_pages, v_pages, page_table, start_row, n_q_heads, scale, out, window,
                        k_dtype, v_dtype, row_bias)

    def attention_decode(self, q, k_pages, v_pages, page_table, n_rows: int,
                         n_q_heads: int, scale: float, out, window: int = 0,
                         k_dtype: str = "bf16", v_dtype: str = "bf16", row_bias=None) -> None:
        self._attention(q, k_pages, v_pages, page_table, n_rows - 1, n_q_heads, scale, out, window,
                        k_dtype, v_dtype, row_bias, self._slot(n_rows))

    def _eltwise(self, op: str, a, b, out, s: float = 0.0) -> None:
        """out = op(a, b) (b None for "scale", which multiplies by s) over [n, d] views;
        b [1, d] (add only) serves every row."""
        a, out = self._f32(a, op), self._f32(out, op)
        n, d = a.shape
        if b is None:
            b_buf, b_off, b_stride = self._dummy, 0, 0
        else:
            b = self._f32(b, op)
            one_row = op == "add" and b.shape == (1, d)
            if b.shape != (n, d) and not one_row:
                raise ValueError(f"vulkan {op}: shapes {a.shape}, {b.shape}, {out.shape}")
            b_buf, b_off, b_stride = b.buffer, b.offset, 0 if one_row else b.row_stride
        if out.shape != (n, d):
            raise ValueError(f"vulkan {op}: shapes {a.shape}, {out.shape}")
        push = _u32(n, d, a.offset, a.row_stride, b_off, b_stride, out.offset, out.row_stride, _fbits(s))
        self._dispatch("eltwise", (shaders.ELTWISE_OPS[op],), [a.buffer, b_buf, out.buffer],
                       (-(-d // 64), n, 1), push)

    def silu_gate(self, gate, up, out) -> None:
        self._eltwise("silu_gate", gate, up, out)

    def gelu_gate(self, gate, up, out) -> None:
        self._eltwise("gelu_gate", gate, up, out)

    def add(self, a, b, out) -> None:
        self._eltwise("add", a, b, out)

    def argmax_rows(self, x, out) -> None:
        """out int32 [n] = the index of each row's largest value in x (f32 [n, d]), the
        first of equal ones; -1 for a row holding a NaN or an infinity (argmax.comp)."""
        x = self._f32(x, "argmax_rows")
        n, d = x.shape
        if not isinstance(out, DeviceArray) or out.shape != (n,) or out.dtype != np.int32 or d == 0:
            raise ValueError(f"vulkan argmax_rows: x {x.shape}, out {getattr(out, 'shape', out)}")
        if n:
            self._dispatch("argmax", (), [x.buffer, out.buffer], (n, 1, 1), _u32(d, x.offset, x.row_stride, out.offset))

    def snapkv_votes(self, q_window, k_pages, page_table, n_rows: int, scale: float,
                     k_dtype: str = "bf16") -> np.ndarray:
        check_kv_dtypes(self, k_dtype)
        if isinstance(q_window, np.ndarray):
            q_window = self._transient(np.ascontiguousarray(q_window, dtype=np.float32))
        if q_window.ndim != 3 or not q_window.contiguous:
            raise ValueError(f"vulkan snapkv_votes: q_window must be a contiguous [n_q_heads, W, head_dim], "
                             f"got {q_window!r}")
        n_q_heads, window, head_dim = q_window.shape
        self._kv_format(k_pages, k_dtype, head_dim, "snapkv_votes")
        n_kv, page_size = k_pages.shape[1], k_pages.shape[2]
        prefix = n_rows - window
        if prefix <= 0:
            return np.zeros((n_kv, max(prefix, 0)), np.float32)
        check_table(page_table, page_size, n_rows, "vulkan snapkv_votes")
        q_buf, q_off = q_window.buffer, q_window.offset
        if is_rotated(k_dtype):                           # window queries into the keys' basis
            flat = DeviceArray(q_buf, F32, (n_q_heads * window, head_dim), q_off)
            rotated = self._rot_buffer("a", n_q_heads * window, head_dim)
            self._rotate(flat, rotated, k_dtype, 1, head_dim, back=False)
            q_buf, q_off = rotated.buffer, 0
        stats = self._scratch(2 * n_q_heads * window)
        votes = self._scratch(n_kv * prefix)
        push = _u32(n_q_heads, n_kv, head_dim, page_size, n_rows, window, q_off, _fbits(scale))
        bufs = [q_buf, k_pages.buffer, page_table.buffer, stats, votes]
        defines = shaders.kv_defines(k_dtype)
        self._dispatch("snapkv_votes", ("PASS_STATS",) + defines, bufs, (n_q_heads, window, 1), push)
        self._dispatch("snapkv_votes", ("PASS_VOTES",) + defines, bufs, (-(-prefix // 64), n_kv, 1), push)
        return self.download(DeviceArray(votes, F32, (n_kv, prefix)))

    def kv_gather(self, k_pages, v_pages, page_table, keep) -> None:
        keep = np.ascontiguousarray(keep, dtype=np.int32)
        n_kv, n_keep = keep.shape
        if n_keep == 0:
            return
        page_size = k_pages.shape[2]
        k_rb, v_rb = self._row_bytes(k_pages), self._row_bytes(v_pages)
        keep_dev = self._transient(keep)
        tmp = self._scratch(n_kv * n_keep * (-(-k_rb // 4) + -(-v_rb // 4)))
        push = _u32(n_kv, n_keep, k_rb, v_rb, page_size)
        bufs = [k_pages.buffer, v_pages.buffer, page_table.buffer, keep_dev.buffer, tmp]
        groups = min(n_keep, GATHER_GROUPS)              # each workgroup moves every groups-th row
        self._dispatch("kv_gather", ("PASS_GATHER",), bufs, (groups, n_kv, 1), push)
        self._dispatch("kv_gather", ("PASS_SCATTER",), bufs, (groups, n_kv, 1), push)

    def kv_copy_pages(self, src_k, src_v, dst_k, dst_v, pages, dst_pages=None) -> None:
        pages = np.ascontiguousarray(pages, dtype=np.int32).reshape(-1)
        dst_pages = pages if dst_pages is None else np.ascontiguousarray(dst_pages, dtype=np.int32).reshape(-1)
        if dst_pages.shape != pages.shape:
            raise ValueError(f"vulkan kv_copy_pages: {pages.size} source pages but {dst_pages.size} destinations")
        if pages.size == 0:
            return
        if src_k.shape != dst_k.shape or src_v.shape != dst_v.shape \
                or src_k.dtype != dst_k.dtype or src_v.dtype != dst_v.dtype:
            raise ValueError(f"vulkan kv_copy_pages: pools differ: {src_k!r} / {dst_k!r}, {src_v!r} / {dst_v!r}")
        _, n_kv, page_size, _ = src_k.shape
        k_page, v_page = (n_kv * page_size * self._row_bytes(p) for p in (src_k, src_v))
        pages_dev = self._transient(np.concatenate([pages, dst_pages]))     # sources, then destinations
        words = max(k_page, v_page) // 4 + 2              # a page may straddle one more word
        for first in range(0, pages.size, shaders.MAX_WORKGROUPS):     # pages on y: 65,535 a dispatch
            push = _u32(pages.size, k_page, v_page, first)
            self._dispatch("kv_copy_pages", (), [src_k.buffer, src_v.buffer, dst_k.buffer, dst_v.buffer,
                                                 pages_dev.buffer],
                           (-(-words // 256), min(shaders.MAX_WORKGROUPS, pages.size - first), 1), push)
