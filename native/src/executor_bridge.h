// How another extension module (ftdense, native/dense/decode_layers.h) runs an ftnative
// Executor's call on its own thread pool: the two modules share no C++ types, only this plain
// struct and a function address that ftnative hands out (Executor.forward_on_entry).
//
// On a CPU decode step the dense projections run on ftdense's pool and the experts on the
// executor's; each layer then handed the cores from one pool to the other (the executor's
// pinned workers woken by futex while ftdense's slept, and back). With forward_on the experts
// run on the pool that runs everything else, its caller taking part.
#pragma once

#include <cstdint>

namespace ftnative {

struct ExternalPool {
  // Runs task(ctx, i) for every i in [0, tasks) on the pool's threads and returns when all ran.
  void (*run)(void* pool, void (*task)(void* ctx, int64_t i), void* ctx, int64_t tasks);
  void* pool;
  int threads;  // how many may run at once
};

// Executor::forward on `ext` (exec: an ftnative::Executor). Throws as forward does.
using ForwardOnFn = void (*)(void* exec, const float* x, const int32_t* flat_ids,
                             const float* weights, float* out, int T, int K,
                             const ExternalPool* ext);

}  // namespace ftnative
