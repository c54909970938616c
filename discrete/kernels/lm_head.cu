// lm_head.cu — __global__ wrappers over lm_head.cuh: the fused projection (argmax-only or with top-k) and
// the merge. Grid of the projection: nblk = V / QMK_LMH_ROWS blocks; merge: M blocks.
#include "lm_head.cuh"
#include "pdl.cuh"

#define QMK_LMH_NBLK (QMK_VOCAB / QMK_LMH_ROWS)
static_assert(QMK_VOCAB % QMK_LMH_ROWS == 0, "vocabulary must be a multiple of the lm_head block rows");
static_assert(QMK_LMH_NBLK >= QMK_TOPK, "the top-k merge needs at least QMK_TOPK lm_head blocks");

// W [V, K] bf16, x [M, K] bf16 → best [M, nblk] keys; logits [M, V] bf16 only when non-null (debug).
extern "C" __global__ void __launch_bounds__(QMK_LMH_THREADS, QMK_LMH_MIN_BLOCKS)
lm_head_argmax(const qmk_u16* __restrict__ W, const qmk_u16* x, int M, int K, qmk_u64* best, qmk_u16* logits) {
    qmk_pdl_enter();  // PDL: successor may be scheduled; wait for the predecessor (pdl.cuh)
    qmk_lm_head_block<false>(W, x, M, K, QMK_VOCAB, blockIdx.x, QMK_LMH_NBLK, best, nullptr, logits);
}

// As lm_head_argmax, plus cand [M, nblk, QMK_TOPK] keys (each block's top-k, descending).
extern "C" __global__ void __launch_bounds__(QMK_LMH_THREADS, QMK_LMH_MIN_BLOCKS)
lm_head_topk(const qmk_u16* __restrict__ W, const qmk_u16* x, int M, int K, qmk_u64* best, qmk_u64* cand,
             qmk_u16* logits) {
    qmk_pdl_enter();  // PDL: successor may be scheduled; wait for the predecessor (pdl.cuh)
    qmk_lm_head_block<true>(W, x, M, K, QMK_VOCAB, blockIdx.x, QMK_LMH_NBLK, best, cand, logits);
}

// grid M: ids [M] int32 (argmax, lowest id on ties), vals [M] bf16 (its logit).
extern "C" __global__ void __launch_bounds__(QMK_LMH_MERGE_THREADS)
lm_head_merge_argmax(const qmk_u64* __restrict__ best, int* ids, qmk_u16* vals) {
    qmk_pdl_enter();  // PDL: successor may be scheduled; wait for the predecessor (pdl.cuh)
    qmk_lm_head_merge<false, qmk_next_pow2(QMK_LMH_NBLK)>(best, nullptr, QMK_LMH_NBLK, blockIdx.x, ids, vals, nullptr);
}

// grid M: as above plus cand_out [M, QMK_TOPK] keys, descending (logit desc, id asc).
extern "C" __global__ void __launch_bounds__(QMK_LMH_MERGE_THREADS)
lm_head_merge_topk(const qmk_u64* __restrict__ best, const qmk_u64* __restrict__ cand, int* ids, qmk_u16* vals,
                   qmk_u64* cand_out) {
    qmk_pdl_enter();  // PDL: successor may be scheduled; wait for the predecessor (pdl.cuh)
    qmk_lm_head_merge<true, qmk_next_pow2(QMK_LMH_NBLK)>(best, cand, QMK_LMH_NBLK, blockIdx.x, ids, vals, cand_out);
}
