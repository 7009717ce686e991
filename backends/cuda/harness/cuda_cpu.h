// CUDA built-ins with a CPU meaning, so that the unchanged kernels/*.cu sources run on
// the CPU (tests). backends/cuda/harness.py force-includes it before a kernel file:
//     g++ -std=c++17 -O2 -fno-weak -fno-strict-aliasing -include cuda_cpu.h -x c++ k.cu
//
// Execution model. Every CUDA thread is a fiber with its own stack (the caller lends a
// pool of 1024 stacks). All fibers of a launch run on the calling OS thread; blocks
// run one after another, so `__shared__` arrays are plain statics. A fiber runs until
// it reaches a synchronization point (__syncthreads, __syncwarp, a shuffle, a vote) or
// returns, then switches straight to the next runnable fiber (a 6-register x86-64
// switch, no syscall); the scheduler regains control when none is left.
//
// Scheduling (deterministic, chosen to expose missing barriers). A block runs in
// rounds: round 0 holds every thread, and a thread released by a barrier or a warp
// operation joins the next round. Each round runs its threads in a shuffled order
// (splitmix64 seeded by the kernel name, the block index and the round number), and
// if thread 0 would run first it swaps places with the last one, since "thread 0
// writes shared memory, the others read it" is the most common missing barrier. Each
// thread runs alone up to its next synchronization point, so a missing __syncthreads
// or __syncwarp reads the 0xFF (NaN) fill or a stale value, the same way every run.
//
// Synchronization. __syncthreads releases when every live (not exited) thread of the
// block waits at it. A warp operation releases when every lane named in its mask has
// arrived at the same operation with the same mask and width; results are computed at
// release, so a shuffle inside a branch that only some warps (or lanes) take is exact.
// Strict checks turn GPU undefined behaviour into an error that aborts the launch:
// a mask without the calling lane, a lane in the mask that has exited (or lies past
// the end of a partial warp) or waits at __syncthreads or at another warp operation,
// threads waiting at two different __syncthreads (a barrier in divergent code), a
// __syncthreads while a lane of the same warp waits for this thread in a shuffle, and
// any state in which no fiber can run. A shuffle that reads a lane outside its mask
// gets 0xFF bytes (NaN / -1): undefined on the GPU, harmless when discarded.
//
// Shared memory: static __shared__ variables live in the ELF section cuda_cpu_shared
// (statics of inline functions too, hence -fno-weak). g++ ignores the section attribute
// on statics of template functions; harness.py finds those in the symbol table and
// passes them as extra ranges. The section, the extra ranges and the dynamic shared
// memory (DYN_SHARED) are filled with 0xFF bytes before every block.
//
// Memcheck (harness.py, on by default): every array argument lies in its own mapping
// whose end touches a PROT_NONE guard page; a kernel access that faults in a guard
// page is reported with the thread and the argument (on_fault) and aborts the launch.
//
// No system headers: the libc/libm functions used are declared below, so a kernel
// that calls something NVRTC lacks fails to compile here too. x86-64 Linux only.
#pragma once
#if !defined(__x86_64__) || !defined(__linux__)
#error "cuda_cpu.h needs x86-64 Linux (the fiber switch is x86-64 assembly)"
#endif

#define CUDA_CPU_HARNESS 1

// harness.py preprocesses with CUDA_CPU_PARSE_ONLY to find the `__global__` entry points
#ifndef CUDA_CPU_PARSE_ONLY

// ---------------------------------------------------------------- qualifiers
#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ __inline__ __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__ static __attribute__((section("cuda_cpu_shared")))
#define DYN_SHARED(type, name) type* const name = reinterpret_cast<type*>(::cuda_cpu::dyn_smem)
#define warpSize 32

// ---------------------------------------------------------------- vector types
#define CUDA_CPU_VEC2(T, N, A)                      \
    struct alignas(A) N##2 { T x, y; };             \
    constexpr N##2 make_##N##2(T x, T y) { return {x, y}; }
#define CUDA_CPU_VEC3(T, N)                         \
    struct N##3 { T x, y, z; };                     \
    constexpr N##3 make_##N##3(T x, T y, T z) { return {x, y, z}; }
#define CUDA_CPU_VEC4(T, N, A)                      \
    struct alignas(A) N##4 { T x, y, z, w; };       \
    constexpr N##4 make_##N##4(T x, T y, T z, T w) { return {x, y, z, w}; }

CUDA_CPU_VEC2(float, float, 8)  CUDA_CPU_VEC3(float, float)  CUDA_CPU_VEC4(float, float, 16)
CUDA_CPU_VEC2(int, int, 8)      CUDA_CPU_VEC3(int, int)      CUDA_CPU_VEC4(int, int, 16)
CUDA_CPU_VEC2(unsigned, uint, 8) CUDA_CPU_VEC3(unsigned, uint) CUDA_CPU_VEC4(unsigned, uint, 16)
CUDA_CPU_VEC2(short, short, 4)  CUDA_CPU_VEC2(unsigned short, ushort, 4)
CUDA_CPU_VEC4(signed char, char, 4) CUDA_CPU_VEC4(unsigned char, uchar, 4)
CUDA_CPU_VEC2(long long, longlong, 16) CUDA_CPU_VEC2(unsigned long long, ulonglong, 16)
CUDA_CPU_VEC2(double, double, 16)

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return {x, y, z}; }
};

