// CUDA launch counting, compiled by BCC (see probes/ebpf/program.py for the -D flags).
//
// Steady state: every probed call bumps one (tgid, symbol) entry of `counts` in the kernel; user
// space reads the cumulative counters every drain interval and takes differences. No per-launch
// event ever crosses to user space: a uprobe already costs microseconds per call.
//
// Debug only (SAMPLE_RING > 0): the arguments of the last SAMPLE_RING launches are kept in a ring
// so that tests and operators can check argument decoding (grid/block/shared memory/stream).
//
// SYM_* ids, MAX_PROCS, MAX_LIVE_ALLOCS, SAMPLE_RING and FLEXPIPE_X86_64 arrive as -D flags
// from Python.
#include <uapi/linux/ptrace.h>
#include <linux/sched.h>

struct count_key {
    u32 tgid;
    u32 sym;
};

struct count_val {
    u64 calls;  // cumulative: user space computes per-interval deltas
    u64 bytes;  // cumulative bytes for cuMemAlloc_v2 / cuMemFree_v2, else 0
    char comm[TASK_COMM_LEN];
};

BPF_HASH(counts, struct count_key, struct count_val, MAX_PROCS);

static __always_inline void bump(u32 sym, u64 bytes)
{
    struct count_key key = {};
    key.tgid = bpf_get_current_pid_tgid() >> 32;
    key.sym = sym;
    struct count_val *val = counts.lookup(&key);
    if (!val) {
        struct count_val init = {};
        bpf_get_current_comm(&init.comm, sizeof(init.comm));
        // NOTE: insert is BPF_NOEXIST, so a thread racing us to the first launch keeps its entry
        // and both increments land on it.
        counts.insert(&key, &init);
        val = counts.lookup(&key);
        if (!val)
            return;  // map full: counted nowhere rather than corrupting another entry
    }
    __sync_fetch_and_add(&val->calls, 1);
    if (bytes)
        __sync_fetch_and_add(&val->bytes, bytes);
}

#if SAMPLE_RING > 0
struct launch_sample {
    u64 seq;  // 1-based; 0 marks an empty slot
    u32 tgid;
    u32 sym;
    u32 grid[3];
    u32 block[3];
    u32 shared_mem_bytes;
    u32 pad;
    u64 stream;
};

BPF_ARRAY(samples, struct launch_sample, SAMPLE_RING);
BPF_ARRAY(sample_head, u64, 1);

static __always_inline void record(u32 sym, u32 gx, u32 gy, u32 gz, u32 bx, u32 by, u32 bz,
                                   u32 shared, u64 stream)
{
    u32 zero = 0;
    u64 *head = sample_head.lookup(&zero);
    if (!head)
        return;
    // NOTE: not atomic across CPUs; this is a debug ring, and a lost or torn slot only costs a
    // sample, never a count.
    u64 seq = *head + 1;
    *head = seq;
    u32 slot = (seq - 1) % SAMPLE_RING;
    struct launch_sample *s = samples.lookup(&slot);
    if (!s)
        return;
    s->seq = seq;
    s->tgid = bpf_get_current_pid_tgid() >> 32;
    s->sym = sym;
    s->grid[0] = gx;
    s->grid[1] = gy;
    s->grid[2] = gz;
    s->block[0] = bx;
    s->block[1] = by;
    s->block[2] = bz;
    s->shared_mem_bytes = shared;
    s->stream = stream;
}
#else
#define record(...) do {} while (0)
#endif

// Arguments past the sixth sit on the stack. At a uprobe on a function's first instruction the
// return address is at sp, so the n-th stack argument (1-based) is at sp + 8n (x86-64 SysV).
static __always_inline u64 stack_arg(struct pt_regs *ctx, int n)
{
    u64 v = 0;
#if defined(FLEXPIPE_X86_64)
    bpf_probe_read_user(&v, sizeof(v), (void *)(PT_REGS_SP(ctx) + 8 * n));
#endif
    return v;
}

// CUresult cuLaunchKernel(CUfunction f, unsigned gridDimX, gridDimY, gridDimZ, blockDimX,
//     blockDimY, blockDimZ, unsigned sharedMemBytes, CUstream hStream, void **kernelParams,
//     void **extra) -- and the _ptsz variant with the same arguments.
static __always_inline void classic_launch(struct pt_regs *ctx, u32 sym)
{
    bump(sym, 0);
    record(sym, (u32)PT_REGS_PARM2(ctx), (u32)PT_REGS_PARM3(ctx), (u32)PT_REGS_PARM4(ctx),
           (u32)PT_REGS_PARM5(ctx), (u32)PT_REGS_PARM6(ctx), (u32)stack_arg(ctx, 1),
           (u32)stack_arg(ctx, 2), stack_arg(ctx, 3));
}

int on_cu_launch_kernel(struct pt_regs *ctx) { classic_launch(ctx, SYM_CU_LAUNCH_KERNEL); return 0; }
int on_cu_launch_kernel_ptsz(struct pt_regs *ctx) { classic_launch(ctx, SYM_CU_LAUNCH_KERNEL_PTSZ); return 0; }

// CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
//     void **extra); the config starts with grid xyz, block xyz, sharedMemBytes, then hStream.
struct launch_config {
    u32 grid[3];
    u32 block[3];
    u32 shared_mem_bytes;
    u32 pad;
    u64 stream;
};

static __always_inline void ex_launch(struct pt_regs *ctx, u32 sym)
{
    bump(sym, 0);
#if SAMPLE_RING > 0
    struct launch_config cfg = {};
    bpf_probe_read_user(&cfg, sizeof(cfg), (void *)PT_REGS_PARM1(ctx));
    record(sym, cfg.grid[0], cfg.grid[1], cfg.grid[2], cfg.block[0], cfg.block[1], cfg.block[2],
           cfg.shared_mem_bytes, cfg.stream);
#endif
}

int on_cu_launch_kernel_ex(struct pt_regs *ctx) { ex_launch(ctx, SYM_CU_LAUNCH_KERNEL_EX); return 0; }
int on_cu_launch_kernel_ex_ptsz(struct pt_regs *ctx) { ex_launch(ctx, SYM_CU_LAUNCH_KERNEL_EX_PTSZ); return 0; }

// cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim, void **args,
//     size_t sharedMem, cudaStream_t stream). A dim3 (12 bytes) travels in two registers: x|y<<32
// then z. So grid = rsi, rdx; block = rcx, r8; args = r9; sharedMem, stream on the stack.
static __always_inline void runtime_launch(struct pt_regs *ctx, u32 sym)
{
    bump(sym, 0);
    u64 grid_xy = PT_REGS_PARM2(ctx);
    u64 block_xy = PT_REGS_PARM4(ctx);
    record(sym, (u32)grid_xy, (u32)(grid_xy >> 32), (u32)PT_REGS_PARM3(ctx), (u32)block_xy,
           (u32)(block_xy >> 32), (u32)PT_REGS_PARM5(ctx), (u32)stack_arg(ctx, 1),
           stack_arg(ctx, 2));
}

int on_cuda_launch_kernel(struct pt_regs *ctx) { runtime_launch(ctx, SYM_CUDA_LAUNCH_KERNEL); return 0; }
int on_cuda_launch_kernel_ptsz(struct pt_regs *ctx) { runtime_launch(ctx, SYM_CUDA_LAUNCH_KERNEL_PTSZ); return 0; }

// CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream): one call replays a whole
// graph of kernels without any launch call of its own, so it is counted apart.
static __always_inline void graph_launch(struct pt_regs *ctx, u32 sym)
{
    bump(sym, 0);
    record(sym, 0, 0, 0, 0, 0, 0, 0, PT_REGS_PARM2(ctx));
}

int on_cu_graph_launch(struct pt_regs *ctx) { graph_launch(ctx, SYM_CU_GRAPH_LAUNCH); return 0; }
int on_cu_graph_launch_ptsz(struct pt_regs *ctx) { graph_launch(ctx, SYM_CU_GRAPH_LAUNCH_PTSZ); return 0; }

// CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize): the device pointer exists only on
// return, so the entry probe parks the arguments per thread and the return probe records the
// allocation; cuMemFree_v2(CUdeviceptr dptr) then finds its size.
struct alloc_args {
    u64 dptr_addr;
    u64 size;
};

struct live_key {
    u32 tgid;
    u32 pad;
    u64 dptr;
};

BPF_HASH(pending_allocs, u64, struct alloc_args, 10240);
// LRU: allocations of processes that die without freeing age out instead of filling the map.
BPF_TABLE("lru_hash", struct live_key, u64, live_allocs, MAX_LIVE_ALLOCS);

int on_cu_mem_alloc(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    struct alloc_args args = {};
    args.dptr_addr = PT_REGS_PARM1(ctx);
    args.size = PT_REGS_PARM2(ctx);
    pending_allocs.update(&id, &args);
    return 0;
}

int on_cu_mem_alloc_ret(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    struct alloc_args *args = pending_allocs.lookup(&id);
    if (!args)
        return 0;
    struct alloc_args a = *args;
    pending_allocs.delete(&id);
    if (PT_REGS_RC(ctx) != 0)
        return 0;  // CUDA_SUCCESS is 0; a failed allocation allocated nothing
    struct live_key key = {};
    key.tgid = id >> 32;
    bpf_probe_read_user(&key.dptr, sizeof(key.dptr), (void *)a.dptr_addr);
    live_allocs.update(&key, &a.size);
    bump(SYM_CU_MEM_ALLOC, a.size);
    return 0;
}

int on_cu_mem_free(struct pt_regs *ctx)
{
    struct live_key key = {};
    key.tgid = bpf_get_current_pid_tgid() >> 32;
    key.dptr = PT_REGS_PARM1(ctx);
    u64 *size = live_allocs.lookup(&key);
    u64 bytes = size ? *size : 0;  // unknown when allocated before the probe attached
    if (size)
        live_allocs.delete(&key);
    bump(SYM_CU_MEM_FREE, bytes);
    return 0;
}
