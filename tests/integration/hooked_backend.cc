#include "tests/integration/hooked_backend.h"

#include <utility>

#include "kernels/forwarding_backend.h"

namespace fusedps::integration {
namespace {

class HookedBackend final : public ForwardingBackend {
 public:
  HookedBackend(std::unique_ptr<OptimizerBackend> inner, std::shared_ptr<BackendHooks> hooks)
      : ForwardingBackend(std::move(inner)), hooks_(std::move(hooks)) {}

  absl::StatusOr<StepOutcome> Step(const StepRequest& r) override {
    if (auto hook = hooks_->Get(&BackendHooks::before_step)) hook();
    return ForwardingBackend::Step(r);
  }
  absl::Status CopyStagingToDevice(uint64_t o, uint64_t b) override {
    if (auto hook = hooks_->Get(&BackendHooks::before_staging_copy)) hook();
    return ForwardingBackend::CopyStagingToDevice(o, b);
  }

 private:
  const std::shared_ptr<BackendHooks> hooks_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<OptimizerBackend>> MakeHookedBackend(
    std::shared_ptr<BackendHooks> hooks) {
  return std::unique_ptr<OptimizerBackend>(
      new HookedBackend(MakeCpuBackend({.threads = 2}), std::move(hooks)));
}

}  // namespace fusedps::integration
