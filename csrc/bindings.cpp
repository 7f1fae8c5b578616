// Every torch.library schema of csrc/, in one file, with the checks at each entry (vLLM style).
//
//   moe::build_tables(Tensor ids, Tensor counts, int E, int C, int S)
//       -> (expert_offsets, block_expert, slots, row_token, pull_order, job_order)
//   moe::build_tables_out(Tensor ids, Tensor counts, int E, int C, Tensor(a!) expert_offsets, ...)
//       the same into caller-owned buffers (allocated once at capacity; nothing allocates per batch)
//
//   moe::gemm1_swiglu_sm90(Tensor a, Tensor w13, Tensor block_expert, Tensor? row_token, Tensor(a!) queue,
//                          Tensor(b!) out, int num_programs, int variant=0) -> ()
//       GEMM1 + SwiGLU over the gathered layout on the Hopper tile (csrc/gemm_sm90; variant: its
//       mainloop, a sm90::Gemm1Variant, service.kernels.cuda_tile.VARIANTS); registered only
//       when csrc/build.py compiled that tile (an sm_90 target: MOE_SM90_TILE)
//
// Tables as in docs/CONTRACTS.md (service.moe.tables.Tables), all int32. One launch, no host sync.
// The CUDA kernels live in csrc/schedule/ and csrc/gemm_sm90/ and know nothing of torch.

#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#ifndef MOE_SYNTAX_ONLY
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <climits>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

#include "check.h"
#include "gemm_sm90/gemm1_sm90.h"
#include "schedule/schedule_kernel.h"

