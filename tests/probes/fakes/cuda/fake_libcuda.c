/* A fake libcuda.so.1: the launch and memory entry points with CUDA's ABI, doing nothing but
 * leaving a trace the compiler cannot optimise away. */
#include "fake_cuda.h"

volatile unsigned long long fake_cuda_sink;
static unsigned long long next_dptr = 0x700000000000ULL;

__attribute__((noinline)) CUresult cuLaunchKernel(
    CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
    unsigned int by, unsigned int bz, unsigned int shared, CUstream s, void **p, void **e)
{
    fake_cuda_sink += (unsigned long long)f + gx + gy + gz + bx + by + bz + shared
                      + (unsigned long long)s + (unsigned long long)p + (unsigned long long)e;
    return 0;
}

__attribute__((noinline)) CUresult cuLaunchKernel_ptsz(
    CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
    unsigned int by, unsigned int bz, unsigned int shared, CUstream s, void **p, void **e)
{
    fake_cuda_sink += (unsigned long long)f + gx + gy + gz + bx + by + bz + shared
                      + (unsigned long long)s + (unsigned long long)p + (unsigned long long)e + 1;
    return 0;
}

__attribute__((noinline)) CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f,
                                                    void **p, void **e)
{
    fake_cuda_sink += c->gridDimX + c->blockDimX + c->sharedMemBytes + (unsigned long long)f
                      + (unsigned long long)p + (unsigned long long)e + 2;
    return 0;
}

__attribute__((noinline)) CUresult cuGraphLaunch(CUgraphExec g, CUstream s)
{
    fake_cuda_sink += (unsigned long long)g + (unsigned long long)s + 3;
    return 0;
}

__attribute__((noinline)) CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    if (bytesize == 0)
        return 1; /* CUDA_ERROR_INVALID_VALUE: nothing allocated */
    *dptr = next_dptr;
    next_dptr += (bytesize + 0xfff) & ~0xfffULL;
    return 0;
}

__attribute__((noinline)) CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    fake_cuda_sink += dptr;
    return 0;
}
