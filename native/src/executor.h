// The MoE expert executor: one call computes the routed-expert sum of one MoE layer for a batch.
//
//   out[t, :] = sum_k w[t, k] * (down_e @ act(gate_up_e @ x[t] + gate_up_bias_e) + down_bias_e)
//   e = flat_ids[t, k]; routes with e == -1 are skipped.
//
// Banks (flat_id-major, see daemon/experts/banks.py): gate_up [N, 2I, H] (gate rows [0, I),
// up rows [I, 2I)), down [N, H, I], optional gate_up_bias [N, 2I] and down_bias [N, H]; weights
// and biases fp32 or bf16, all C-contiguous. The executor only borrows these pointers.
// Quantised banks (`quant`, formats.py) hold packed weights in gate_up/down plus scale banks:
//   Fp8Block  gate_up [N, 2I, H] e4m3, gate_up_scale [N, 2 ceil(I/128), ceil(H/128)] fp32
//             (gate and up blocked separately), down [N, H, I], down_scale [N, ceil(H/128),
//             ceil(I/128)]
//   Mxfp4     gate_up [N, 2I, H/2] nibble pairs, gate_up_scale [N, 2I, H/32] e8m0, down
//             [N, H, I/2], down_scale [N, H, I/32]
//   Nvfp4     as Mxfp4 with e4m3 scales per 16 inputs ([N, 2I, H/16], [N, H, I/16]) and fp32
//             gate_up_global [N, 2] (gate, up) and down_global [N, 1]
// and are dequantised inside the kernels' inner loops (kernels.h).
//
// A call runs in up to three phases on the pool; tasks are handed out in order from one atomic
// counter and a task starts only after every task of the previous phase has completed:
//   0 pack    copy the inputs of many-token experts into 16-token panels (prefill only)
//   1 up      per (expert, block of I rows): gate and up projections, bias, activation -> act
//   2 down    per block of H rows: for every expert, down projection, bias, gate weight, and
//             accumulate into out[:, block]. A block of out is owned by one task, so no atomics.
// Each distinct expert's weights are therefore streamed from memory once per call, and
// concurrent workers stream disjoint row blocks.
//
// Per expert, routes are computed by one of two kernels (kernels.h): `gemv` for fewer than
// tile_min_tokens routes (decode), `tile` on 16-token panels otherwise (prefill). A tiled
// expert whose last block would be mostly padding hands those routes to a second, gemv group;
// its tasks run right after the tiled ones on the same row block, which is then still cached.
//
// bf16 banks under isa "avx512bf16" (or "emubf16", tests) take the bf16-dot kernels
// (kernels_bf16dot.h): x is rounded to bf16 once per call (shared by every expert reading it;
// the tiled groups' panels are packed from it in bf16), and each act row once, when the up phase
// writes it; gate, up and down sums stay fp32, bias and activation are computed in fp32.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernels.h"
#include "kernels_bf16dot.h"
#include "executor_bridge.h"
#include "thread_pool.h"

namespace ftnative {

enum class ActKind : int { Silu = 0, GptOss = 1, GeluTanh = 2, SwigluClamp = 3 };

// The order in which a kernel reads the k inputs of a row (kernels.h: chunk and perm): every
// full chunk permuted, the tail in order.
class InputLayout {
 public:
  InputLayout() = default;
  InputLayout(int chunk, const uint8_t* perm);  // perm null: even inputs, then odd ones
  int chunk() const { return chunk_; }
  // Position of input j of a k-input row.
  int64_t index(int64_t j, int64_t k) const {
    if (chunk_ == 0 || j >= k - k % chunk_) return j;
    return j - j % chunk_ + pos_[j % chunk_];
  }
  // dst[index(j)] = src[j] for j < k.
  void apply(const float* src, float* dst, int64_t k) const;

 private:
  int chunk_ = 0;
  std::vector<int> pos_;  // [chunk]
};

struct BankSpec {
  const void* gate_up = nullptr;
  const void* down = nullptr;
  const void* gate_up_bias = nullptr;  // nullable
  const void* down_bias = nullptr;     // nullable
  WDtype weight_dtype = WDtype::BF16;  // float banks only
  WDtype bias_dtype = WDtype::F32;
  int64_t num_flat = 0;  // N
  int hidden = 0;        // H
  int inter = 0;         // I
  bool quant = false;    // weights are of `qformat`, with the scale banks below
  QFormat qformat = QFormat::Fp8Block;
  const void* gate_up_scale = nullptr;
  const void* down_scale = nullptr;
  const float* gate_up_global = nullptr;  // Nvfp4 only
  const float* down_global = nullptr;     // Nvfp4 only
};

struct ActSpec {
  ActKind kind = ActKind::Silu;
  float alpha = 1.702f;
  float limit = 7.0f;
};

struct ExecutorOptions {
  int threads = 0;          // 0: one per physical core
  std::string isa = "auto";
  int tile_min_tokens = 12;  // experts with at least this many routes use the tiled path
  int spin_us = 20;         // how long idle workers spin for the next call before sleeping
  bool pin = true;
};

class Executor final : public PoolJob {
 public:
  Executor(const BankSpec& banks, const ActSpec& act, const ExecutorOptions& opts);

  // x [T, H] fp32, flat_ids [T, K] int32, weights [T, K] fp32, out [T, H] fp32 (overwritten).
  // Throws std::out_of_range on an id outside [-1, N). Thread-safe (calls are serialised).
  void forward(const float* x, const int32_t* flat_ids, const float* weights, float* out, int T,
               int K);

