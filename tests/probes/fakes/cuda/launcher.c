/* Calls each fake CUDA entry point a known number of times with known arguments.
 *
 * Protocol on stdin/stdout: prints "ready <pid>", waits for a line, runs the calls, prints
 * "done", waits for another line and exits (so the process is alive when the probe drains).
 * Counts and arguments are fixed here and mirrored by tests/probes/test_ebpf_live.py. */
#include <stdio.h>
#include <unistd.h>
#include "fake_cuda.h"

#define PTR(v) ((void *)(unsigned long)(v))
#define N_LAUNCH 3
#define N_PTSZ 2
#define N_EX 4
#define N_RUNTIME 5
#define N_GRAPH 6

static void wait_line(void)
{
    char buf[64];
    if (!fgets(buf, sizeof buf, stdin))
        _exit(2);
}

int main(void)
{
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    wait_line();
    for (unsigned i = 0; i < N_LAUNCH; i++)
        cuLaunchKernel((CUfunction)0x10, 100 + i, 2, 3, 128, 4, 5 + i, 1024 * (i + 1),
                       (CUstream)PTR(0x5000 + i), 0, 0);
    for (unsigned i = 0; i < N_PTSZ; i++)
        cuLaunchKernel_ptsz((CUfunction)0x11, 200 + i, 1, 1, 64, 1, 1, 2048,
                            (CUstream)PTR(0x6000 + i), 0, 0);
    for (unsigned i = 0; i < N_EX; i++) {
        CUlaunchConfig cfg = {300 + i, 7, 8, 256, 2, 1, 4096 + i, (CUstream)PTR(0x7000 + i), 0, 0};
        cuLaunchKernelEx(&cfg, (CUfunction)0x12, 0, 0);
    }
    for (unsigned i = 0; i < N_RUNTIME; i++) {
        dim3 grid = {400 + i, 9, 10};
        dim3 block = {32, 16, 2};
        cudaLaunchKernel((const void *)0x13, grid, block, 0, 512 + i, (cudaStream_t)PTR(0x8000 + i));
    }
    for (unsigned i = 0; i < N_GRAPH; i++)
        cuGraphLaunch((CUgraphExec)0x14, (CUstream)PTR(0x9000 + i));
    CUdeviceptr a = 0, b = 0, c = 0;
    cuMemAlloc_v2(&a, 4096);
    cuMemAlloc_v2(&b, 1 << 20);
    cuMemAlloc_v2(&c, 0); /* fails: not counted */
    cuMemFree_v2(a);
    printf("done\n");
    fflush(stdout);
    wait_line();
    return 0;
}
