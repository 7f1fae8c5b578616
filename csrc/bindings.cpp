// Every torch.library schema of csrc/, in one file, with the checks at each entry (vLLM style).
//
//   moe::build_tables(Tensor ids, Tensor counts, int E, int C, int S)
//       -> (expert_offsets, block_expert, slots, row_token, pull_order, job_order, slack)
//   moe::build_tables_out(Tensor ids, Tensor counts, int E, int C, Tensor(a!) expert_offsets, ...)
//       the same into caller-owned buffers (allocated once at capacity; nothing allocates per batch)
//
// Tables as in docs/CONTRACTS.md (service.moe.tables.Tables), all int32. One launch, no host sync.
// The CUDA kernel lives in csrc/schedule/schedule_kernel.cu and knows nothing of torch.

#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#ifndef MOE_SYNTAX_ONLY
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <tuple>

#include "schedule/schedule_kernel.h"

namespace moe {
namespace {

using at::Tensor;

void check_int32_cuda(const Tensor& t, const char* name, int64_t numel, const Tensor& like) {
  TORCH_CHECK(t.is_cuda(), "moe::build_tables: ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.device() == like.device(), "moe::build_tables: ", name, " is on ", t.device(), ", ids on ",
              like.device());
  TORCH_CHECK(t.scalar_type() == at::kInt, "moe::build_tables: ", name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "moe::build_tables: ", name, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, "moe::build_tables: ", name, " must have ", numel, " elements, got ", t.numel());
}

void build_tables_out(const Tensor& ids, const Tensor& counts, int64_t E, int64_t C, Tensor& expert_offsets,
                      Tensor& block_expert, Tensor& slots, Tensor& row_token, Tensor& pull_order, Tensor& job_order,
                      Tensor& slack) {
  TORCH_CHECK(ids.dim() == 2, "moe::build_tables: ids must be [R*C, K], got ", ids.dim(), " dims");
  TORCH_CHECK(counts.dim() == 1, "moe::build_tables: counts must be [R]");
  const int64_t R = counts.size(0), K = ids.size(1);
  TORCH_CHECK(R >= 1 && C >= 1 && K >= 1, "moe::build_tables: R, C and K must be positive (R=", R, ", C=", C,
              ", K=", K, ")");
  TORCH_CHECK(ids.size(0) == R * C, "moe::build_tables: ids has ", ids.size(0), " rows, expected R*C = ", R * C);
  TORCH_CHECK(E >= 1 && E <= kMaxExperts, "moe::build_tables: E must be in [1, ", kMaxExperts, "], got ", E,
              " (one thread per expert key in one 1024-thread CTA)");
  TORCH_CHECK(R * C * K <= kMaxHits, "moe::build_tables: R*C*K = ", R * C * K, " hits exceeds ", kMaxHits,
              " (one-CTA latency bound); use service.moe.tables.build_tables");
  const int64_t S = row_token.numel();
  const int64_t need = (R * C * K + E * (kBlockRows - 1) + kBlockRows - 1) / kBlockRows * kBlockRows;
  TORCH_CHECK(S % kBlockRows == 0, "moe::build_tables: S = ", S, " must be a multiple of BM = ", kBlockRows);
  TORCH_CHECK(S >= need, "moe::build_tables: S = ", S, " rows cannot hold the worst case of ", need,
              " (R*C*K + E*(BM-1), rounded up to BM)");
  check_int32_cuda(ids, "ids", R * C * K, ids);
  check_int32_cuda(counts, "counts", R, ids);
  check_int32_cuda(expert_offsets, "expert_offsets", E + 1, ids);
  check_int32_cuda(block_expert, "block_expert", S / kBlockRows, ids);
  check_int32_cuda(slots, "slots", R * C * K, ids);
  check_int32_cuda(row_token, "row_token", S, ids);
  check_int32_cuda(pull_order, "pull_order", R * C, ids);
  check_int32_cuda(job_order, "job_order", R * C, ids);
  check_int32_cuda(slack, "slack", S / kBlockRows, ids);
#ifndef MOE_SYNTAX_ONLY
  const c10::cuda::CUDAGuard guard(ids.device());
  void* stream = c10::cuda::getCurrentCUDAStream(ids.device().index()).stream();
#else
  void* stream = nullptr;
#endif
  const int err = build_tables_launch(ids.data_ptr<int32_t>(), counts.data_ptr<int32_t>(), static_cast<int>(R),
                                      static_cast<int>(C), static_cast<int>(K), static_cast<int>(E),
                                      static_cast<int>(S), expert_offsets.data_ptr<int32_t>(),
                                      block_expert.data_ptr<int32_t>(), slots.data_ptr<int32_t>(),
                                      row_token.data_ptr<int32_t>(), pull_order.data_ptr<int32_t>(),
                                      job_order.data_ptr<int32_t>(), slack.data_ptr<int32_t>(), stream);
  TORCH_CHECK(err == 0, "moe::build_tables: launch failed: ", error_string(err));
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> build_tables(const Tensor& ids,
                                                                                const Tensor& counts, int64_t E,
                                                                                int64_t C, int64_t S) {
  TORCH_CHECK(ids.dim() == 2 && counts.dim() == 1, "moe::build_tables: ids must be [R*C, K] and counts [R]");
  TORCH_CHECK(S >= kBlockRows && S % kBlockRows == 0, "moe::build_tables: S = ", S, " must be a positive multiple of ",
              kBlockRows);
  const auto opts = ids.options().dtype(at::kInt);
  const int64_t T = ids.size(0), K = ids.size(1);
  Tensor expert_offsets = at::empty({E + 1}, opts), block_expert = at::empty({S / kBlockRows}, opts),
         slots = at::empty({T, K}, opts), row_token = at::empty({S}, opts), pull_order = at::empty({T}, opts),
         job_order = at::empty({T}, opts), slack = at::empty({S / kBlockRows}, opts);
  build_tables_out(ids, counts, E, C, expert_offsets, block_expert, slots, row_token, pull_order, job_order, slack);
  return {expert_offsets, block_expert, slots, row_token, pull_order, job_order, slack};
}

void build_tables_out_op(const Tensor& ids, const Tensor& counts, int64_t E, int64_t C, Tensor expert_offsets,
                         Tensor block_expert, Tensor slots, Tensor row_token, Tensor pull_order, Tensor job_order,
                         Tensor slack) {
  build_tables_out(ids, counts, E, C, expert_offsets, block_expert, slots, row_token, pull_order, job_order, slack);
}

}  // namespace
}  // namespace moe

TORCH_LIBRARY(moe, m) {
  m.def("build_tables(Tensor ids, Tensor counts, int E, int C, int S) -> (Tensor, Tensor, Tensor, Tensor, Tensor, "
        "Tensor, Tensor)");
  m.def("build_tables_out(Tensor ids, Tensor counts, int E, int C, Tensor(a!) expert_offsets, "
        "Tensor(b!) block_expert, Tensor(c!) slots, Tensor(d!) row_token, Tensor(e!) pull_order, "
        "Tensor(f!) job_order, Tensor(g!) slack) -> ()");
}

TORCH_LIBRARY_IMPL(moe, CUDA, m) {
  m.impl("build_tables", &moe::build_tables);
  m.impl("build_tables_out", &moe::build_tables_out_op);
}
