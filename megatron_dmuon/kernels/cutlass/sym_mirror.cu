// Mirror pass and the C entry point of the symmetric-product library.
//
// dmuon_sym_matmul(...) runs the upper-staircase GEMM of configuration `cfg` (sym_gemm_sm90.cu)
// and makes the strictly lower triangle a copy of the strictly upper one, so D[l] is exactly
// symmetric. mirror = 1: a separate pass copies the whole triangle; mirror = 2 (fused): the
// GEMM epilogue stores the transpose of every tile wholly above the diagonal and a band pass
// mirrors the 64x64 blocks whose source lies in a GEMM tile touching the diagonal; mirror = 0:
// upper tiles only. Returns 0, or a nonzero code; dmuon_last_error() says why.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#define DMUON_GEMM_DECL(name)                                                                                   \
  extern "C" int name(void const*, void const*, void const*, void*, int, int, int, int64_t, int64_t, int64_t,   \
                      int64_t, int64_t, int64_t, int64_t, int64_t, float, float, float, int, int, cudaStream_t);
DMUON_GEMM_DECL(dmuon_gemm_0_f16)
DMUON_GEMM_DECL(dmuon_gemm_0_bf16)
DMUON_GEMM_DECL(dmuon_gemm_1_f16)
DMUON_GEMM_DECL(dmuon_gemm_1_bf16)
DMUON_GEMM_DECL(dmuon_gemm_2_f16)
DMUON_GEMM_DECL(dmuon_gemm_2_bf16)
DMUON_GEMM_DECL(dmuon_gemm_3_f16)
DMUON_GEMM_DECL(dmuon_gemm_3_bf16)

typedef int (*GemmFn)(void const*, void const*, void const*, void*, int, int, int, int64_t, int64_t, int64_t, int64_t,
                      int64_t, int64_t, int64_t, int64_t, float, float, float, int, int, cudaStream_t);
static const GemmFn kGemms[][2] = {{dmuon_gemm_0_f16, dmuon_gemm_0_bf16},
                                   {dmuon_gemm_1_f16, dmuon_gemm_1_bf16},
                                   {dmuon_gemm_2_f16, dmuon_gemm_2_bf16},
                                   {dmuon_gemm_3_f16, dmuon_gemm_3_bf16}};
static const int kNumConfigs = sizeof(kGemms) / sizeof(kGemms[0]);
static const int kTileMN[][2] = {{128, 128}, {128, 128}, {128, 256}, {128, 128}};  // BM, BN per config

static thread_local char g_error[512] = "";

// 64x64 tile pairs below the diagonal: block (I, J), I >= J, copies D[J*64.., I*64..]ᵀ onto
// D[I*64.., J*64..] (only row > col elements are written). 64 threads per block, each moving one
// 8x8 sub-block: eight 16-byte row loads, a transpose in registers (byte permutes, no shared
// memory) and eight 16-byte row stores. A warp loads 4 rows x 128 contiguous bytes and stores
// 8 rows x 64 contiguous bytes per instruction. m must be a multiple of 8 (the GEMM requires it
// too), so every 8x8 sub-block lies wholly inside or wholly outside the matrix.
constexpr int MT = 64;
constexpr int MIRROR_THREADS = 64;
// Copies the transpose of upper block (j, i) onto block (i, j), i >= j (row > col elements only).
__device__ __forceinline__ void mirror_block(uint16_t* __restrict__ base, int m, int64_t ldd, int i, int j) {
  int sr = threadIdx.x / 8, sc = threadIdx.x % 8;  // this thread's 8x8 sub-block of the source
  if (i == j && sc < sr) return;                     // its source lies below the diagonal
  int src_r = j * MT + sr * 8, src_c = i * MT + sc * 8;
  if (src_r >= m || src_c >= m) return;
  uint32_t w[8][4];
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    uint4 v = *reinterpret_cast<uint4 const*>(base + int64_t(src_r + q) * ldd + src_c);
    w[q][0] = v.x, w[q][1] = v.y, w[q][2] = v.z, w[q][3] = v.w;
  }
  // destination row o (= source column src_c + o), 32-bit word p = source rows 2p, 2p+1
