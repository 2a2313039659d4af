#include "executor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "cpu_features.h"

namespace ftnative {

namespace {

const KernelSet* kernel_set(const std::string& isa, WDtype dt) {
  const bool bf16 = dt == WDtype::BF16;
  if (isa == "emubf16") return bf16 ? &kScalarBf16 : &kScalarF32;  // bf16 banks: bkern_
  if (isa == "emu512") return bf16 ? &kEmu512Bf16 : &kEmu512F32;
#ifndef FTNATIVE_NO_X86
  if (isa == "avx512" || isa == "avx512bf16") return bf16 ? &kAvx512Bf16 : &kAvx512F32;
  if (isa == "avx2") return bf16 ? &kAvx2Bf16 : &kAvx2F32;
#else
  (void)isa;
#endif
  return bf16 ? &kScalarBf16 : &kScalarF32;
}

// The bf16-dot kernels of `isa`, or null where it has none.
const Bf16DotSet* bf16dot_set(const std::string& isa) {
  if (isa == "emubf16") return &kScalarBf16Dot;
#ifndef FTNATIVE_NO_X86
  if (isa == "avx512bf16") return &kAvx512Bf16Dot;
#endif
  return nullptr;
}

const QKernelSet* qkernel_set(const std::string& isa, QFormat f) {
  const int i = static_cast<int>(f);
  if (isa == "emu512") return &kEmu512Q[i];
#ifndef FTNATIVE_NO_X86
  if (isa == "avx512" || isa == "avx512bf16") return &kAvx512Q[i];
  if (isa == "avx2") return &kAvx2Q[i];
#endif
  return &kScalarQ[i];
}

std::string resolve_isa(const std::string& requested) {
  if (requested == "auto") return supported_isas().front();
  if (requested == "emu512" || requested == "emubf16") return requested;  // test-only, portable
  if (requested != "avx512bf16" && requested != "avx512" && requested != "avx2" &&
      requested != "scalar")
    throw std::invalid_argument("isa must be one of auto, avx512bf16, avx512, avx2, scalar (or "
                                "emu512, emubf16 for tests); got '" + requested + "'");
  if (!isa_supported(requested))
    throw std::runtime_error("this CPU does not support the '" + requested +
                             "' path (supported here: avx512bf16/avx512/avx2 as detected, scalar)");
  return requested;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

constexpr int kUpRows = 64;  // rows of I per up-phase task (gate and up rows each)
// The same for a call of the bf16-dot kernels in which every expert takes the gemv with one
// route (decode): a task's rows are one sequential stream (the kernels' one-token gemv), and
// longer streams read faster. Measured on Zen 4, 2 threads, Qwen3-30B-A3B geometry bf16 experts
// from DRAM, against 64 / 128 rows read as 8 streams: 1.03-1.15x for the MoE call (the larger
// gains when the machine's read bandwidth was low), 1.00-1.04x for a whole decode step.
constexpr int kUpRowsSeq = 256;

}  // namespace

InputLayout::InputLayout(int chunk, const uint8_t* perm) : chunk_(chunk), pos_(chunk) {
  for (int p = 0; p < chunk; ++p) {
    const int input = perm ? perm[p] : p < chunk / 2 ? 2 * p : 2 * (p - chunk / 2) + 1;
    pos_[input] = p;
  }
}

void InputLayout::apply(const float* src, float* dst, int64_t k) const {
  const int64_t full = chunk_ ? k - k % chunk_ : 0;
  for (int64_t c = 0; c < full; c += chunk_)
    for (int i = 0; i < chunk_; ++i) dst[c + pos_[i]] = src[c + i];
  for (int64_t j = full; j < k; ++j) dst[j] = src[j];
}

Executor::Executor(const BankSpec& banks, const ActSpec& act, const ExecutorOptions& opts)
    : banks_(banks), act_(act), opts_(opts), isa_(resolve_isa(opts.isa)) {
  if (!banks.gate_up || !banks.down) throw std::invalid_argument("gate_up and down are required");
  if (banks.num_flat <= 0 || banks.hidden <= 0 || banks.inter <= 0)
    throw std::invalid_argument("bank shapes must be positive");
  if (opts.tile_min_tokens < 1) throw std::invalid_argument("tile_min_tokens must be >= 1");
  kern_ = kernel_set(isa_, banks.weight_dtype);
  if (banks.quant) {
    qkern_ = qkernel_set(isa_, banks.qformat);
    gemv_in_ = tile_in_ = InputLayout(qkern_->chunk, qkern_->perm);
  } else if (banks.weight_dtype == WDtype::BF16 && (bkern_ = bf16dot_set(isa_))) {
    gemv_in_ = tile_in_ = InputLayout(0, nullptr);  // natural order: W's pairs meet x's pairs
  } else {
    gemv_in_ = InputLayout(kern_->chunk, nullptr);
  }
  init_geometry();
  const std::vector<int> cpus = physical_core_cpus();
  int threads = opts.threads;
  if (threads <= 0) threads = std::max<int>(1, static_cast<int>(cpus.size()));
  for (auto& d : done_) d.store(0);
  scratch_.resize(threads);
  pool_ = std::make_unique<ThreadPool>(threads, opts.pin ? cpus : std::vector<int>{},
                                       std::max(0, opts.spin_us));
}

void Executor::init_geometry() {
  const int64_t H = banks_.hidden, I = banks_.inter;
  const char* gu = static_cast<const char*>(banks_.gate_up);
  const char* dn = static_cast<const char*>(banks_.down);
  const char* gus = static_cast<const char*>(banks_.gate_up_scale);
  const char* ds = static_cast<const char*>(banks_.down_scale);
  if (!banks_.quant) {
    const int64_t es = banks_.weight_dtype == WDtype::BF16 ? 2 : 4;
    gu_geom_ = {gu, H * es, 2 * I, nullptr, 0, 0, 0, static_cast<int>(H)};
    down_geom_ = {dn, I * es, H, nullptr, 0, 0, 0, static_cast<int>(I)};
    return;
  }
  if (!gus || !ds) throw std::invalid_argument("quantised banks need gate_up_scale and down_scale");
  if (banks_.qformat == QFormat::Fp8Block) {  // fp32 scales per 128 x 128 block
    const int64_t cH = (H + 127) / 128, cI = (I + 127) / 128;
    gu_geom_ = {gu, H, 2 * I, gus, cH, 2 * cI * cH * 4, cI * cH * 4, static_cast<int>(H)};
    down_geom_ = {dn, I, H, ds, cI, cH * cI * 4, 0, static_cast<int>(I)};
    return;
  }
  // e2m1 nibble pairs, one byte-sized scale per G inputs of a row
  const int64_t G = banks_.qformat == QFormat::Mxfp4 ? 32 : 16;
  if (H % G || I % G)
    throw std::invalid_argument("hidden and moe intermediate sizes must be multiples of " +
                                std::to_string(G) + " for this format");
  if (banks_.qformat == QFormat::Nvfp4 && (!banks_.gate_up_global || !banks_.down_global))
    throw std::invalid_argument("nvfp4 banks need gate_up_global and down_global");
  gu_geom_ = {gu, H / 2, 2 * I, gus, H / G, 2 * I * (H / G), I * (H / G), static_cast<int>(H)};
  down_geom_ = {dn, I / 2, H, ds, I / G, H * (I / G), 0, static_cast<int>(I)};
}

const char* Executor::wrows(Proj p, int64_t fid, int r0) const {
  const MatGeom& g = geom(p);
  const int64_t first = p == Proj::Up ? banks_.inter : 0;  // up rows follow the gate rows
  return g.w + (fid * g.rows + first + r0) * g.row_bytes;
}

QMat Executor::qmat(Proj p, int64_t fid, int r0) const {
  const MatGeom& g = geom(p);
  QMat m;
  m.w = reinterpret_cast<const uint8_t*>(wrows(p, fid, r0));
  m.ldw = g.row_bytes;
  m.s = g.s + fid * g.s_expert + (p == Proj::Up ? g.s_up : 0);
  m.lds = g.lds;
  m.row0 = r0;
  m.glob = 1.f;
  if (banks_.qformat == QFormat::Nvfp4)
    m.glob = p == Proj::Down ? banks_.down_global[fid]
                             : banks_.gate_up_global[2 * fid + (p == Proj::Up ? 1 : 0)];
  return m;
}

void Executor::proj_gemv(Proj p, int64_t fid, int r0, int rows, const float* const* xs, int n,
                         float* y, int ldy) const {
  const int k = geom(p).k;
  if (qkern_) qkern_->gemv(qmat(p, fid, r0), rows, k, xs, n, y, ldy);
  else kern_->gemv(wrows(p, fid, r0), k, rows, k, xs, n, y, ldy);
}

void Executor::proj_gemv(Proj p, int64_t fid, int r0, int rows, const uint16_t* const* xs,
                         int n, float* y, int ldy) const {
  const int k = geom(p).k;
  bkern_->gemv(reinterpret_cast<const uint16_t*>(wrows(p, fid, r0)), k, rows, k, xs, n, y, ldy);
}

void Executor::proj_tile(Proj p, int64_t fid, int r0, int rows, const uint16_t* xp, int nb,
                         float* y) const {
  const int k = geom(p).k;
  bkern_->tile(reinterpret_cast<const uint16_t*>(wrows(p, fid, r0)), k, rows, k, xp, nb, y);
}

void Executor::proj_tile(Proj p, int64_t fid, int r0, int rows, const float* xp, int nb,
                         float* y) const {
  const int k = geom(p).k;
  if (qkern_) qkern_->tile(qmat(p, fid, r0), rows, k, xp, nb, y);
  else kern_->tile(wrows(p, fid, r0), k, rows, k, xp, nb, y);
}

bool Executor::prepare(const float* x, const int32_t* ids, const float* weights, float* out,
                       int T, int K) {
  const int64_t H = banks_.hidden;
  if (T <= 0) return false;
  x_ = x;
  out_ = out;
  T_ = T;
  plan(ids, weights, T, K);
  if (groups_.empty()) {
    std::memset(out, 0, sizeof(float) * T * H);
    return false;
  }
  build_tasks(T);
  next_.store(0);
  for (auto& d : done_) d.store(0);
  return true;
}

void Executor::forward(const float* x, const int32_t* ids, const float* weights, float* out,
                       int T, int K) {
  std::lock_guard<std::mutex> lock(call_mu_);
  if (prepare(x, ids, weights, out, T, K)) pool_->run(*this);
}

void Executor::forward_on(const ExternalPool& ext, const float* x, const int32_t* ids,
                          const float* weights, float* out, int T, int K) {
  std::lock_guard<std::mutex> lock(call_mu_);
  if (!prepare(x, ids, weights, out, T, K)) return;
  // participant i works with scratch_[i]: no more of them than this executor has workers
  const int64_t n = std::clamp(ext.threads, 1, pool_->size());
  ext.run(
      ext.pool,
      [](void* self, int64_t i) { static_cast<Executor*>(self)->work(static_cast<int>(i)); },
      this, n);
}

void Executor::plan(const int32_t* ids, const float* weights, int T, int K) {
  sort_routes(ids, weights, T, K);
  make_groups();
  layout(T);
}

// Routes sorted by (expert, route index) -> rtok_, rw_; keys_ keeps the expert ids.
void Executor::sort_routes(const int32_t* ids, const float* weights, int T, int K) {
  keys_.clear();
  for (int64_t r = 0; r < static_cast<int64_t>(T) * K; ++r) {
    const int32_t id = ids[r];
    if (id == -1) continue;
    if (id < -1 || id >= banks_.num_flat)
      throw std::out_of_range("flat expert id " + std::to_string(id) + " outside [-1, " +
                              std::to_string(banks_.num_flat) + ")");
    keys_.push_back(static_cast<uint64_t>(id) << 32 | static_cast<uint32_t>(r));
  }
  std::sort(keys_.begin(), keys_.end());
  const int nroutes = static_cast<int>(keys_.size());
  rtok_.resize(nroutes);
  rw_.resize(nroutes);
  for (int i = 0; i < nroutes; ++i) {
    const uint32_t r = static_cast<uint32_t>(keys_[i]);
    rtok_[i] = static_cast<int>(r / K);
    rw_[i] = weights[r];
  }
}

// One group per distinct expert, except that an expert with enough routes for the tiled kernel
// gives its last few routes (fewer than tile_min, which would mostly be padding in a 16-token
// block) to a second, small group. Groups of one expert are adjacent.
void Executor::make_groups() {
  groups_.clear();
  const int nroutes = static_cast<int>(keys_.size());
  const int tmin = opts_.tile_min_tokens;
  for (int i = 0; i < nroutes;) {
    const int64_t fid = static_cast<int64_t>(keys_[i] >> 32);
    int j = i;
    while (j < nroutes && static_cast<int64_t>(keys_[j] >> 32) == fid) ++j;
    const int n = j - i, rem = n % kTileLanes;
    const int n_tiled = n < tmin ? 0 : (rem == 0 || rem >= tmin) ? n : n - rem;
    if (n_tiled > 0) groups_.push_back({fid, i, n_tiled, true, 0, 0, 0});
    if (n_tiled < n) groups_.push_back({fid, i + n_tiled, n - n_tiled, false, 0, 0, 0});
    i = j;
  }
}

// Offsets into the act and panel buffers, and the input/act row pointers of small groups.
void Executor::layout(int T) {
  const int64_t H = banks_.hidden, I = banks_.inter;
  // bf16 pair panels pad an odd input count to even
  const int64_t Hp = bkern_ ? H + (H & 1) : H, Ip = bkern_ ? I + (I & 1) : I;
  int64_t a_total = 0, p_total = 0;
  bool any_small = false;
  for (Group& g : groups_) {
    g.nb = g.tiled ? (g.n + kTileLanes - 1) / kTileLanes : 0;
    g.a_off = a_total;
    g.p_off = p_total;
    a_total += g.tiled ? int64_t{g.nb} * kTileLanes * Ip : g.n * I;
    p_total += int64_t{g.nb} * kTileLanes * Hp;
    any_small |= !g.tiled;
  }
  if (bkern_) {
    if (static_cast<int64_t>(actb_.size()) < a_total) actb_.resize(a_total);
    if (static_cast<int64_t>(panelb_.size()) < p_total) panelb_.resize(p_total);
  } else {
    if (static_cast<int64_t>(act_buf_.size()) < a_total) act_buf_.resize(a_total);
    if (static_cast<int64_t>(panel_buf_.size()) < p_total) panel_buf_.resize(p_total);
  }

  // Inputs of small groups: x rows, de-interleaved when the gemv kernel wants it (rounded to bf16
  // on the bf16-dot path).
  const bool shuffle = any_small && (gemv_in_.chunk() > 0 || bkern_);
  if (shuffle && bkern_ && static_cast<int64_t>(xb_.size()) < T * H) xb_.resize(T * H);
  if (shuffle && !bkern_ && static_cast<int64_t>(xs_.size()) < T * H) xs_.resize(T * H);
  const float* xsrc = shuffle ? xs_.data() : x_;
  shuffle_async_ = shuffle && T * H > (1 << 16);
  if (shuffle && !shuffle_async_) shuffle_rows(0, T);
  const int nroutes = static_cast<int>(keys_.size());
  if (bkern_) {
    xinb_.resize(nroutes);
    ainb_.resize(nroutes);
  } else {
    xin_.resize(nroutes);
    ain_.resize(nroutes);
  }
  for (const Group& g : groups_) {
    if (g.tiled) continue;
    for (int s = 0; s < g.n; ++s) {
      if (bkern_) {
        xinb_[g.begin + s] = xb_.data() + rtok_[g.begin + s] * H;
        ainb_[g.begin + s] = actb_.data() + g.a_off + s * I;
      } else {
        xin_[g.begin + s] = xsrc + rtok_[g.begin + s] * H;
        ain_[g.begin + s] = act_buf_.data() + g.a_off + s * I;
      }
    }
  }
}

void Executor::build_tasks(int T) {
  const int H = banks_.hidden, I = banks_.inter;
  const int threads = pool_->size();
  tasks_.clear();
  if (shuffle_async_)
    for (int t0 = 0; t0 < T; t0 += 16) tasks_.push_back({0, -1, t0, std::min(T, t0 + 16)});
  for (int gi = 0; gi < static_cast<int>(groups_.size()); ++gi)
    for (int b = 0; b < groups_[gi].nb; ++b) tasks_.push_back({0, gi, b, b + 1});
  phase_end_[0] = static_cast<int>(tasks_.size());

  // Row blocks outer, an expert's groups inner: its second group re-reads the block from cache.
  bool seq = bkern_ != nullptr;  // every group one route on the gemv: its rows in order
  for (const Group& g : groups_) seq = seq && !g.tiled && g.n == 1;
  jb_ = seq ? kUpRowsSeq : kUpRows;
  const int ngroups = static_cast<int>(groups_.size());
  for (int g0 = 0, g1 = 0; g0 < ngroups; g0 = g1) {
    while (g1 < ngroups && groups_[g1].fid == groups_[g0].fid) ++g1;
    for (int j0 = 0; j0 < I; j0 += jb_)
      for (int gi = g0; gi < g1; ++gi) tasks_.push_back({1, gi, j0, std::min(I, j0 + jb_)});
  }
  phase_end_[1] = static_cast<int>(tasks_.size());

  // About 8 down tasks per thread so a late or preempted worker costs little; rows in 16s.
  // Sequential streams (seq) take 4 a thread: twice the rows, read faster (kUpRowsSeq).
  const int per = seq ? 4 * threads : 8 * threads;
  hb_ = (H + per - 1) / per;
  hb_ = std::clamp((hb_ + 15) / 16 * 16, 16, seq ? 512 : 256);
  for (int h0 = 0; h0 < H; h0 += hb_) tasks_.push_back({2, -1, h0, std::min(H, h0 + hb_)});
  phase_end_[2] = static_cast<int>(tasks_.size());

  int64_t m = 0;  // widest group in tokens (tiled groups count their padded panel)
  for (const Group& g : groups_) m = std::max<int64_t>(m, g.tiled ? g.nb * kTileLanes : g.n);
  const int64_t need = std::max<int64_t>(2 * jb_, hb_) * m;  // fp32 scratch either way
  for (auto& s : scratch_)
    if (static_cast<int64_t>(s.size()) < need) s.resize(need);
}

bool Executor::finished() const {
  return done_[0].load() == phase_end_[0] && done_[1].load() == phase_end_[1] - phase_end_[0] &&
         done_[2].load() == phase_end_[2] - phase_end_[1];
}

void Executor::work(int worker) {
  const int total = phase_end_[2];
  for (;;) {
    const int i = next_.fetch_add(1);
    if (i >= total) return;
    const Task& t = tasks_[i];
    // Tasks are handed out in phase order, so only completion of earlier phases is awaited.
    for (int q = 0; q < t.phase; ++q) {
      const int count = phase_end_[q] - (q ? phase_end_[q - 1] : 0);
      for (int spins = 0; done_[q].load(std::memory_order_acquire) < count; ++spins) {
        if (spins < 4096) cpu_relax();
        else std::this_thread::yield();  // the straggler may be waiting for this core
      }
    }
    run_task(t, worker);
    done_[t.phase].fetch_add(1, std::memory_order_release);
  }
}

void Executor::run_task(const Task& t, int worker) {
  float* scratch = scratch_[worker].data();
  switch (t.phase) {
    case 0:
      if (t.group < 0) shuffle_rows(t.r0, t.r1);
      else pack_panel(groups_[t.group], t.r0);
      break;
    case 1:
      if (groups_[t.group].tiled) up_tiled(groups_[t.group], t.r0, t.r1, scratch);
      else up_small(groups_[t.group], t.r0, t.r1, scratch);
      break;
    default:
      down_block(t.r0, t.r1, scratch);
  }
}

void Executor::shuffle_rows(int t0, int t1) {
  const int64_t H = banks_.hidden;
  if (bkern_) {
    to_bf16(x_ + t0 * H, xb_.data() + t0 * H, (t1 - t0) * H);
    return;
  }
  for (int64_t t = t0; t < t1; ++t) gemv_in_.apply(x_ + t * H, xs_.data() + t * H, H);
}

// Panel block b of a tiled group: [H][16] with the inputs of routes 16b .. 16b+15 in the lanes.
void Executor::pack_panel(const Group& g, int b) {
  const int64_t H = banks_.hidden;
  const float* rows[kTileLanes];
  int lanes = 0;
  for (; lanes < kTileLanes && b * kTileLanes + lanes < g.n; ++lanes)
    rows[lanes] = x_ + rtok_[g.begin + b * kTileLanes + lanes] * H;
  if (bkern_) {  // bf16 pair panel [Hp / 2][16][2]; padding lanes and the odd pad input are 0
    const int64_t Hp = H + (H & 1);
    uint16_t* pb = panelb_.data() + g.p_off + b * Hp * kTileLanes;
    for (int64_t j = 0; j < Hp; ++j)
      for (int l = 0; l < kTileLanes; ++l)
        pb[pair_panel_index(j, l)] = l < lanes && j < H ? to_bf16(rows[l][j]) : 0;
    return;
  }
  float* p = panel_buf_.data() + g.p_off + b * H * kTileLanes;
  for (int64_t j = 0; j < H; ++j) {
    float* dst = p + tile_in_.index(j, H) * kTileLanes;
    for (int l = 0; l < lanes; ++l) dst[l] = rows[l][j];
    for (int l = lanes; l < kTileLanes; ++l) dst[l] = 0.f;
  }
}

float Executor::bias(const void* base, int64_t i) const {
  if (!base) return 0.f;
  if (banks_.bias_dtype == WDtype::BF16) return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
  return static_cast<const float*>(base)[i];
}

float Executor::activate(float gate, float up) const {
  if (act_.kind == ActKind::Silu) return gate / (1.f + std::exp(-gate)) * up;
  if (act_.kind == ActKind::GeluTanh) {
    // gelu_pytorch_tanh: 0.5 g (1 + tanh(z)) = g * sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3)
    const float z = 0.7978845608028654f * (gate + 0.044715f * gate * gate * gate);
    return gate / (1.f + std::exp(-2.f * z)) * up;
  }
  const float g = std::min(gate, act_.limit);
  const float u = std::clamp(up, -act_.limit, act_.limit);
  // DeepSeek-V4: silu(min(gate, limit)) * clamp(up, -limit, limit)
  if (act_.kind == ActKind::SwigluClamp) return g / (1.f + std::exp(-g)) * u;
  return (u + 1.f) * (g / (1.f + std::exp(-act_.alpha * g)));
}

// Up phase, few routes: act[s][perm(j)] for j in [j0, j1); gemv scratch is [n][jb] twice.
void Executor::up_small(const Group& g, int j0, int j1, float* scratch) {
  const int64_t I = banks_.inter;
  const int jb = j1 - j0;
  float* gbuf = scratch;
  float* ubuf = scratch + g.n * jb;
  if (bkern_) {
    proj_gemv(Proj::Gate, g.fid, j0, jb, &xinb_[g.begin], g.n, gbuf, jb);
    proj_gemv(Proj::Up, g.fid, j0, jb, &xinb_[g.begin], g.n, ubuf, jb);
  } else {
    proj_gemv(Proj::Gate, g.fid, j0, jb, &xin_[g.begin], g.n, gbuf, jb);
    proj_gemv(Proj::Up, g.fid, j0, jb, &xin_[g.begin], g.n, ubuf, jb);
  }
  const int64_t bias_row = g.fid * 2 * I;
  for (int s = 0; s < g.n; ++s) {
    float* a = bkern_ ? nullptr : act_buf_.data() + g.a_off + s * I;
    uint16_t* ab = bkern_ ? actb_.data() + g.a_off + s * I : nullptr;
    for (int j = 0; j < jb; ++j) {
      const int64_t jj = j0 + j;
      const float gv = gbuf[s * jb + j] + bias(banks_.gate_up_bias, bias_row + jj);
      const float uv = ubuf[s * jb + j] + bias(banks_.gate_up_bias, bias_row + I + jj);
      if (ab) ab[jj] = to_bf16(activate(gv, uv));
      else a[gemv_in_.index(jj, I)] = activate(gv, uv);
    }
  }
}

// Up phase, many routes: act panel [nb][I][16]; tile scratch is [nb][jb][16] twice.
void Executor::up_tiled(const Group& g, int j0, int j1, float* scratch) {
  const int64_t I = banks_.inter;
  const int jb = j1 - j0;
  float* gbuf = scratch;
  float* ubuf = scratch + int64_t{g.nb} * jb * kTileLanes;
  if (bkern_) {
    const uint16_t* panel = panelb_.data() + g.p_off;
    proj_tile(Proj::Gate, g.fid, j0, jb, panel, g.nb, gbuf);
    proj_tile(Proj::Up, g.fid, j0, jb, panel, g.nb, ubuf);
  } else {
    const float* panel = panel_buf_.data() + g.p_off;
    proj_tile(Proj::Gate, g.fid, j0, jb, panel, g.nb, gbuf);
    proj_tile(Proj::Up, g.fid, j0, jb, panel, g.nb, ubuf);
  }
  const int64_t bias_row = g.fid * 2 * I;
  const int64_t Ip = I + (I & 1);  // bf16 act pair panels [nb][Ip / 2][16][2]
  for (int b = 0; b < g.nb; ++b)
    for (int j = 0; j < jb; ++j) {
      const float bg = bias(banks_.gate_up_bias, bias_row + j0 + j);
      const float bu = bias(banks_.gate_up_bias, bias_row + I + j0 + j);
      const float* gs = gbuf + (int64_t{b} * jb + j) * kTileLanes;
      const float* us = ubuf + (int64_t{b} * jb + j) * kTileLanes;
      if (bkern_) {
        uint16_t* dst = actb_.data() + g.a_off + b * Ip * kTileLanes;
        for (int l = 0; l < kTileLanes; ++l)
          dst[pair_panel_index(j0 + j, l)] = to_bf16(activate(gs[l] + bg, us[l] + bu));
        continue;
      }
      float* dst = act_buf_.data() + g.a_off + (b * I + tile_in_.index(j0 + j, I)) * kTileLanes;
      for (int l = 0; l < kTileLanes; ++l) dst[l] = activate(gs[l] + bg, us[l] + bu);
    }
  if (bkern_ && (I & 1) && j1 == I)  // the odd pad input of the last pair: 0 in every lane
    for (int b = 0; b < g.nb; ++b)
      for (int l = 0; l < kTileLanes; ++l)
        actb_[g.a_off + b * Ip * kTileLanes + pair_panel_index(I, l)] = 0;
}

// Down phase for out[:, h0:h1]: this task owns those columns for every token, so it zeroes them
// and accumulates every expert's contribution without synchronisation.
void Executor::down_block(int h0, int h1, float* scratch) {
  const int64_t H = banks_.hidden;
  const int hb = h1 - h0;
  for (int64_t t = 0; t < T_; ++t) std::memset(out_ + t * H + h0, 0, sizeof(float) * hb);
  for (const Group& g : groups_) {
    const int64_t bias_row = g.fid * H + h0;
    if (bkern_ && g.tiled) proj_tile(Proj::Down, g.fid, h0, hb, actb_.data() + g.a_off, g.nb, scratch);
    else if (bkern_) proj_gemv(Proj::Down, g.fid, h0, hb, &ainb_[g.begin], g.n, scratch, hb);
    else if (g.tiled) proj_tile(Proj::Down, g.fid, h0, hb, act_buf_.data() + g.a_off, g.nb, scratch);
    else proj_gemv(Proj::Down, g.fid, h0, hb, &ain_[g.begin], g.n, scratch, hb);
    for (int s = 0; s < g.n; ++s) {
      float* o = out_ + rtok_[g.begin + s] * H + h0;
      const float wt = rw_[g.begin + s];
      // small: scratch[s][h]; tiled: scratch[b][h][lane] with s = 16 b + lane
      const float* y = g.tiled ? scratch + (s / kTileLanes) * hb * kTileLanes + s % kTileLanes
                               : scratch + s * hb;
      const int64_t stride = g.tiled ? kTileLanes : 1;
      for (int h = 0; h < hb; ++h) o[h] += wt * (y[h * stride] + bias(banks_.down_bias, bias_row + h));
    }
  }
}

}  // namespace ftnative
