// hooked_backend.h: a CPU backend whose calls a test can intercept, to hold the server at an
// exact point (a chunk's device copy, a step) while it makes something else happen.
//
// Usage (in a ServiceTest):
//   ServerOptions Options() const override {
//     ServerOptions options = ServiceTest::Options();
//     options.backend_factory = [hooks = hooks_] { return MakeHookedBackend(hooks); };
//     return options;
//   }
//   hooks_->Set(&BackendHooks::before_staging_copy, [&] { ... });
#ifndef FUSEDPS_TESTS_INTEGRATION_HOOKED_BACKEND_H_
#define FUSEDPS_TESTS_INTEGRATION_HOOKED_BACKEND_H_

#include <functional>
#include <memory>
#include <mutex>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace fusedps::integration {

// A hook runs on the thread that makes the call, before the call goes on.
struct BackendHooks {
  std::mutex mu;
  std::function<void()> before_staging_copy;  // CopyStagingToDevice (gRPC or pool threads).
  std::function<void()> before_step;          // Step (the engine's thread).
  // Not a backend call: ServerOptions::testing_before_push_join, when the test wires it.
  std::function<void()> before_push_join;

  void Set(std::function<void()> BackendHooks::*hook, std::function<void()> f) {
    std::lock_guard<std::mutex> lock(mu);
    this->*hook = std::move(f);
  }
  std::function<void()> Get(std::function<void()> BackendHooks::*hook) {
    std::lock_guard<std::mutex> lock(mu);
    return this->*hook;
  }
};

absl::StatusOr<std::unique_ptr<OptimizerBackend>> MakeHookedBackend(
    std::shared_ptr<BackendHooks> hooks);

}  // namespace fusedps::integration

#endif  // FUSEDPS_TESTS_INTEGRATION_HOOKED_BACKEND_H_