// ---------------------------------------------------------------- libm, printf
extern "C" {
float expf(float) noexcept;   float exp2f(float) noexcept;  float expm1f(float) noexcept;
float logf(float) noexcept;   float log2f(float) noexcept;  float log10f(float) noexcept;
float log1pf(float) noexcept; float sqrtf(float) noexcept;  float tanhf(float) noexcept;
float sinf(float) noexcept;   float cosf(float) noexcept;   float tanf(float) noexcept;
float atanf(float) noexcept;  float erff(float) noexcept;   float floorf(float) noexcept;
float ceilf(float) noexcept;  float roundf(float) noexcept; float truncf(float) noexcept;
float rintf(float) noexcept;  float fabsf(float) noexcept;  float fmodf(float, float) noexcept;
float fmaxf(float, float) noexcept; float fminf(float, float) noexcept;
float powf(float, float) noexcept;  float copysignf(float, float) noexcept;
float fmaf(float, float, float) noexcept;
double exp(double) noexcept;  double log(double) noexcept;  double sqrt(double) noexcept;
double fabs(double) noexcept; double floor(double) noexcept; double ceil(double) noexcept;
double tanh(double) noexcept; double pow(double, double) noexcept;
double fmax(double, double) noexcept; double fmin(double, double) noexcept;
double fma(double, double, double) noexcept;
int printf(const char*, ...);
}

// ---------------------------------------------------------------- intrinsics
__forceinline__ float __expf(float x) { return expf(x); }
__forceinline__ float __exp10f(float x) { return powf(10.0f, x); }
__forceinline__ float __logf(float x) { return logf(x); }
__forceinline__ float __log2f(float x) { return log2f(x); }
__forceinline__ float __powf(float x, float y) { return powf(x, y); }
__forceinline__ float __sinf(float x) { return sinf(x); }
__forceinline__ float __cosf(float x) { return cosf(x); }
__forceinline__ float __tanf(float x) { return tanf(x); }
__forceinline__ float __fdividef(float a, float b) { return a / b; }
__forceinline__ float __frcp_rn(float x) { return 1.0f / x; }
__forceinline__ float __fsqrt_rn(float x) { return sqrtf(x); }
__forceinline__ float rsqrtf(float x) { return 1.0f / sqrtf(x); }
__forceinline__ float __saturatef(float x) { return x > 1.0f ? 1.0f : (x > 0.0f ? x : 0.0f); }
__forceinline__ float __fadd_rn(float a, float b) { return a + b; }
__forceinline__ float __fsub_rn(float a, float b) { return a - b; }
__forceinline__ float __fmul_rn(float a, float b) { return a * b; }
__forceinline__ float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
__forceinline__ int __float2int_rn(float x) { return (int)rintf(x); }
__forceinline__ int __float2int_rz(float x) { return (int)x; }
__forceinline__ int __float2int_rd(float x) { return (int)floorf(x); }
__forceinline__ int __float2int_ru(float x) { return (int)ceilf(x); }
__forceinline__ unsigned __float2uint_rn(float x) { return (unsigned)rintf(x); }
__forceinline__ float __int2float_rn(int x) { return (float)x; }
__forceinline__ float __uint2float_rn(unsigned x) { return (float)x; }

constexpr float __int_as_float(int v) { return __builtin_bit_cast(float, v); }
constexpr int __float_as_int(float v) { return __builtin_bit_cast(int, v); }
constexpr float __uint_as_float(unsigned v) { return __builtin_bit_cast(float, v); }
constexpr unsigned __float_as_uint(float v) { return __builtin_bit_cast(unsigned, v); }
constexpr double __longlong_as_double(long long v) { return __builtin_bit_cast(double, v); }
constexpr long long __double_as_longlong(double v) { return __builtin_bit_cast(long long, v); }

