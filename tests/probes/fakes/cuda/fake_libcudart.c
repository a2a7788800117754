/* A fake libcudart: cudaLaunchKernel forwards to the driver's exported cuLaunchKernel, as the
 * real runtime does, so a runtime launch is seen by both probes. */
#include "fake_cuda.h"

__attribute__((noinline)) cudaError_t cudaLaunchKernel(const void *func, dim3 grid, dim3 block,
                                                       void **args, size_t sharedMem,
                                                       cudaStream_t stream)
{
    return cuLaunchKernel((CUfunction)func, grid.x, grid.y, grid.z, block.x, block.y, block.z,
                          (unsigned int)sharedMem, (CUstream)stream, args, 0);
}
