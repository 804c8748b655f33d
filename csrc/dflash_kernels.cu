// sglang-dflash CUDA kernels: the small glue operations of one DFlash decode step, each one
// launch for the whole batch with no host synchronisation. Every kernel has a plain-torch twin
// in sglang_dflash/ops/kernels.py, which defines what it computes; tests compare the two.
//
// Shapes: bs requests, B block size, F feature width, R req_to_token rows, L their length,
// N training blocks, T training sequence length.

#include <cstdint>

#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

namespace {

constexpr int kThreads = 256;

inline int blocks_for(int64_t n) { return static_cast<int>((n + kThreads - 1) / kThreads); }

#define CHECK_CUDA(x) TORCH_CHECK((x).is_cuda(), #x " must be a CUDA tensor")
#define CHECK_LONG(x) TORCH_CHECK((x).scalar_type() == at::kLong, #x " must be int64")
#define CHECK_CONTIG(x) TORCH_CHECK((x).is_contiguous(), #x " must be contiguous")

// ---- build_block ---------------------------------------------------------------------------
// One thread per (request r, block row k):
//   block_ids[r, k] = bonus[r] if k == 0 else mask_id
//   positions[r, k] = seq_lens[r] + k
//   slots[r, k]     = the KV slot of that position; with pages of page_size contiguous slots,
//                     the first slot of the position's page plus its offset in the page.
template <typename idx_t>
__global__ void build_block_kernel(const int64_t* __restrict__ bonus, const int64_t* __restrict__ seq_lens,
                                   const int64_t* __restrict__ req_pool_indices,
                                   const idx_t* __restrict__ req_to_token, int64_t row_stride, int64_t mask_id,
                                   int B, int page_size, int64_t n, int64_t* __restrict__ block_ids,
                                   int64_t* __restrict__ positions, int64_t* __restrict__ slots) {
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  int64_t r = i / B, k = i % B;
  int64_t pos = seq_lens[r] + k;
  const idx_t* row = req_to_token + req_pool_indices[r] * row_stride;
  int64_t in_page = pos % page_size;
  block_ids[i] = k == 0 ? bonus[r] : mask_id;
  positions[i] = pos;
  slots[i] = static_cast<int64_t>(row[pos - in_page]) + in_page;
}

std::vector<torch::Tensor> build_block(torch::Tensor bonus, torch::Tensor seq_lens, torch::Tensor req_pool_indices,
                                       torch::Tensor req_to_token, int64_t mask_id, int64_t block_size,
                                       int64_t page_size) {
  CHECK_CUDA(bonus); CHECK_CUDA(seq_lens); CHECK_CUDA(req_pool_indices); CHECK_CUDA(req_to_token);
  CHECK_LONG(bonus); CHECK_LONG(seq_lens); CHECK_LONG(req_pool_indices);
  CHECK_CONTIG(bonus); CHECK_CONTIG(seq_lens); CHECK_CONTIG(req_pool_indices);
  TORCH_CHECK(req_to_token.dim() == 2 && req_to_token.stride(1) == 1, "req_to_token must be [R, L] with unit column stride");
  TORCH_CHECK(page_size >= 1 && block_size >= 1, "page_size and block_size must be positive");
  const c10::cuda::CUDAGuard guard(bonus.device());
  int64_t bs = bonus.numel(), n = bs * block_size;
  auto opts = bonus.options();
  auto block_ids = torch::empty({bs, block_size}, opts);
  auto positions = torch::empty({bs, block_size}, opts);
  auto slots = torch::empty({bs, block_size}, opts);
  if (n == 0) return {block_ids, positions, slots};
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_INDEX_TYPES(req_to_token.scalar_type(), "build_block", [&] {
    build_block_kernel<index_t><<<blocks_for(n), kThreads, 0, stream>>>(
        bonus.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), req_pool_indices.data_ptr<int64_t>(),
        req_to_token.data_ptr<index_t>(), req_to_token.stride(0), mask_id, static_cast<int>(block_size),
        static_cast<int>(page_size), n, block_ids.data_ptr<int64_t>(), positions.data_ptr<int64_t>(),
        slots.data_ptr<int64_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {block_ids, positions, slots};
}

// ---- gather_context_features ----------------------------------------------------------------
// One CUDA block per block row (r, k). Rows with k < commit_lens[r] are committed; they are packed,
// in request order, to the front of the output; the other rows follow them, in the same order, with
// slot -1. Each CUDA block reduces commit_lens itself (bs is small), so this is one launch:
//   offset_r = sum_{j < r} commit_lens[j],  total = sum_j commit_lens[j]
//   committed row (r, k)  -> out row offset_r + k
//   rejected row (r, k)   -> out row total + (r * B - offset_r) + (k - commit_lens[r])
// The row (F values, 40 KB for Qwen3-8B's five bf16 layers) is copied 16 bytes per thread and load.
template <typename scalar_t>
__global__ void gather_context_features_kernel(const scalar_t* __restrict__ hidden, const int64_t* __restrict__ commit_lens,
                                               const int64_t* __restrict__ positions, const int64_t* __restrict__ slots,
                                               int64_t bs, int B, int64_t F, scalar_t* __restrict__ out,
                                               int64_t* __restrict__ out_positions, int64_t* __restrict__ out_slots,
                                               int64_t* __restrict__ total_out) {
  __shared__ int64_t partial[2][kThreads];
  const int64_t r = blockIdx.x;
  const int k = blockIdx.y;
  int64_t before = 0, all = 0;
  for (int64_t j = threadIdx.x; j < bs; j += blockDim.x) {
    int64_t c = commit_lens[j];
    all += c;
    if (j < r) before += c;
  }
  partial[0][threadIdx.x] = before;
  partial[1][threadIdx.x] = all;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      partial[0][threadIdx.x] += partial[0][threadIdx.x + s];
      partial[1][threadIdx.x] += partial[1][threadIdx.x + s];
    }
    __syncthreads();
  }
  const int64_t offset = partial[0][0], total = partial[1][0], commit = commit_lens[r];
  const int64_t src = r * B + k;
  const bool keep = k < commit;
  const int64_t dst = keep ? offset + k : total + (r * B - offset) + (k - commit);
  if (threadIdx.x == 0) {
    out_positions[dst] = positions[src];
    out_slots[dst] = keep ? slots[src] : -1;
    if (r == 0 && k == 0) *total_out = total;
  }
  const scalar_t* from = hidden + src * F;
  scalar_t* to = out + dst * F;
  const int64_t bytes = F * static_cast<int64_t>(sizeof(scalar_t));
  if (bytes % 16 == 0 && (reinterpret_cast<uintptr_t>(from) | reinterpret_cast<uintptr_t>(to)) % 16 == 0) {
    const int4* from4 = reinterpret_cast<const int4*>(from);
    int4* to4 = reinterpret_cast<int4*>(to);
    for (int64_t i = threadIdx.x; i < bytes / 16; i += blockDim.x) to4[i] = from4[i];
  } else {
    for (int64_t f = threadIdx.x; f < F; f += blockDim.x) to[f] = from[f];
  }
}

std::vector<torch::Tensor> gather_context_features(torch::Tensor hidden, torch::Tensor commit_lens,
                                                   torch::Tensor positions, torch::Tensor slots) {
  CHECK_CUDA(hidden); CHECK_CUDA(commit_lens); CHECK_CUDA(positions); CHECK_CUDA(slots);
  CHECK_LONG(commit_lens); CHECK_LONG(positions); CHECK_LONG(slots);
  CHECK_CONTIG(hidden); CHECK_CONTIG(commit_lens); CHECK_CONTIG(positions); CHECK_CONTIG(slots);
  TORCH_CHECK(hidden.dim() == 3, "hidden must be [bs, B, F]");
  const c10::cuda::CUDAGuard guard(hidden.device());
  int64_t bs = hidden.size(0), B = hidden.size(1), F = hidden.size(2);
  TORCH_CHECK(commit_lens.numel() == bs && positions.numel() == bs * B && slots.numel() == bs * B,
              "commit_lens must be [bs], positions and slots [bs, B]");
  auto out = torch::empty({bs * B, F}, hidden.options());
  auto out_positions = torch::empty({bs * B}, positions.options());
  auto out_slots = torch::empty({bs * B}, slots.options());
  auto total = torch::zeros({}, commit_lens.options());
  if (bs == 0) return {out, out_positions, out_slots, total};
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, hidden.scalar_type(), "gather_context_features", [&] {
    const dim3 grid(static_cast<unsigned>(bs), static_cast<unsigned>(B));
    gather_context_features_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
        hidden.data_ptr<scalar_t>(), commit_lens.data_ptr<int64_t>(), positions.data_ptr<int64_t>(),
        slots.data_ptr<int64_t>(), bs, static_cast<int>(B), F, out.data_ptr<scalar_t>(),
        out_positions.data_ptr<int64_t>(), out_slots.data_ptr<int64_t>(), total.data_ptr<int64_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, out_positions, out_slots, total};
}

// ---- accept_greedy --------------------------------------------------------------------------
// One thread per request: the longest prefix of draft_tokens[r] equal to target_tokens[r, :-1] and the
// target's token after it.
__global__ void accept_greedy_kernel(const int64_t* __restrict__ draft_tokens, const int64_t* __restrict__ target_tokens,
                                     int64_t bs, int B, int64_t* __restrict__ accept_len,
                                     int64_t* __restrict__ next_token) {
  int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= bs) return;
  const int64_t* d = draft_tokens + r * (B - 1);
  const int64_t* t = target_tokens + r * B;
  int n = 0;
  while (n < B - 1 && d[n] == t[n]) ++n;
  accept_len[r] = n;
  next_token[r] = t[n];
}

