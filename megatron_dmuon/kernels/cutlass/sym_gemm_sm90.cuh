// Symmetric-output GEMM for Hopper (sm90a) built from CUTLASS 3.x collectives.
//
//   D[l] = alpha * A[l] @ B[l] + beta * C[l] + diag * I       (D[l] symmetric, m x m)
//
// A: [L, m, k] K-contiguous (row-major); B: [L, k, m] K-contiguous (a transposed view, e.g.
// B = Xᵀ, or a symmetric matrix read by rows); C, D: [L, m, m] row-major. fp16/bf16 operands,
// fp32 accumulation and epilogue, one rounding to the output type.
//
// Only output tiles that hold an element on or above the diagonal are computed: the tile
// scheduler below (SymUpperTileScheduler) walks the upper staircase of (cluster) tiles instead
// of the full grid. The epilogue is a CUTLASS EVT: beta*C + (alpha*acc + diag*[row == col]).
// The strictly lower triangle is a copy of the upper one, so the result is exactly symmetric:
// either a separate mirror pass (sym_mirror.cu) fills it, or (fused_mirror) the epilogue
// of each tile wholly above the diagonal also stores its transpose and a band kernel mirrors
// the tiles that touch the diagonal.
#pragma once

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

namespace dmuon {
struct SymUpperScheduler {};  // tile-scheduler tag: upper staircase of output tiles only
}  // namespace dmuon

namespace cutlass::gemm::kernel::detail {

// Persistent scheduler over the output tiles (i, j) with at least one element on or above the
// diagonal. Work unit w of a batch is a cluster tile: cluster row I (tile rows CM*I ..
// CM*I+CM-1), tile column s(I) + p with s(I) = floor(CM*I*BM / BN). Rows are walked in order;
// with at most a few dozen cluster rows the per-tile search is negligible next to the K loop.
template <class TileShape, class ClusterShape>
class SymUpperTileScheduler : public PersistentTileSchedulerSm90 {
  using Base = PersistentTileSchedulerSm90;
  static constexpr int BM = cute::size<0>(TileShape{});
  static constexpr int BN = cute::size<1>(TileShape{});
  static constexpr int CM = cute::size<0>(ClusterShape{});
  static_assert(cute::size<1>(ClusterShape{}) == 1, "SymUpperTileScheduler: cluster must be CM x 1");

  uint64_t idx_ = 0;
  uint64_t total_ = 0;

 public:
  using Params = Base::Params;
  using Arguments = Base::Arguments;
  using WorkTileInfo = Base::WorkTileInfo;

  // Fake "problem blocks" seen by the stock Params: (CM * units, 1, L), raster along M.
  template <class ProblemShapeMNKL>
  static dim3 sym_blocks(ProblemShapeMNKL const& shape) {
    int m = int(cute::get<0>(shape));
    int l = int(cute::size(cute::get<3>(shape)));
    int tiles_m = (m + BM - 1) / BM, tiles_n = (m + BN - 1) / BN;
    int rows = (tiles_m + CM - 1) / CM;
    uint32_t units = 0;
    for (int i = 0; i < rows; ++i) units += tiles_n - (CM * i * BM) / BN;
    return dim3(CM * units, 1, l);
  }

  template <class ProblemShapeMNKL, class TileShape_, class ClusterShape_>
  static Params to_underlying_arguments(ProblemShapeMNKL problem_shape_mnkl, TileShape_, ClusterShape_ cluster_shape,
                                        KernelHardwareInfo const& hw_info, Arguments const&, void* = nullptr,
                                        const uint32_t = 1, uint32_t = 1u) {
    Params params;
    params.initialize(sym_blocks(problem_shape_mnkl), to_gemm_coord(cluster_shape), hw_info, 1,
                      RasterOrderOptions::AlongM);
    int m = int(cute::get<0>(problem_shape_mnkl));
    params.problem_tiles_m_ = ((m + BM - 1) / BM + CM - 1) / CM;  // cluster rows
    params.problem_tiles_n_ = (m + BN - 1) / BN;                  // tile columns
    return params;
  }

  template <class ProblemShapeMNK, class BlockShape, class ClusterShape_>
  static dim3 get_grid_shape(Params const&, ProblemShapeMNK problem_shape_mnk, BlockShape, ClusterShape_ cluster_shape,
                             KernelHardwareInfo hw_info, Arguments = Arguments{}, bool = true) {
    auto shape_mnkl = cute::append<4>(problem_shape_mnk, cute::Int<1>{});
    return Params::get_grid_shape(sym_blocks(shape_mnkl), to_gemm_coord(cluster_shape), hw_info, 1,
                                  RasterOrderOptions::AlongM, true);
  }

  CUTLASS_HOST_DEVICE SymUpperTileScheduler() {}

  CUTLASS_DEVICE explicit SymUpperTileScheduler(Params const& params) : Base(params) {
#if defined(__CUDA_ARCH__)
    idx_ = uint64_t(blockIdx.x) * uint64_t(gridDim.y) + uint64_t(blockIdx.y);
    total_ = uint64_t(gridDim.x) * uint64_t(gridDim.y) * uint64_t(gridDim.z);
#endif
  }

