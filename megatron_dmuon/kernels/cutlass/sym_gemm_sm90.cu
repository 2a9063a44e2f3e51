// One GEMM instantiation per translation unit (compiled in parallel by cutlass_symmetric.py):
//   -DDMUON_CFG=<0..3> -DDMUON_BF16=<0|1>  defines  extern "C" dmuon_gemm_<cfg>_<f16|bf16>.
#include "sym_gemm_sm90.cuh"

#ifndef DMUON_CFG
#define DMUON_CFG 0
#endif
#ifndef DMUON_BF16
#define DMUON_BF16 0
#endif

namespace {
using namespace cute;
using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using CoopEpi = cutlass::epilogue::TmaWarpSpecializedCooperative;
using Ping = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using PingEpi = cutlass::epilogue::TmaWarpSpecialized;
#if DMUON_BF16
using Element = cutlass::bfloat16_t;
#define DMUON_SUFFIX bf16
#else
using Element = cutlass::half_t;
#define DMUON_SUFFIX f16
#endif

// Configs: tile (BM x BN x BK), cluster (CM x 1), kernel schedule.
#if DMUON_CFG == 0
using Cfg = dmuon::SymGemm<Element, Shape<_128, _128, _64>, Shape<_1, _1, _1>, Coop, CoopEpi>;
#elif DMUON_CFG == 1
using Cfg = dmuon::SymGemm<Element, Shape<_128, _128, _64>, Shape<_2, _1, _1>, Coop, CoopEpi>;
#elif DMUON_CFG == 2
using Cfg = dmuon::SymGemm<Element, Shape<_128, _256, _64>, Shape<_2, _1, _1>, Coop, CoopEpi>;
#elif DMUON_CFG == 3
using Cfg = dmuon::SymGemm<Element, Shape<_128, _128, _64>, Shape<_2, _1, _1>, Ping, PingEpi>;
#else
#error "unknown DMUON_CFG"
#endif
}  // namespace

#define DMUON_CAT2(a, b, c) a##b##_##c
#define DMUON_CAT(a, b, c) DMUON_CAT2(a, b, c)

extern "C" int DMUON_CAT(dmuon_gemm_, DMUON_CFG, DMUON_SUFFIX)(
    void const* a, void const* b, void const* c, void* d, int batch, int m, int k, int64_t lda, int64_t sa,
    int64_t ldb, int64_t sb, int64_t ldc, int64_t sc, int64_t ldd, int64_t sd, float alpha, float beta, float diag,
    int fused_mirror, int sm_count, cudaStream_t stream) {
  return Cfg::run(a, b, c, d, batch, m, k, lda, sa, ldb, sb, ldc, sc, ldd, sd, alpha, beta, diag, fused_mirror,
                  sm_count, stream);
}