namespace moe {
namespace {

using at::Tensor;

// A launch's device guard and current stream on t's device (a null stream in the syntax check).
struct LaunchContext {
#ifndef MOE_SYNTAX_ONLY
  explicit LaunchContext(const Tensor& t)
      : guard(t.device()), stream(c10::cuda::getCurrentCUDAStream(t.device().index()).stream()) {}
  const c10::cuda::CUDAGuard guard;
  void* const stream;
#else
  explicit LaunchContext(const Tensor&) {}
  void* const stream = nullptr;
#endif
};

void check_int32_cuda(const Tensor& t, const char* name, int64_t numel, const Tensor& like) {
  MOE_CHECK(t.defined(), "moe::build_tables: ", name, " is an undefined tensor");
  MOE_CHECK(t.is_cuda(), "moe::build_tables: ", name, " must be a CUDA tensor, got ", t.device());
  MOE_CHECK(t.device() == like.device(), "moe::build_tables: ", name, " is on ", t.device(), ", ids on ",
              like.device());
  MOE_CHECK(t.scalar_type() == at::kInt, "moe::build_tables: ", name, " must be int32, got ", t.scalar_type());
  MOE_CHECK(t.is_contiguous(), "moe::build_tables: ", name, " must be contiguous");
  MOE_CHECK(t.numel() == numel, "moe::build_tables: ", name, " must have ", numel, " elements, got ", t.numel());
}

// Every check on the inputs and the sizes, before anything is allocated, read or launched.
// Returns K. Plain integer arithmetic on metadata only: no data_ptr, no device access.
int64_t check_inputs(const Tensor& ids, const Tensor& counts, int64_t E, int64_t C, int64_t S) {
  MOE_CHECK(ids.defined() && counts.defined(), "moe::build_tables: ids and counts must be defined tensors");
  MOE_CHECK(ids.dim() == 2, "moe::build_tables: ids must be [R*C, K], got ", ids.dim(), " dims");
  MOE_CHECK(counts.dim() == 1, "moe::build_tables: counts must be [R], got ", counts.dim(), " dims");
  const int64_t R = counts.size(0), K = ids.size(1);
  MOE_CHECK(R >= 1 && C >= 1 && K >= 1, "moe::build_tables: R, C and K must be positive (R=", R, ", C=", C,
              ", K=", K, ")");
  MOE_CHECK(E >= 1 && E <= kMaxExperts, "moe::build_tables: E must be in [1, ", kMaxExperts, "], got ", E,
              " (one thread per expert key in one 1024-thread CTA)");
  // Bound R*C before multiplying by K so that nothing below can overflow.
  MOE_CHECK(R <= kMaxHits && C <= kMaxHits && R * C * K <= kMaxHits, "moe::build_tables: R*C*K = ", R, "*", C,
              "*", K, " hits exceeds ", kMaxHits, " (16-bit counters of the one-CTA kernel); use ",
              "service.moe.tables.build_tables");
  MOE_CHECK(ids.size(0) == R * C, "moe::build_tables: ids has ", ids.size(0), " rows, expected R*C = ", R * C);
  const int64_t need = (R * C * K + E * (kBlockRows - 1) + kBlockRows - 1) / kBlockRows * kBlockRows;
  MOE_CHECK(S > 0 && S % kBlockRows == 0, "moe::build_tables: S = ", S, " must be a positive multiple of BM = ",
              kBlockRows);
  MOE_CHECK(S >= need, "moe::build_tables: S = ", S, " rows cannot hold the worst case of ", need,
              " (R*C*K + E*(BM-1), rounded up to BM)");
  MOE_CHECK(S <= INT32_MAX, "moe::build_tables: S = ", S, " does not fit int32 row indices");
  check_int32_cuda(ids, "ids", R * C * K, ids);
  check_int32_cuda(counts, "counts", R, ids);
  return K;
}

void launch(const Tensor& ids, const Tensor& counts, int64_t E, int64_t C, int64_t S, Tensor& expert_offsets,
            Tensor& block_expert, Tensor& slots, Tensor& row_token, Tensor& pull_order, Tensor& job_order) {
  const int64_t R = counts.size(0), K = ids.size(1);
  const LaunchContext ctx(ids);
  const int err = build_tables_launch(ids.data_ptr<int32_t>(), counts.data_ptr<int32_t>(), static_cast<int>(R),
                                      static_cast<int>(C), static_cast<int>(K), static_cast<int>(E),
                                      static_cast<int>(S), expert_offsets.data_ptr<int32_t>(),
                                      block_expert.data_ptr<int32_t>(), slots.data_ptr<int32_t>(),
                                      row_token.data_ptr<int32_t>(), pull_order.data_ptr<int32_t>(),
                                      job_order.data_ptr<int32_t>(), ctx.stream);
  MOE_CHECK(err == 0, "moe::build_tables: launch failed: ", error_string(err));
}

void build_tables_out(const Tensor& ids, const Tensor& counts, int64_t E, int64_t C, Tensor& expert_offsets,
                      Tensor& block_expert, Tensor& slots, Tensor& row_token, Tensor& pull_order, Tensor& job_order) {
  MOE_CHECK(row_token.defined() && row_token.dim() == 1, "moe::build_tables: row_token must be a 1-d [S] tensor");
  const int64_t S = row_token.numel();  // S comes from the caller's buffer
  const int64_t K = check_inputs(ids, counts, E, C, S);
  const int64_t T = counts.size(0) * C;
  check_int32_cuda(expert_offsets, "expert_offsets", E + 1, ids);
  check_int32_cuda(block_expert, "block_expert", S / kBlockRows, ids);
  check_int32_cuda(slots, "slots", T * K, ids);
  check_int32_cuda(row_token, "row_token", S, ids);
  check_int32_cuda(pull_order, "pull_order", T, ids);
  check_int32_cuda(job_order, "job_order", T, ids);
  launch(ids, counts, E, C, S, expert_offsets, block_expert, slots, row_token, pull_order, job_order);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> build_tables(const Tensor& ids, const Tensor& counts,
                                                                        int64_t E, int64_t C, int64_t S) {
  const int64_t K = check_inputs(ids, counts, E, C, S);  // before allocating anything
  const auto opts = ids.options().dtype(at::kInt);
  const int64_t T = ids.size(0);
  Tensor expert_offsets = at::empty({E + 1}, opts), block_expert = at::empty({S / kBlockRows}, opts),
         slots = at::empty({T, K}, opts), row_token = at::empty({S}, opts), pull_order = at::empty({T}, opts),
         job_order = at::empty({T}, opts);
  launch(ids, counts, E, C, S, expert_offsets, block_expert, slots, row_token, pull_order, job_order);
  return {expert_offsets, block_expert, slots, row_token, pull_order, job_order};
}

void build_tables_out_op(const Tensor& ids, const Tensor& counts, int64_t E, int64_t C, Tensor expert_offsets,
                         Tensor block_expert, Tensor slots, Tensor row_token, Tensor pull_order, Tensor job_order) {
  build_tables_out(ids, counts, E, C, expert_offsets, block_expert, slots, row_token, pull_order, job_order);
}

#ifdef MOE_SM90_TILE
// ---- moe::gemm1_swiglu_sm90 -------------------------------------------------------------------

// `vectors`: the kernel reads it 16 bytes at a time (cp.async, TMA, its stores), so it must start
// 16-byte aligned; the tables it reads one int at a time need not (a slice of one is fine).
void check_tile_tensor(const Tensor& t, const char* name, const Tensor& like, c10::ScalarType type,
                       bool vectors = false) {
  MOE_CHECK(t.defined(), "moe::gemm1_swiglu_sm90: ", name, " is an undefined tensor");
  MOE_CHECK(t.device() == like.device(), "moe::gemm1_swiglu_sm90: ", name, " is on ", t.device(), ", a on ",
            like.device());
  MOE_CHECK(t.scalar_type() == type, "moe::gemm1_swiglu_sm90: ", name, " must be ", type, ", got ", t.scalar_type());
  MOE_CHECK(t.is_contiguous(), "moe::gemm1_swiglu_sm90: ", name, " must be contiguous");
  MOE_CHECK(!vectors || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "moe::gemm1_swiglu_sm90: ", name,
            " must start 16-byte aligned");
}

void gemm1_swiglu_sm90(const Tensor& a, const Tensor& w13, const Tensor& block_expert,
                       const std::optional<Tensor>& row_token, Tensor queue, Tensor out, int64_t num_programs,
                       int64_t variant) {
  MOE_CHECK(a.defined() && a.is_cuda(), "moe::gemm1_swiglu_sm90: a must be a CUDA tensor");
  MOE_CHECK(a.dim() == 2 && w13.dim() == 3 && out.dim() == 2,
            "moe::gemm1_swiglu_sm90: a [N, H], w13 [E, H, 2*Ir] and out [S, Ir] expected");
  const int64_t H = a.size(1), E = w13.size(0), Ir = w13.size(2) / 2, S = out.size(0);
  MOE_CHECK(w13.size(1) == H && w13.size(2) == 2 * Ir, "moe::gemm1_swiglu_sm90: w13 must be [E, ", H,
            ", 2*Ir], got [", w13.size(0), ", ", w13.size(1), ", ", w13.size(2), "]");
  MOE_CHECK(out.size(1) == Ir, "moe::gemm1_swiglu_sm90: out must be [S, ", Ir, "], got [", S, ", ", out.size(1), "]");
  const char* shape_error = sm90::gemm1_shape_error(H, Ir, E, S, a.size(0));
  MOE_CHECK(shape_error == nullptr, "moe::gemm1_swiglu_sm90: ", shape_error == nullptr ? "" : shape_error, " (H=", H,
            ", Ir=", Ir, ", E=", E, ", S=", S, ", N=", a.size(0), ")");
  check_tile_tensor(a, "a", a, at::kBFloat16, true);
  check_tile_tensor(w13, "w13", a, at::kBFloat16, true);
  check_tile_tensor(out, "out", a, at::kBFloat16, true);
  check_tile_tensor(block_expert, "block_expert", a, at::kInt);
  check_tile_tensor(queue, "queue", a, at::kInt);
  MOE_CHECK(block_expert.numel() == S / sm90::kTileRows, "moe::gemm1_swiglu_sm90: block_expert must have S/128 = ",
            S / sm90::kTileRows, " entries, got ", block_expert.numel());
  MOE_CHECK(queue.numel() == 2, "moe::gemm1_swiglu_sm90: queue must be the two int32 counters of a tile queue");
  if (row_token.has_value()) {
    check_tile_tensor(*row_token, "row_token", a, at::kInt);
    MOE_CHECK(row_token->numel() == S, "moe::gemm1_swiglu_sm90: row_token must have S = ", S, " entries, got ",
              row_token->numel());
  } else {
    MOE_CHECK(a.size(0) == S, "moe::gemm1_swiglu_sm90: without row_token a is the layout itself: [", S,
              ", H], got ", a.size(0), " rows");
  }
  const int64_t tiles = S / sm90::kTileRows * (Ir / sm90::kTileCols);
  MOE_CHECK(num_programs >= 1 && num_programs <= tiles, "moe::gemm1_swiglu_sm90: num_programs must be in [1, ",
            tiles, "], got ", num_programs);
  MOE_CHECK(variant >= 0 && variant < sm90::kVariants, "moe::gemm1_swiglu_sm90: variant must be in [0, ",
            sm90::kVariants, "), got ", variant);
  const LaunchContext ctx(a);
  sm90::Gemm1Args args{a.data_ptr(), w13.data_ptr(), out.data_ptr(), block_expert.data_ptr<int32_t>(),
                       row_token.has_value() ? row_token->data_ptr<int32_t>() : nullptr, queue.data_ptr<int32_t>(),
                       static_cast<int>(a.size(0)), static_cast<int>(S), static_cast<int>(H), static_cast<int>(Ir),
                       static_cast<int>(E), static_cast<int>(num_programs),
                       static_cast<int>(variant)};
  const int err = sm90::gemm1_launch(args, ctx.stream);
  MOE_CHECK(err == 0, "moe::gemm1_swiglu_sm90: launch failed: ", sm90::gemm1_error_string(err));
}
#endif  // MOE_SM90_TILE

}  // namespace
}  // namespace moe

TORCH_LIBRARY(moe, m) {
  m.def("build_tables(Tensor ids, Tensor counts, int E, int C, int S) -> (Tensor, Tensor, Tensor, Tensor, Tensor, "
        "Tensor)");
  m.def("build_tables_out(Tensor ids, Tensor counts, int E, int C, Tensor(a!) expert_offsets, "
        "Tensor(b!) block_expert, Tensor(c!) slots, Tensor(d!) row_token, Tensor(e!) pull_order, "
        "Tensor(f!) job_order) -> ()");
#ifdef MOE_SM90_TILE
  m.def("gemm1_swiglu_sm90(Tensor a, Tensor w13, Tensor block_expert, Tensor? row_token, Tensor(a!) queue, "
        "Tensor(b!) out, int num_programs, int variant=0) -> ()");
#endif
}

TORCH_LIBRARY_IMPL(moe, CUDA, m) {
  m.impl("build_tables", &moe::build_tables);
  m.impl("build_tables_out", &moe::build_tables_out_op);
#ifdef MOE_SM90_TILE
  m.impl("gemm1_swiglu_sm90", &moe::gemm1_swiglu_sm90);
#endif
}