__forceinline__ int __popc(unsigned x) { return __builtin_popcount(x); }
__forceinline__ int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
__forceinline__ int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
__forceinline__ int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
__forceinline__ int __ffs(int x) { return __builtin_ffs(x); }
__forceinline__ int __ffsll(long long x) { return __builtin_ffsll(x); }
__forceinline__ unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; i++) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
// byte i of the result = byte (s >> 4i) & 7 of the 8 bytes {y:x}
__forceinline__ unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    unsigned long long xy = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; i++) r |= (unsigned)((xy >> (8 * ((s >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
    return r;
}

// dot product of the four (signed / unsigned) bytes of a and b, plus c (wrapping)
__forceinline__ int __dp4a(int a, int b, int c) {
    int s = 0;
    for (int i = 0; i < 4; i++) s += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return (int)((unsigned)c + (unsigned)s);
}
__forceinline__ unsigned __dp4a(unsigned a, unsigned b, unsigned c) {
    unsigned s = 0;
    for (int i = 0; i < 4; i++) s += ((a >> (8 * i)) & 0xFFu) * ((b >> (8 * i)) & 0xFFu);
    return c + s;
}
__forceinline__ int __dp4a(char4 a, char4 b, int c) {
    return c + a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}
__forceinline__ unsigned __dp4a(uchar4 a, uchar4 b, unsigned c) {
    return c + (unsigned)(a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w);
}

// min / max as CUDA overloads them (mixed signed/unsigned -> unsigned)
#define CUDA_CPU_MINMAX(R, A, B)                                                           \
    __forceinline__ R min(A a, B b) { return (R)a < (R)b ? (R)a : (R)b; }                   \
    __forceinline__ R max(A a, B b) { return (R)a > (R)b ? (R)a : (R)b; }
CUDA_CPU_MINMAX(int, int, int)
CUDA_CPU_MINMAX(unsigned, unsigned, unsigned)
CUDA_CPU_MINMAX(unsigned, int, unsigned)
CUDA_CPU_MINMAX(unsigned, unsigned, int)
CUDA_CPU_MINMAX(long, long, long)
CUDA_CPU_MINMAX(unsigned long, unsigned long, unsigned long)
CUDA_CPU_MINMAX(unsigned long, long, unsigned long)
CUDA_CPU_MINMAX(unsigned long, unsigned long, long)
CUDA_CPU_MINMAX(long long, long long, long long)
CUDA_CPU_MINMAX(unsigned long long, unsigned long long, unsigned long long)
CUDA_CPU_MINMAX(unsigned long long, long long, unsigned long long)
CUDA_CPU_MINMAX(unsigned long long, unsigned long long, long long)
#undef CUDA_CPU_MINMAX
__forceinline__ float min(float a, float b) { return fminf(a, b); }
__forceinline__ float max(float a, float b) { return fmaxf(a, b); }
__forceinline__ double min(double a, double b) { return fmin(a, b); }
__forceinline__ double max(double a, double b) { return fmax(a, b); }
__forceinline__ double min(float a, double b) { return fmin(a, b); }
__forceinline__ double max(float a, double b) { return fmax(a, b); }
__forceinline__ double min(double a, float b) { return fmin(a, b); }
__forceinline__ double max(double a, float b) { return fmax(a, b); }
__forceinline__ int abs(int a) { return a < 0 ? -a : a; }
__forceinline__ long long llabs(long long a) { return a < 0 ? -a : a; }

// ---------------------------------------------------------------- atomics
// One OS thread runs every fiber and a fiber only yields at a sync point, so a
// read-modify-write is atomic as written. Arithmetic wraps as on the GPU.
#define CUDA_CPU_ATOMIC(NAME, T, NEW)                                                      \
    __forceinline__ T NAME(T* p, T v) { T old = *p; *p = (NEW); return old; }
CUDA_CPU_ATOMIC(atomicAdd, int, (int)((unsigned)old + (unsigned)v))
CUDA_CPU_ATOMIC(atomicAdd, unsigned, old + v)
CUDA_CPU_ATOMIC(atomicAdd, unsigned long long, old + v)
CUDA_CPU_ATOMIC(atomicAdd, float, old + v)
CUDA_CPU_ATOMIC(atomicAdd, double, old + v)
CUDA_CPU_ATOMIC(atomicSub, int, (int)((unsigned)old - (unsigned)v))
CUDA_CPU_ATOMIC(atomicSub, unsigned, old - v)
CUDA_CPU_ATOMIC(atomicExch, int, v)
CUDA_CPU_ATOMIC(atomicExch, unsigned, v)
CUDA_CPU_ATOMIC(atomicExch, unsigned long long, v)
CUDA_CPU_ATOMIC(atomicExch, float, v)
CUDA_CPU_ATOMIC(atomicMax, int, old > v ? old : v)
CUDA_CPU_ATOMIC(atomicMax, unsigned, old > v ? old : v)
CUDA_CPU_ATOMIC(atomicMax, long long, old > v ? old : v)
CUDA_CPU_ATOMIC(atomicMax, unsigned long long, old > v ? old : v)
CUDA_CPU_ATOMIC(atomicMin, int, old < v ? old : v)
CUDA_CPU_ATOMIC(atomicMin, unsigned, old < v ? old : v)
CUDA_CPU_ATOMIC(atomicMin, long long, old < v ? old : v)
CUDA_CPU_ATOMIC(atomicMin, unsigned long long, old < v ? old : v)
CUDA_CPU_ATOMIC(atomicAnd, int, old & v)
CUDA_CPU_ATOMIC(atomicAnd, unsigned, old & v)
CUDA_CPU_ATOMIC(atomicOr, int, old | v)
CUDA_CPU_ATOMIC(atomicOr, unsigned, old | v)
CUDA_CPU_ATOMIC(atomicXor, int, old ^ v)
CUDA_CPU_ATOMIC(atomicXor, unsigned, old ^ v)
CUDA_CPU_ATOMIC(atomicInc, unsigned, old >= v ? 0u : old + 1u)
CUDA_CPU_ATOMIC(atomicDec, unsigned, (old == 0u || old > v) ? v : old - 1u)
#undef CUDA_CPU_ATOMIC
#define CUDA_CPU_CAS(T)                                                                    \
    __forceinline__ T atomicCAS(T* p, T cmp, T v) { T old = *p; if (old == cmp) *p = v; return old; }
CUDA_CPU_CAS(int) CUDA_CPU_CAS(unsigned) CUDA_CPU_CAS(unsigned long long) CUDA_CPU_CAS(unsigned short)
#undef CUDA_CPU_CAS

template <class T> __forceinline__ T __ldg(const T* p) { return *p; }
__forceinline__ void __threadfence() { __asm__ __volatile__("" ::: "memory"); }
__forceinline__ void __threadfence_block() { __asm__ __volatile__("" ::: "memory"); }
__forceinline__ void __threadfence_system() { __asm__ __volatile__("" ::: "memory"); }

// ---------------------------------------------------------------- the fiber runtime
// saves rbp rbx r12-r15 and rsp in *save, loads the stack `to` and returns on it
__asm__(".text\n"
        ".globl cuda_cpu_switch\n.weak cuda_cpu_switch\n.hidden cuda_cpu_switch\n"
        ".type cuda_cpu_switch, @function\n"
        "cuda_cpu_switch:\n"
        "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
        "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
        "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
        "  ret\n"
        ".size cuda_cpu_switch, .-cuda_cpu_switch\n");
extern "C" __attribute__((visibility("hidden"))) void cuda_cpu_switch(void** save, void* to);

// the linker's bounds of the static shared memory section
extern "C" __attribute__((visibility("hidden"))) unsigned char __start_cuda_cpu_shared[];
extern "C" __attribute__((visibility("hidden"))) unsigned char __stop_cuda_cpu_shared[];

namespace cuda_cpu {

constexpr unsigned kMaxThreads = 1024, kMaxWarps = kMaxThreads / 32;
constexpr unsigned long long kMaxSharedBytes = 49152;

// keeps the section (and its __start/__stop symbols) present when a file has no __shared__
__shared__ __attribute__((used)) unsigned char shared_anchor[1];
alignas(128) static unsigned char dyn_smem[kMaxSharedBytes];

enum ThreadState : unsigned char { kRunnable, kAtBarrier, kAtWarpOp, kExited };
enum Op : unsigned char { kSyncwarp, kShflIdx, kShflUp, kShflDown, kShflXor, kBallot, kAny, kAll };
static const char* const kOpName[] = {"__syncwarp", "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync",
                                      "__shfl_xor_sync", "__ballot_sync", "__any_sync", "__all_sync"};

struct Thread {
    void* sp;                       // saved stack pointer while switched out
    uint3 idx;
    unsigned lane, warp;
    ThreadState state;
    Op op;                          // the warp operation waited at
    int width, arg;
    unsigned mask;
    unsigned long long value, result;
    const char* file;               // where it waits
    int line;
};

struct Warp {
    unsigned exited, waiting, at_barrier;   // lane bitmasks
    // while `uniform`, every waiting lane waits in (op, mask, width): the common case,
    // checked without a loop over the waiting lanes
    bool uniform;
    Op op;
    int width;
    unsigned mask;
};

struct KernelEntry {
    const char* name;
    void (*body)(void** args);
};

struct Launch {   // the launch in progress
    const KernelEntry* kernel;
    void** args;
    dim3 grid, block;
    uint3 block_idx;
    unsigned n_threads, n_warps, block_linear;
    Thread* cur;
    Thread threads[kMaxThreads];
    Warp warps[kMaxWarps];
    Thread* queue_a[kMaxThreads];
    Thread* queue_b[kMaxThreads];
    const long long* extra_shared;  // (offset from __start_cuda_cpu_shared, bytes) pairs
    int n_extra_shared;
    Thread** run;                   // this round, in order
    Thread** next;                  // released during this round
    unsigned n_run, pos, n_next, round;
    unsigned long long seed;        // of this block's run orders
    unsigned live, at_barrier;
    const char* bar_file;
    int bar_line;
    void* sched_sp;
    bool failed;
    char error[640];
    // memcheck (harness.py): per guarded array 6 addresses (guard before: begin, end;
    // the array: begin, end; guard after: begin, end) and 2 descriptions (before, after)
    const unsigned long long* guards;
    const char* const* guard_names;
    int n_guards;
};
static Launch g;

__forceinline__ Thread* cur() { return g.cur; }

static unsigned long long splitmix(unsigned long long& s) {
    unsigned long long z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static unsigned long long name_hash(const char* s) {
    unsigned long long h = 0xCBF29CE484222325ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001B3ull;
    return h;
}

static void format_error(const Thread* t, const char* fmt, __builtin_va_list ap) {
    int n = 0;
    if (t)
        n = __builtin_snprintf(g.error, sizeof g.error,
                               "kernel '%s' block (%u,%u,%u) thread (%u,%u,%u) [warp %u lane %u]: ",
                               g.kernel->name, g.block_idx.x, g.block_idx.y, g.block_idx.z,
                               t->idx.x, t->idx.y, t->idx.z, t->warp, t->lane);
    else
        n = __builtin_snprintf(g.error, sizeof g.error, "kernel '%s': ", g.kernel->name);
    if (n >= 0 && n < (int)sizeof g.error) __builtin_vsnprintf(g.error + n, sizeof g.error - n, fmt, ap);
    g.failed = true;
}

// Report an error from the scheduler's side (launch checks, deadlock).
static void report(const Thread* t, const char* fmt, ...) {
    __builtin_va_list ap;
    __builtin_va_start(ap, fmt);
    format_error(t, fmt, ap);
    __builtin_va_end(ap);
}

// Report an error about thread `who` from inside the running fiber and abort the launch:
// the fiber is never resumed (its stack is simply reused by the next launch).
[[noreturn]] static void fail(const Thread* who, const char* fmt, ...) {
    __builtin_va_list ap;
    __builtin_va_start(ap, fmt);
    format_error(who, fmt, ap);
    __builtin_va_end(ap);
    void* abandoned;
    cuda_cpu_switch(&abandoned, g.sched_sp);
    __builtin_trap();
}

// ---------------------------------------------------------------- memcheck
// harness.py puts every array argument in its own mapping between PROT_NONE guard
// pages; during a launch with guards, SIGSEGV/SIGBUS go to on_fault (on an alternate
// stack). A fault inside a guard aborts the launch like fail(): the running fiber is
// abandoned, with the handler's frame on the alternate stack (SA_NODEFER: no signal
// stays blocked). Any other fault puts the previous handler back and returns, so the
// access faults again and crashes the process as it would without memcheck. The
// structures are glibc's x86-64 layouts, declared here rather than from <signal.h>.
struct SigAction {
    void (*action)(int, void*, void*);
    unsigned long mask[16];
    int flags;
    void (*restorer)();
};
struct AltStack {
    void* sp;
    int flags;
    unsigned long size;
};
extern "C" int sys_sigaction(int, const SigAction*, SigAction*) __asm__("sigaction");
extern "C" int sys_sigaltstack(const AltStack*, AltStack*) __asm__("sigaltstack");
constexpr int kSigBus = 7, kSigSegv = 11;
constexpr int kSaSigInfo = 0x4, kSaOnStack = 0x08000000, kSaNoDefer = 0x40000000;
constexpr unsigned long kSiAddrOffset = 16;     // siginfo_t::si_addr
constexpr unsigned long kErrOffset = 192;       // ucontext_t::uc_mcontext.gregs[REG_ERR]
static SigAction saved_segv, saved_bus;
static AltStack saved_alt;
alignas(64) static unsigned char alt_stack[64 << 10];

static void on_fault(int sig, void* info, void* uctx) {
    const unsigned long long a = *(const unsigned long long*)((const char*)info + kSiAddrOffset);
    const bool write = sig == kSigSegv && (*(const unsigned long long*)((const char*)uctx + kErrOffset) & 2);
    const char* what = sig == kSigSegv ? (write ? "write" : "read") : "access";
    for (int i = 0; g.cur && i < g.n_guards; i++) {
        const unsigned long long* r = g.guards + 6 * i;
        if (a >= r[0] && a < r[1])
            report(g.cur, "memcheck: invalid %s at 0x%llx, %llu bytes before the start of %s (%llu bytes "
                   "at 0x%llx)", what, a, r[2] - a, g.guard_names[2 * i], r[3] - r[2], r[2]);
        else if (a >= r[4] && a < r[5])
            report(g.cur, "memcheck: invalid %s at 0x%llx, %llu bytes past the end of %s (%llu bytes "
                   "at 0x%llx)", what, a, a - r[3], g.guard_names[2 * i + 1], r[3] - r[2], r[2]);
        else
            continue;
        void* abandoned;
        cuda_cpu_switch(&abandoned, g.sched_sp);
        __builtin_trap();
    }
    sys_sigaction(sig, sig == kSigSegv ? &saved_segv : &saved_bus, nullptr);
}

static void install_fault_handler() {
    AltStack alt{alt_stack, 0, sizeof alt_stack};
    sys_sigaltstack(&alt, &saved_alt);
    SigAction sa{};
    sa.action = on_fault;
    sa.flags = kSaSigInfo | kSaOnStack | kSaNoDefer;
    sys_sigaction(kSigSegv, &sa, &saved_segv);
    sys_sigaction(kSigBus, &sa, &saved_bus);
}

static void restore_fault_handler() {
    sys_sigaction(kSigSegv, &saved_segv, nullptr);
    sys_sigaction(kSigBus, &saved_bus, nullptr);
    sys_sigaltstack(&saved_alt, nullptr);
}

__forceinline__ Thread& lane_thread(unsigned warp, unsigned lane) { return g.threads[warp * 32 + lane]; }

static void make_runnable(Thread* t) {
    t->state = kRunnable;
    g.next[g.n_next++] = t;
}

// The next thread to run, starting a new round (in a fresh shuffled order) when this
// one is done; nullptr when no thread can run.
static Thread* pick_next() {
    if (g.pos == g.n_run) {
        if (!g.n_next) return nullptr;
        Thread** r = g.next;
        g.next = g.run;
        g.run = r;
        g.n_run = g.n_next;
        g.n_next = g.pos = 0;
        unsigned long long s = g.seed ^ g.round++;
        for (unsigned i = g.n_run - 1; i > 0; i--) {
            unsigned j = (unsigned)(((splitmix(s) >> 32) * (i + 1)) >> 32);   // uniform in 0..i
            Thread* x = g.run[i]; g.run[i] = g.run[j]; g.run[j] = x;
        }
        if (g.n_run > 1 && g.run[0] == &g.threads[0]) {
            g.run[0] = g.run[g.n_run - 1];
            g.run[g.n_run - 1] = &g.threads[0];
        }
    }
    return g.run[g.pos++];
}

// Leaves fiber t (blocked or exited) straight for the next runnable fiber, or for the
// scheduler when none is left.
static void switch_from(Thread* t) {
    Thread* n = pick_next();
    if (n == t) return;             // released itself and is next: runs on
    g.cur = n;
    cuda_cpu_switch(&t->sp, n ? n->sp : g.sched_sp);
}

// until released
__forceinline__ void block_here(Thread* t) {
    __asm__ __volatile__("" ::: "memory");
    switch_from(t);
    __asm__ __volatile__("" ::: "memory");
}

static void release_barrier() {
    for (unsigned i = 0; i < g.n_threads; i++)
        if (g.threads[i].state == kAtBarrier) make_runnable(&g.threads[i]);
    for (unsigned w = 0; w < g.n_warps; w++) g.warps[w].at_barrier = 0;
    g.at_barrier = 0;
}

static bool same_file(const char* a, const char* b) { return a == b || __builtin_strcmp(a, b) == 0; }

static void syncthreads(const char* file, int line) {
    Thread* t = g.cur;
    Warp& w = g.warps[t->warp];
    const unsigned bit = 1u << t->lane;
    for (unsigned m = w.waiting; m; m &= m - 1) {
        const Thread& o = lane_thread(t->warp, __builtin_ctz(m));
        if (o.mask & bit)
            fail(t, "reached __syncthreads at %s:%d while lane %u of its warp waits for it in %s(mask 0x%08x) "
                 "at %s:%d (deadlock on a GPU)", file, line, o.lane, kOpName[o.op], o.mask, o.file, o.line);
    }
    if (g.at_barrier && (g.bar_line != line || !same_file(g.bar_file, file)))
        fail(t, "reached __syncthreads at %s:%d while other threads wait at __syncthreads at %s:%d "
             "(a barrier in code that not all threads execute)", file, line, g.bar_file, g.bar_line);
    g.bar_file = file;
    g.bar_line = line;
    t->state = kAtBarrier;
    t->file = file;
    t->line = line;
    w.at_barrier |= bit;
    if (++g.at_barrier == g.live) release_barrier();
    block_here(t);
}

static unsigned long long shuffle_result(const Thread& t, unsigned base) {
    const unsigned lane = t.lane, w = (unsigned)t.width;
    const unsigned seg = lane & ~(w - 1), seg_end = seg + w - 1;
    const int b = (int)((unsigned)t.arg & 31u);       // as PTX shfl.sync: the low 5 bits of b
    int src;
    switch (t.op) {
    case kShflIdx: src = (int)(seg | ((unsigned)b & (w - 1))); break;
    case kShflUp: src = (int)lane - b; if (src < (int)seg) return t.value; break;
    case kShflDown: src = (int)lane + b; if (src > (int)seg_end) return t.value; break;
    default: src = (int)lane ^ b; if (src > (int)seg_end) return t.value; break;
    }
    if (!((t.mask >> src) & 1u)) return ~0ull;        // a lane outside the mask: undefined
    return g.threads[base + src].value;
}

static void release_warp(unsigned warp, unsigned mask) {
    Warp& w = g.warps[warp];
    const Thread& first = lane_thread(warp, __builtin_ctz(mask));
    unsigned ballot = 0;
    if (first.op == kBallot || first.op == kAny || first.op == kAll)
        for (unsigned m = mask; m; m &= m - 1)
            if (lane_thread(warp, __builtin_ctz(m)).value) ballot |= 1u << __builtin_ctz(m);
    for (unsigned m = mask; m; m &= m - 1) {
        Thread& t = lane_thread(warp, __builtin_ctz(m));
        switch (t.op) {
        case kSyncwarp: t.result = 0; break;
        case kBallot: t.result = ballot; break;
        case kAny: t.result = ballot != 0; break;
        case kAll: t.result = ballot == mask; break;
        default: t.result = shuffle_result(t, warp * 32); break;
        }
        make_runnable(&t);
    }
    w.waiting &= ~mask;
}

static unsigned long long warp_op(Op op, unsigned mask, unsigned long long value, int arg, int width,
                                  const char* file, int line) {
    Thread* t = g.cur;
    Warp& w = g.warps[t->warp];
    const unsigned bit = 1u << t->lane;
    if (!(mask & bit))
        fail(t, "%s(mask 0x%08x) at %s:%d: the mask does not contain the calling lane %u",
             kOpName[op], mask, file, line, t->lane);
    if (width < 1 || width > 32 || (width & (width - 1)))
        fail(t, "%s at %s:%d: width %d is not a power of two in 1..32", kOpName[op], file, line, width);
    if (mask & w.exited)
        fail(t, "%s(mask 0x%08x) at %s:%d: lanes 0x%08x of the mask have exited or lie past the end of "
             "the block", kOpName[op], mask, file, line, mask & w.exited);
    if (mask & w.at_barrier) {
        const Thread& o = lane_thread(t->warp, __builtin_ctz(mask & w.at_barrier));
        fail(t, "%s(mask 0x%08x) at %s:%d: lane %u of the mask waits at __syncthreads at %s:%d (deadlock "
             "on a GPU)", kOpName[op], mask, file, line, o.lane, o.file, o.line);
    }
    const bool same = w.op == op && w.mask == mask && w.width == width;
    if (!w.waiting) {
        w.uniform = true;
        w.op = op;
        w.mask = mask;
        w.width = width;
    } else if (!w.uniform || !same) {
        for (unsigned m = w.waiting; m; m &= m - 1) {
            const Thread& o = lane_thread(t->warp, __builtin_ctz(m));
            if (((mask >> o.lane) & 1u) || (o.mask & bit))
                if (o.op != op || o.mask != mask || o.width != width)
                    fail(t, "%s(mask 0x%08x, width %d) at %s:%d while lane %u waits in %s(mask 0x%08x, "
                         "width %d) at %s:%d", kOpName[op], mask, width, file, line, o.lane, kOpName[o.op],
                         o.mask, o.width, o.file, o.line);
        }
        w.uniform = w.uniform && same;
    }
    t->state = kAtWarpOp;
    t->op = op;
    t->mask = mask;
    t->width = width;
    t->arg = arg;
    t->value = value;
    t->file = file;
    t->line = line;
    w.waiting |= bit;
    if ((w.waiting & mask) == mask) release_warp(t->warp, mask);
    block_here(t);
    return t->result;
}

static void thread_exit(Thread* t) {
    Warp& w = g.warps[t->warp];
    const unsigned bit = 1u << t->lane;
    t->state = kExited;
    w.exited |= bit;
    g.live--;
    for (unsigned m = w.waiting; m; m &= m - 1) {
        Thread& o = lane_thread(t->warp, __builtin_ctz(m));
        if (o.mask & bit)
            fail(&o, "waits in %s(mask 0x%08x) at %s:%d but lane %u of the mask has exited",
                 kOpName[o.op], o.mask, o.file, o.line, t->lane);
    }
    if (g.live && g.at_barrier == g.live) release_barrier();
}

[[noreturn]] static void fiber_main() {
    g.kernel->body(g.args);
    Thread* t = g.cur;
    thread_exit(t);
    switch_from(t);
    __builtin_trap();
}

// a fresh frame whose first switch "returns" into fiber_main
static void start_fiber(Thread* t, unsigned char* stack_top) {
    void** sp = (void**)((unsigned long long)stack_top & ~15ull);
    *--sp = nullptr;                    // fiber_main's return address: ends backtraces
    *--sp = (void*)&fiber_main;         // popped by `ret`, leaving rsp = 8 mod 16 as after a call
    for (int i = 0; i < 6; i++) *--sp = nullptr;   // rbp rbx r12 r13 r14 r15
    t->sp = sp;
}

static void describe_deadlock() {
    const Thread* stuck = nullptr;
    unsigned n_bar = 0, n_warp = 0, n_exit = 0;
    for (unsigned i = 0; i < g.n_threads; i++) {
        const Thread& t = g.threads[i];
        n_bar += t.state == kAtBarrier;
        n_exit += t.state == kExited;
        if (t.state == kAtWarpOp && !n_warp++) stuck = &t;
    }
    if (stuck)
        report(stuck, "deadlock: waits in %s(mask 0x%08x) at %s:%d; %u threads wait in warp operations, "
               "%u at __syncthreads, %u exited", kOpName[stuck->op], stuck->mask, stuck->file, stuck->line,
               n_warp, n_bar, n_exit);
    else
        report(nullptr, "block (%u,%u,%u): deadlock: %u threads wait at __syncthreads, %u exited",
               g.block_idx.x, g.block_idx.y, g.block_idx.z, n_bar, n_exit);
}

static bool run_block(unsigned char* stacks, unsigned long long stride) {
    const unsigned bx = g.block.x, by = g.block.y;
    for (unsigned i = 0; i < g.n_threads; i++) {
        Thread& t = g.threads[i];
        t.idx = {i % bx, (i / bx) % by, i / (bx * by)};
        t.lane = i % 32;
        t.warp = i / 32;
        t.state = kRunnable;
        t.mask = 0;
        start_fiber(&t, stacks + (unsigned long long)(i + 1) * stride);
        g.queue_a[i] = &t;
    }
    for (unsigned w = 0; w < g.n_warps; w++) g.warps[w] = Warp{};
    if (g.n_threads % 32) g.warps[g.n_warps - 1].exited = ~0u << (g.n_threads % 32);
    g.live = g.n_threads;
    g.at_barrier = 0;
    __builtin_memset(__start_cuda_cpu_shared, 0xFF, __stop_cuda_cpu_shared - __start_cuda_cpu_shared);
    __builtin_memset(dyn_smem, 0xFF, sizeof dyn_smem);
    for (int i = 0; i < g.n_extra_shared; i++)
        __builtin_memset(__start_cuda_cpu_shared + g.extra_shared[2 * i], 0xFF,
                         (unsigned long)g.extra_shared[2 * i + 1]);

    g.seed = name_hash(g.kernel->name) ^ (0x9E3779B97F4A7C15ull * (g.block_linear + 1));
    g.next = g.queue_a;
    g.n_next = g.n_threads;
    g.run = g.queue_b;
    g.n_run = g.pos = g.round = 0;
    // the fibers pass control among themselves and come back here when none can run
    g.cur = pick_next();
    cuda_cpu_switch(&g.sched_sp, g.cur->sp);
    if (g.failed) return false;
    if (g.live) {
        describe_deadlock();
        return false;
    }
    return true;
}

// Runs kernel `k` over the grid. stacks: 1024 stacks of `stride` bytes each (thread i
// uses the one that ends at stacks + (i+1)*stride); extra_shared: n_extra (offset, bytes)
// pairs of static shared memory outside the section; guards, guard_names, n_guards: the
// memcheck guard pages around the array arguments (see on_fault; n_guards 0: memcheck
// off). Returns 0, or 1 with a one-line message in err.
static int launch(const KernelEntry& k, const unsigned* grid, const unsigned* block,
                  unsigned long long dyn_smem_bytes, unsigned long long static_smem_bytes,
                  const long long* extra_shared, int n_extra, unsigned char* stacks,
                  unsigned long long stride, void** args, const unsigned long long* guards,
                  const char* const* guard_names, int n_guards, char* err, int err_len) {
    g.kernel = &k;
    g.guards = guards;
    g.guard_names = guard_names;
    g.n_guards = n_guards;
    g.extra_shared = extra_shared;
    g.n_extra_shared = n_extra;
    g.failed = false;
    g.error[0] = 0;
    g.args = args;
    g.grid = dim3(grid[0], grid[1], grid[2]);
    g.block = dim3(block[0], block[1], block[2]);
    g.block_idx = {0, 0, 0};
    const unsigned long long n_threads = (unsigned long long)block[0] * block[1] * block[2];
    if (!block[0] || !block[1] || !block[2] || block[0] > 1024 || block[1] > 1024 || block[2] > 64 ||
        n_threads > kMaxThreads)
        report(nullptr, "launch: block (%u,%u,%u) = %llu threads; CUDA allows 1..1024 threads per block "
               "(x, y <= 1024, z <= 64)", block[0], block[1], block[2], n_threads);
    else if (!grid[0] || !grid[1] || !grid[2] || grid[0] > 0x7FFFFFFFu || grid[1] > 65535 || grid[2] > 65535)
        report(nullptr, "launch: grid (%u,%u,%u); CUDA allows x in 1..2^31-1, y and z in 1..65535",
               grid[0], grid[1], grid[2]);
    else if (static_smem_bytes + dyn_smem_bytes > kMaxSharedBytes)
        report(nullptr, "launch: %llu bytes of static + %llu bytes of dynamic shared memory = %llu > %llu",
               static_smem_bytes, dyn_smem_bytes, static_smem_bytes + dyn_smem_bytes, kMaxSharedBytes);
    if (!g.failed) {
        if (n_guards > 0) install_fault_handler();
        g.n_threads = (unsigned)n_threads;
        g.n_warps = (g.n_threads + 31) / 32;
        g.block_linear = 0;
        for (unsigned z = 0; z < grid[2] && !g.failed; z++)
            for (unsigned y = 0; y < grid[1] && !g.failed; y++)
                for (unsigned x = 0; x < grid[0] && !g.failed; x++, g.block_linear++) {
                    g.block_idx = {x, y, z};
                    run_block(stacks, stride);
                }
        if (n_guards > 0) restore_fault_handler();
    }
    g.cur = nullptr;
    g.n_guards = 0;
    if (!g.failed) return 0;
    if (err_len > 0) __builtin_snprintf(err, (unsigned long)err_len, "%s", g.error);
    return 1;
}

// A kernel argument: converts to the parameter's type by reading the value it points to.
struct Arg {
    void* p;
    template <class T> operator T() const { return *static_cast<T*>(p); }
};

}  // namespace cuda_cpu

#define threadIdx (static_cast<const uint3&>(::cuda_cpu::cur()->idx))
#define blockIdx (static_cast<const uint3&>(::cuda_cpu::g.block_idx))
#define blockDim (static_cast<const dim3&>(::cuda_cpu::g.block))
#define gridDim (static_cast<const dim3&>(::cuda_cpu::g.grid))

// ---------------------------------------------------------------- warp and block built-ins
__forceinline__ void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    ::cuda_cpu::syncthreads(file, line);
}
__forceinline__ void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(),
                                int line = __builtin_LINE()) {
    ::cuda_cpu::warp_op(::cuda_cpu::kSyncwarp, mask, 0, 0, 32, file, line);
}
__forceinline__ unsigned __ballot_sync(unsigned mask, int pred, const char* file = __builtin_FILE(),
                                       int line = __builtin_LINE()) {
    return (unsigned)::cuda_cpu::warp_op(::cuda_cpu::kBallot, mask, pred != 0, 0, 32, file, line);
}
__forceinline__ int __any_sync(unsigned mask, int pred, const char* file = __builtin_FILE(),
                               int line = __builtin_LINE()) {
    return (int)::cuda_cpu::warp_op(::cuda_cpu::kAny, mask, pred != 0, 0, 32, file, line);
}
__forceinline__ int __all_sync(unsigned mask, int pred, const char* file = __builtin_FILE(),
                               int line = __builtin_LINE()) {
    return (int)::cuda_cpu::warp_op(::cuda_cpu::kAll, mask, pred != 0, 0, 32, file, line);
}

// the shuffles, overloaded for the types CUDA overloads them for
#define CUDA_CPU_SHFL(NAME, OP, ARG_T, T)                                                          \
    __forceinline__ T NAME(unsigned mask, T var, ARG_T arg, int width = warpSize,                  \
                           const char* file = __builtin_FILE(), int line = __builtin_LINE()) {     \
        unsigned long long bits = 0;                                                               \
        __builtin_memcpy(&bits, &var, sizeof(T));                                                  \
        bits = ::cuda_cpu::warp_op(::cuda_cpu::OP, mask, bits, (int)arg, width, file, line);       \
        T out;                                                                                     \
        __builtin_memcpy(&out, &bits, sizeof(T));                                                  \
        return out;                                                                                \
    }
#define CUDA_CPU_SHFL_ALL(T)                                  \
    CUDA_CPU_SHFL(__shfl_sync, kShflIdx, int, T)              \
    CUDA_CPU_SHFL(__shfl_up_sync, kShflUp, unsigned, T)       \
    CUDA_CPU_SHFL(__shfl_down_sync, kShflDown, unsigned, T)   \
    CUDA_CPU_SHFL(__shfl_xor_sync, kShflXor, int, T)
CUDA_CPU_SHFL_ALL(int)
CUDA_CPU_SHFL_ALL(unsigned)
CUDA_CPU_SHFL_ALL(long)
CUDA_CPU_SHFL_ALL(unsigned long)
CUDA_CPU_SHFL_ALL(long long)
CUDA_CPU_SHFL_ALL(unsigned long long)
CUDA_CPU_SHFL_ALL(float)
CUDA_CPU_SHFL_ALL(double)
#undef CUDA_CPU_SHFL_ALL
#undef CUDA_CPU_SHFL

#endif  // CUDA_CPU_PARSE_ONLY
