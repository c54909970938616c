// embed.cu — embedding row gather for M ≤ 8 token ids (exact copy; article Part 3.9 "1 row gather").
#include "common.cuh"
#include "pdl.cuh"

// table [V, H] bf16, ids [M] int32 → out [M, H] bf16; grid M, 256 threads. H·2 must be a multiple of 16.
// An id outside [0, V) writes a row of NaN (0x7FC0) so that the error shows downstream (the host checks ids).
extern "C" __global__ void __launch_bounds__(256)
embed_gather(const qmk_u16* __restrict__ table, const int* __restrict__ ids, int H, int V, qmk_u16* out) {
    qmk_pdl_enter();  // PDL: successor may be scheduled; wait for the predecessor (pdl.cuh)
    const int m = blockIdx.x, id = ids[m];
    uint4* dst = reinterpret_cast<uint4*>(out + (size_t)m * H);
    const int n16 = H / 8;
    if (id < 0 || id >= V) {
        for (int i = threadIdx.x; i < n16; i += 256) dst[i] = make_uint4(0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u);
        return;
    }
    const uint4* src = reinterpret_cast<const uint4*>(table + (size_t)id * H);
    for (int i = threadIdx.x; i < n16; i += 256) dst[i] = src[i];
}