  CUTLASS_DEVICE WorkTileInfo get_current_work_for_linear_idx(uint64_t linear_idx) const {
    Params const& p = scheduler_params;
    if (linear_idx >= p.blocks_per_problem_) return WorkTileInfo::invalid_work_tile();
    uint64_t l, rem, unit, cta;
    p.divmod_batch_(l, rem, linear_idx);
    p.divmod_cluster_shape_major_(unit, cta, rem);
    int w = int(unit);
    int tiles_n = int(p.problem_tiles_n_);
    int rows = int(p.problem_tiles_m_);
    for (int i = 0; i < rows; ++i) {
      int start = (CM * i * BM) / BN;
      int count = tiles_n - start;
      if (w < count) {
        return {CM * i + int(cta), start + w, int(l), true};
      }
      w -= count;
    }
    return WorkTileInfo::invalid_work_tile();
  }

  template <class ClusterShape_>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape_) { return get_current_work(); }

  CUTLASS_DEVICE WorkTileInfo get_current_work() const { return get_current_work_for_linear_idx(idx_); }

  CUTLASS_DEVICE void advance_to_next_work(uint32_t advance_count = 1) { idx_ += total_ * uint64_t(advance_count); }

  CUTLASS_DEVICE bool is_last_tile(WorkTileInfo&, uint32_t advance_count = 1) const {
    return not get_current_work_for_linear_idx(idx_ + total_ * uint64_t(advance_count)).is_valid();
  }

  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo) {
    advance_to_next_work();
    return cute::make_tuple(get_current_work(), true);
  }

  template <class Pipeline_, class PipelineState_>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work_tile_info, Pipeline_&, PipelineState_) {
    return fetch_next_work(work_tile_info);
  }
};

template <class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<dmuon::SymUpperScheduler, arch::Sm90, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler = SymUpperTileScheduler<TileShape, ClusterShape>;
};

}  // namespace cutlass::gemm::kernel::detail

namespace dmuon {

using namespace cute;

// EVT leaf: diag where the global row equals the global column, else 0 (fp32).
struct Sm90DiagScalar {
  struct SharedStorage {};
  struct Arguments {
    float diag = 0.f;
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  CUTLASS_HOST_DEVICE Sm90DiagScalar() {}
  CUTLASS_HOST_DEVICE Sm90DiagScalar(Params const& params, SharedStorage const&) : diag(params.diag) {}

  float diag = 0.f;

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::detail::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::detail::EmptyProducerLoadCallbacks{};
  }

  template <class CTensor>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::detail::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CTensor tCcD, int offset, float diag)
        : tCcD(tCcD), offset(offset), diag(diag) {}
    CTensor tCcD;  // (CPY,CPY_M,CPY_N,EPI_M,EPI_N) coordinates relative to this thread's first element
    int offset;    // that element's global row minus its global column
    float diag;

    template <typename ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<float, FragmentSize> visit(cutlass::Array<ElementAccumulator, FragmentSize> const&,
                                                             int epi_v, int epi_m, int epi_n) {
      cutlass::Array<float, FragmentSize> out;
      Tensor coords = tCcD(_, _, _, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        auto crd = coords(epi_v * FragmentSize + i);
        out[i] = (int(get<0>(crd)) + offset == int(get<1>(crd))) ? diag : 0.f;
      }
      return out;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(
      cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    // tCcD holds coordinates relative to the thread's first element, whose global coordinates
    // are (M, N) - residue_tCcD (see sm90_epilogue_tma_warpspecialized.hpp).
    int m = int(get<0>(args.problem_shape_mnkl)), n = int(get<1>(args.problem_shape_mnkl));
    int offset = (m - int(get<0>(args.residue_tCcD))) - (n - int(get<1>(args.residue_tCcD)));
    return ConsumerStoreCallbacks<decltype(args.tCcD)>(args.tCcD, offset, diag);
  }
};

// EVT root: passes the output fragment through and, in tiles lying wholly above the diagonal,
// also stores each element at its mirror position D[l][col][row] (plain global stores from
// registers; those positions are written by no other tile). Tiles that touch the diagonal are
// mirrored afterwards by the band kernel of sym_mirror.cu.
template <class Element>
struct Sm90MirrorStore {
  struct SharedStorage {};
  struct Arguments {
    Element* ptr = nullptr;
    int64_t ld = 0;
    int64_t batch_stride = 0;
    int enabled = 0;
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  CUTLASS_HOST_DEVICE Sm90MirrorStore() {}
  CUTLASS_HOST_DEVICE Sm90MirrorStore(Params const& params, SharedStorage const&) : params(params) {}

  Params params;

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::detail::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::detail::EmptyProducerLoadCallbacks{};
  }