std::vector<torch::Tensor> accept_greedy(torch::Tensor draft_tokens, torch::Tensor target_tokens) {
  CHECK_CUDA(draft_tokens); CHECK_CUDA(target_tokens);
  CHECK_LONG(draft_tokens); CHECK_LONG(target_tokens);
  CHECK_CONTIG(draft_tokens); CHECK_CONTIG(target_tokens);
  TORCH_CHECK(target_tokens.dim() == 2 && draft_tokens.dim() == 2 &&
                  draft_tokens.size(0) == target_tokens.size(0) && draft_tokens.size(1) == target_tokens.size(1) - 1,
              "draft_tokens must be [bs, K-1] and target_tokens [bs, K]");
  const c10::cuda::CUDAGuard guard(draft_tokens.device());
  int64_t bs = target_tokens.size(0), B = target_tokens.size(1);
  auto accept_len = torch::empty({bs}, target_tokens.options());
  auto next_token = torch::empty({bs}, target_tokens.options());
  if (bs == 0) return {accept_len, next_token};
  accept_greedy_kernel<<<blocks_for(bs), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      draft_tokens.data_ptr<int64_t>(), target_tokens.data_ptr<int64_t>(), bs, static_cast<int>(B),
      accept_len.data_ptr<int64_t>(), next_token.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {accept_len, next_token};
}