  // forward with the tasks run on `ext` instead of this executor's own workers
  // (executor_bridge.h): at most threads() of its threads take part.
  void forward_on(const ExternalPool& ext, const float* x, const int32_t* flat_ids,
                  const float* weights, float* out, int T, int K);

  const std::string& isa() const { return isa_; }
  bool bf16_dot() const { return bkern_ != nullptr; }  // bf16 banks on the bf16-dot kernels
  int threads() const { return pool_->size(); }

  void work(int worker) override;
  bool finished() const override;

 private:
  // forward up to the tasks' start; false when there is nothing to run (out zeroed)
  bool prepare(const float* x, const int32_t* flat_ids, const float* weights, float* out, int T,
               int K);

  struct Group {
    int64_t fid;
    int begin, n;   // routes [begin, begin + n) of the sorted route arrays
    bool tiled;
    int nb;         // 16-token panel blocks (tiled only)
    int64_t a_off;  // act buffer: [n][I] small (de-interleaved), [nb][I][16] tiled
    int64_t p_off;  // input panel [nb][H][16] (tiled only)
  };
  enum class Proj { Gate, Up, Down };
  // Where one projection's weights (and scales) sit inside its bank.
  struct MatGeom {
    const char* w;        // bank base
    int64_t row_bytes;    // bytes per weight row
    int64_t rows;         // rows of this bank per expert (2I or H)
    const char* s;        // scale bank base (quantised)
    int64_t lds;          // scales per scale row
    int64_t s_expert;     // scale bytes per expert
    int64_t s_up;         // byte offset of the up projection's scales inside an expert
    int k;                // inputs per row
  };
  struct Task {
    int phase;
    int group;   // -1 for down-phase and x-shuffle tasks
    int r0, r1;  // row range (pack: panel block b = r0)
  };

  void plan(const int32_t* ids, const float* weights, int T, int K);
  void sort_routes(const int32_t* ids, const float* weights, int T, int K);
  void make_groups();
  void layout(int T);
  void build_tasks(int T);
  void run_task(const Task& t, int worker);
  void pack_panel(const Group& g, int b);
  void shuffle_rows(int t0, int t1);
  void up_small(const Group& g, int j0, int j1, float* scratch);
  void up_tiled(const Group& g, int j0, int j1, float* scratch);
  void down_block(int h0, int h1, float* scratch);
  float bias(const void* base, int64_t i) const;
  void init_geometry();
  const MatGeom& geom(Proj p) const { return p == Proj::Down ? down_geom_ : gu_geom_; }
  QMat qmat(Proj p, int64_t fid, int r0) const;
  const char* wrows(Proj p, int64_t fid, int r0) const;
  // Rows [r0, r0 + rows) of projection p of expert fid: kernels.h's gemv / tile contracts.
  void proj_gemv(Proj p, int64_t fid, int r0, int rows, const float* const* xs, int n, float* y,
                 int ldy) const;
  void proj_tile(Proj p, int64_t fid, int r0, int rows, const float* xp, int nb,
                 float* y) const;
  // The same on the bf16-dot path: bf16 rows (natural order) and bf16 pair panels.
  void proj_gemv(Proj p, int64_t fid, int r0, int rows, const uint16_t* const* xs, int n,
                 float* y, int ldy) const;
  void proj_tile(Proj p, int64_t fid, int r0, int rows, const uint16_t* xp, int nb,
                 float* y) const;
  float activate(float gate, float up) const;

  BankSpec banks_;
  ActSpec act_;
  ExecutorOptions opts_;
  std::string isa_;
  const KernelSet* kern_;               // float banks
  const Bf16DotSet* bkern_ = nullptr;   // bf16 banks on the bf16-dot path
  const QKernelSet* qkern_ = nullptr;   // quantised banks
  InputLayout gemv_in_;  // x rows and act rows of gemv groups
  InputLayout tile_in_;  // panel and act panel rows of tiled groups (in order for float banks)
  MatGeom gu_geom_{}, down_geom_{};

  // Per-call state (valid during forward).
  const float* x_ = nullptr;
  float* out_ = nullptr;
  int T_ = 0;
  std::vector<uint64_t> keys_;   // (expert << 32 | route index), sorted
  std::vector<int> rtok_;        // token of each sorted route
  std::vector<float> rw_;        // gate weight of each sorted route
  std::vector<Group> groups_;
  std::vector<const float*> xin_;  // small groups: per route, its (de-interleaved) input row
  std::vector<const float*> ain_;  // small groups: per route, its act row
  std::vector<float> xs_;        // de-interleaved copy of x when gemv needs it
  std::vector<float> act_buf_, panel_buf_;
  // bf16-dot path: x rounded to bf16 [T][H], act rows / act pair panels, input pair panels (same
  // offsets as act_buf_ / panel_buf_, with H and I rounded up to even for the panels).
  std::vector<uint16_t> xb_, actb_, panelb_;
  std::vector<const uint16_t*> xinb_, ainb_;
  std::vector<std::vector<float>> scratch_;  // per worker
  std::vector<Task> tasks_;
  int phase_end_[3] = {0, 0, 0};  // tasks_[phase_end_[p-1], phase_end_[p]) belong to phase p
  int jb_ = 64, hb_ = 64;
  bool shuffle_async_ = false;

  std::atomic<int> next_{0};
  std::atomic<int> done_[3];

  std::mutex call_mu_;
  std::unique_ptr<ThreadPool> pool_;  // last: its threads stop before the state above dies
};

}  // namespace ftnative