#pragma unroll
  for (int o = 0; o < 8; ++o) {
    uint32_t out[4];
    uint32_t sel = (o & 1) ? 0x7632u : 0x5410u;  // high or low halves of the two source words
#pragma unroll
    for (int p = 0; p < 4; ++p) out[p] = __byte_perm(w[2 * p][o / 2], w[2 * p + 1][o / 2], sel);
    uint16_t* dst = base + int64_t(src_c + o) * ldd + src_r;
    if (i == j && sc == sr) {  // a sub-block on the diagonal: only row > col
      const uint16_t* e = reinterpret_cast<const uint16_t*>(out);
#pragma unroll
      for (int q = 0; q < 8; ++q)
        if (q < o) dst[q] = e[q];
    } else {
      *reinterpret_cast<uint4*>(dst) = make_uint4(out[0], out[1], out[2], out[3]);
    }
  }
}

__global__ void __launch_bounds__(MIRROR_THREADS) mirror_kernel(uint16_t* __restrict__ d, int m, int64_t ldd, int64_t sd) {
  int t = blockIdx.x, i = 0;
  while (t >= i + 1) {  // blockIdx.x -> (i, j), 0 <= j <= i
    t -= i + 1;
    ++i;
  }
  mirror_block(d + int64_t(blockIdx.y) * sd, m, ldd, i, t);
}

// Band pass of the fused mirror: block (i, i - blockIdx.y) unless its source block lies in a
// GEMM tile (bm x bn) wholly above the diagonal (whose epilogue stored the transpose).
__global__ void __launch_bounds__(MIRROR_THREADS) band_mirror_kernel(uint16_t* __restrict__ d, int m, int64_t ldd, int64_t sd,
                                                          int bm, int bn) {
  int i = blockIdx.x, j = i - int(blockIdx.y);
  if (j < 0) return;
  int tm = j * MT / bm, tn = i * MT / bn;
  if ((tm + 1) * bm <= tn * bn) return;
  mirror_block(d + int64_t(blockIdx.z) * sd, m, ldd, i, j);
}

extern "C" const char* dmuon_last_error() { return g_error; }
extern "C" int dmuon_num_configs() { return kNumConfigs; }

extern "C" int dmuon_mirror(void* d, int batch, int m, int64_t ldd, int64_t sd, cudaStream_t stream) {
  int tiles = (m + MT - 1) / MT;
  dim3 grid(tiles * (tiles + 1) / 2, batch);
  mirror_kernel<<<grid, MIRROR_THREADS, 0, stream>>>(static_cast<uint16_t*>(d), m, ldd, sd);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    snprintf(g_error, sizeof(g_error), "mirror launch failed: %s", cudaGetErrorString(err));
    return 6;
  }
  return 0;
}

extern "C" int dmuon_sym_matmul(int cfg, int bf16, void const* a, void const* b, void const* c, void* d, int batch,
                                int m, int k, int64_t lda, int64_t sa, int64_t ldb, int64_t sb, int64_t ldc,
                                int64_t sc, int64_t ldd, int64_t sd, float alpha, float beta, float diag, int mirror,
                                int sm_count, void* stream) {
  if (cfg < 0 || cfg >= kNumConfigs) {
    snprintf(g_error, sizeof(g_error), "unknown config %d (have %d)", cfg, kNumConfigs);
    return 1;
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  int rc = kGemms[cfg][bf16 ? 1 : 0](a, b, c, d, batch, m, k, lda, sa, ldb, sb, ldc, sc, ldd, sd, alpha, beta, diag,
                                     mirror == 2, sm_count, s);
  if (rc != 0) {
    cudaError_t err = cudaGetLastError();
    snprintf(g_error, sizeof(g_error), "CUTLASS GEMM (config %d) failed with code %d (%s; 2 can_implement, "
             "3 workspace, 4 initialize, 5 run)", cfg, rc, cudaGetErrorString(err));
    return rc;
  }
  if (mirror == 2) {
    int tiles = (m + MT - 1) / MT;
    int bm = kTileMN[cfg][0], bn = kTileMN[cfg][1];
    dim3 grid(tiles, (bm + bn) / MT + 1, batch);
    band_mirror_kernel<<<grid, MIRROR_THREADS, 0, s>>>(static_cast<uint16_t*>(d), m, ldd, sd, bm, bn);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
      snprintf(g_error, sizeof(g_error), "band mirror launch failed: %s", cudaGetErrorString(err));
      return 6;
    }
    return 0;
  }
  return mirror ? dmuon_mirror(d, batch, m, ldd, sd, s) : 0;
}
