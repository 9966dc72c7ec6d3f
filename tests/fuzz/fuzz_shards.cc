#include "tests/fuzz/fuzz_shards.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "google/protobuf/stubs/logging.h"

namespace fusedps::fuzz {
namespace {

AdamWHyperparameters CustomHyperparameters() {
  AdamWHyperparameters h;
  h.lr = 0.01;
  h.beta1 = 0.8;
  h.beta2 = 0.95;
  h.eps = 1e-6;
  h.weight_decay = 0.1;
  h.amsgrad = true;
  h.maximize = true;
  h.decoupled_weight_decay = false;
  return h;
}

std::vector<TensorMeta> MetasOf(const ShardDef& def, const ShardView& view) {
  std::vector<TensorMeta> metas;
  for (const TensorSpec& spec : def.tensors) {
    const absl::string_view group = spec.param_group.empty() ? absl::string_view(kDefaultParamGroup)
                                                             : absl::string_view(spec.param_group);
    absl::StatusOr<uint64_t> numel = NumelOf(spec.shape);
    Require(numel.ok() && view.FindGroup(group).has_value(), "a shard's tensor is not valid");
    metas.push_back({spec.name, spec.shape, *view.FindGroup(group), *numel});
  }
  return metas;
}

void RequireOk(const absl::Status& status, absl::string_view what) {
  if (status.ok()) return;
  std::fprintf(stderr, "fuzz shard: %.*s: %s\n", static_cast<int>(what.size()), what.data(),
               status.ToString().c_str());
  std::abort();
}

}  // namespace

void Require(bool condition, absl::string_view what) {
  if (condition) return;
  std::fprintf(stderr, "fuzz invariant violated: %.*s\n", static_cast<int>(what.size()),
               what.data());
  std::abort();
}

void RequireCode(const absl::Status& status, std::initializer_list<absl::StatusCode> codes,
                 absl::string_view where) {
  for (absl::StatusCode code : codes) {
    if (status.code() == code) return;
  }
  std::fprintf(stderr, "fuzz invariant violated: %.*s returned %s\n",
               static_cast<int>(where.size()), where.data(), status.ToString().c_str());
  std::abort();
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

void QuietProtobufLog() {
  google::protobuf::SetLogHandler(
      [](google::protobuf::LogLevel, const char*, int, const std::string&) {});
}

const std::vector<ShardDef>& ShardDefs() {
  static const std::vector<ShardDef>* defs = new std::vector<ShardDef>{
      {{{"w", {16, 33}, kCustomGroup}, {"b", {33}, ""}, {"s", {}, kCustomGroup}}, ""},
      {{{"a", {1}, ""},
        {"e", {0}, kCustomGroup},
        {"odd", {7}, kCustomGroup},
        {"eight", {8}, "default"},
        {"nine", {3, 3}, kCustomGroup},
        {"gr\xc3\xb6\xc3\x9f"
         "e",
         {5, 1},
         ""},
        {"big", {20000}, ""}},
       "plan-7f3a"},
      {{}, ""},
  };
  return *defs;
}

const std::vector<std::shared_ptr<const ShardView>>& PushViews() {
  static const auto* views = [] {
    auto* out = new std::vector<std::shared_ptr<const ShardView>>();
    for (const ShardDef& def : ShardDefs()) {
      std::shared_ptr<const ShardView> view =
          ShardView::Initial()->WithGroup(1, {kCustomGroup, CustomHyperparameters()});
      view = view->WithTensors(MetasOf(def, *view))->WithPlanHash(def.plan_hash);
      out->push_back(std::move(view));
    }
    return out;
  }();
  return *views;
}

EngineShard::EngineShard(const ShardDef& def) {
  BackendOptions options;
  options.threads = 1;
  engine_ = std::make_unique<UpdateEngine>(MakeCpuBackend(options), &fault_, &retries_);
  absl::StatusOr<char*> arena = engine_->AllocateStagingArena(kStagingBytes);
  RequireOk(arena.status(), "the staging arena");
  staging_ = std::make_unique<StagingPool>(kStagingBytes, *arena);

  RequireOk(UpdateEngine::Wait<bool>([&](UpdateEngine::Done<bool> done) {
              engine_->RegisterParamGroup({kCustomGroup, CustomHyperparameters()}, done);
            }).status(),
            "the custom group");
  if (def.tensors.empty()) return;
  const std::vector<TensorMeta> metas = MetasOf(def, *engine_->view());
  absl::StatusOr<uint32_t> first = UpdateEngine::Wait<uint32_t>(
      [&](UpdateEngine::Done<uint32_t> done) { engine_->BeginRegistration(metas, done); });
  RequireOk(first.status(), "the shard's tensors");
  std::vector<std::vector<float>> values;
  std::vector<ParamWrite> writes;
  for (uint32_t i = 0; i < metas.size(); ++i) {
    values.emplace_back(metas[i].numel, 1.0f);
    writes.push_back({*first + i, 0, values.back().data(), metas[i].numel});
  }
  RequireOk(UpdateEngine::Wait<bool>([&](UpdateEngine::Done<bool> done) {
              engine_->WriteParams(writes, done);
            }).status(),
            "the shard's values");
  RequireOk(UpdateEngine::Wait<uint64_t>([&](UpdateEngine::Done<uint64_t> done) {
              engine_->CommitRegistration(def.plan_hash, done);
            }).status(),
            "the shard's registration");
}

EngineShard::~EngineShard() {
  staging_.reset();
  engine_.reset();
}

std::vector<std::vector<float>> EngineShard::Read(TensorField field,
                                                  const std::vector<uint32_t>& tensors) {
  std::shared_ptr<const ShardView> view = engine_->view();
  ReadJob job;
  job.field = field;
  job.tensors = tensors;
  uint64_t bytes = 0;
  for (uint32_t t : tensors) {
    job.dst_offsets.push_back(bytes);
    bytes += view->tensor(t).numel * sizeof(float);
  }
  std::vector<float> all(bytes / sizeof(float));
  job.dst = all.data();
  RequireOk(UpdateEngine::Wait<ReadResult>([&](UpdateEngine::Done<ReadResult> done) {
              engine_->Read(std::move(job), done);
            }).status(),
            "a read");
  std::vector<std::vector<float>> out;
  uint64_t at = 0;
  for (uint32_t t : tensors) {
    const uint64_t numel = view->tensor(t).numel;
    out.emplace_back(all.begin() + at, all.begin() + at + numel);
    at += numel;
  }
  return out;
}

}  // namespace fusedps::fuzz