  template <class CTensor>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::detail::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CTensor tCcD, Element* base, int64_t ld, int row0, int col0, int m,
                                          bool active)
        : tCcD(tCcD), base(base), ld(ld), row0(row0), col0(col0), m(m), active(active) {}
    CTensor tCcD;
    Element* base;
    int64_t ld;
    int row0, col0, m;  // global coordinates of the thread's first element; rows = cols = m
    bool active;

    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementInput, FragmentSize> visit(
        cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n,
        cutlass::Array<ElementInput, FragmentSize> const& frg_input) {
      if (active) {
        Tensor coords = tCcD(_, _, _, epi_m, epi_n);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < FragmentSize; ++i) {
          auto crd = coords(epi_v * FragmentSize + i);
          int r = row0 + int(get<0>(crd)), c = col0 + int(get<1>(crd));
          if (r < m && c < m) base[int64_t(c) * ld + r] = static_cast<Element>(frg_input[i]);
        }
      }
      return frg_input;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(
      cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    auto [mc, nc, kc, lc] = args.tile_coord_mnkl;
    int bm = int(size<0>(args.tile_shape_mnk)), bn = int(size<1>(args.tile_shape_mnk));
    int row0 = int(mc) * bm, col0 = int(nc) * bn;
    bool active = params.enabled != 0 && row0 + bm <= col0;
    int m = int(get<0>(args.problem_shape_mnkl)), n = int(get<1>(args.problem_shape_mnkl));
    int thr_row0 = m - int(get<0>(args.residue_tCcD)), thr_col0 = n - int(get<1>(args.residue_tCcD));
    Element* base = params.ptr == nullptr ? nullptr : params.ptr + int64_t(lc) * params.batch_stride;
    return ConsumerStoreCallbacks<decltype(args.tCcD)>(args.tCcD, base, params.ld, thr_row0, thr_col0, m, active);
  }
};

template <class Element>
using SymFusion = cutlass::epilogue::fusion::Sm90EVT<Sm90MirrorStore<Element>, cutlass::epilogue::fusion::Sm90EVT<
    cutlass::epilogue::fusion::Sm90Compute<cutlass::homogeneous_multiply_add, Element, float,
                                           cutlass::FloatRoundStyle::round_to_nearest>,  // beta*C + (...)
    cutlass::epilogue::fusion::Sm90ScalarBroadcast<float>,                               // beta
    cutlass::epilogue::fusion::Sm90SrcFetch<Element>,                                    // C
    cutlass::epilogue::fusion::Sm90EVT<
        cutlass::epilogue::fusion::Sm90Compute<cutlass::homogeneous_multiply_add, float, float,
                                               cutlass::FloatRoundStyle::round_to_nearest>,  // alpha*acc + diag
        cutlass::epilogue::fusion::Sm90ScalarBroadcast<float>,                               // alpha
        cutlass::epilogue::fusion::Sm90AccFetch, Sm90DiagScalar>>>;

template <class Element, class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule>
struct SymGemm {
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;  // B[k, n] at n*ldb + k: K-contiguous
  using LayoutC = cutlass::layout::RowMajor;
  static constexpr int Align = 16 / sizeof(Element);

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, LayoutC, Align, Element, LayoutC, Align,
      EpilogueSchedule, SymFusion<Element>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, Align, Element, LayoutB, Align, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue,
                                                      SymUpperScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  using StrideC = typename Kernel::StrideC;
  using StrideD = typename Kernel::StrideD;

  static int run(void const* a, void const* b, void const* c, void* d, int batch, int m, int k, int64_t lda,
                 int64_t sa, int64_t ldb, int64_t sb, int64_t ldc, int64_t sc, int64_t ldd, int64_t sd, float alpha,
                 float beta, float diag, int fused_mirror, int sm_count, cudaStream_t stream) {
    StrideA stride_a = make_stride(lda, Int<1>{}, sa);
    StrideB stride_b = make_stride(ldb, Int<1>{}, sb);
    StrideC stride_c = make_stride(ldc, Int<1>{}, sc);
    StrideD stride_d = make_stride(ldd, Int<1>{}, sd);
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                  {m, m, k, batch},
                                  {static_cast<Element const*>(a), stride_a, static_cast<Element const*>(b), stride_b},
                                  {{}, static_cast<Element const*>(c), stride_c, static_cast<Element*>(d), stride_d}};
    auto& root = args.epilogue.thread;  // {tree, mirror}
    root.op_1 = {static_cast<Element*>(d), ldd, sd, fused_mirror};
    auto& fusion = root.op_0;  // {beta, C, inner, node}
    fusion.op_0.scalars[0] = beta;
    fusion.op_2.op_0.scalars[0] = alpha;  // inner: {alpha, acc, diag, node}
    fusion.op_2.op_2.diag = diag;
    args.hw_info.sm_count = sm_count;

    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 2;
    if (Gemm::get_workspace_size(args) != 0) return 3;
    if (gemm.initialize(args, nullptr, stream) != cutlass::Status::kSuccess) return 4;
    if (gemm.run(stream) != cutlass::Status::kSuccess) return 5;
    return 0;
  }
};

}  // namespace dmuon