// ---- block_attention_mask -------------------------------------------------------------------
// The training mask, [N*B, T + N*B] bool: query row q belongs to block j = q / B; it sees context
// column t < anchors[j] and the B columns of its own block, never another block.
__global__ void block_attention_mask_kernel(const int64_t* __restrict__ anchors, int64_t N, int64_t T, int B,
                                            bool* __restrict__ mask) {
  const int64_t cols = T + N * B;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N * B * cols) return;
  int64_t q = i / cols, c = i % cols, j = q / B;
  mask[i] = c < T ? c < anchors[j] : (c - T) / B == j;
}

torch::Tensor block_attention_mask(torch::Tensor anchors, int64_t seq_len, int64_t block_size) {
  CHECK_CUDA(anchors); CHECK_LONG(anchors); CHECK_CONTIG(anchors);
  const c10::cuda::CUDAGuard guard(anchors.device());
  int64_t N = anchors.numel(), n = N * block_size * (seq_len + N * block_size);
  auto mask = torch::empty({N * block_size, seq_len + N * block_size}, anchors.options().dtype(at::kBool));
  if (n == 0) return mask;
  block_attention_mask_kernel<<<blocks_for(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      anchors.data_ptr<int64_t>(), N, seq_len, static_cast<int>(block_size), mask.data_ptr<bool>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return mask;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("build_block", &build_block, "block ids, positions and KV slots of every request's draft block");
  m.def("gather_context_features", &gather_context_features, "committed verify rows, packed in request order");
  m.def("accept_greedy", &accept_greedy, "greedy accept length and the target's next token per request");
  m.def("block_attention_mask", &block_attention_mask, "the DFlash training block mask");
}
