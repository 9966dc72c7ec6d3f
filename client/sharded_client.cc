#include "fusedps/sharded_client.h"

#include <algorithm>
#include <cstddef>
#include <functional>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace fusedps::client {

// The plan, with each tensor's slices (indices into plan.slices(), by offset) by name.
struct ShardedClient::Layout {
  struct TensorSlices {
    const PlanTensor* tensor = nullptr;
    std::vector<size_t> slices;
  };

  explicit Layout(ShardPlan plan_in) : plan(std::move(plan_in)) {
    for (const PlanTensor& tensor : plan.tensors()) by_name[tensor.name].tensor = &tensor;
    for (size_t i = 0; i < plan.slices().size(); ++i) {
      by_name[plan.slices()[i].tensor].slices.push_back(i);
    }
  }

  // The tensor's entry. Errors: NOT_FOUND for a tensor not in the plan.
  absl::StatusOr<const TensorSlices*> Find(const std::string& name) const {
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      return absl::NotFoundError(absl::StrCat("tensor ", name, " is not in the shard plan"));
    }
    return &it->second;
  }

  const ShardPlan plan;
  absl::flat_hash_map<std::string, TensorSlices> by_name;
};

namespace {

// Runs fn(i) for each i in `shards`, each on a thread of its own, and returns the statuses by
// shard (OK for a shard not listed).
std::vector<absl::Status> ForEachShard(size_t shard_count, const std::vector<size_t>& shards,
                                       const std::function<absl::Status(size_t)>& fn) {
  std::vector<absl::Status> statuses(shard_count);
  std::vector<std::thread> threads;
  threads.reserve(shards.size());
  for (size_t shard : shards) {
    threads.emplace_back([&statuses, &fn, shard] { statuses[shard] = fn(shard); });
  }
  for (std::thread& thread : threads) thread.join();
  return statuses;
}

// The shards that have work: those whose list is not empty.
template <typename T>
std::vector<size_t> Busy(const std::vector<std::vector<T>>& per_shard) {
  std::vector<size_t> busy;
  for (size_t i = 0; i < per_shard.size(); ++i) {
    if (!per_shard[i].empty()) busy.push_back(i);
  }
  return busy;
}

// Checks that names are unique. Errors: INVALID_ARGUMENT naming the first repeated one.
template <typename T>
absl::Status CheckUnique(absl::Span<const T> items) {
  absl::flat_hash_set<absl::string_view> names;
  for (const T& item : items) {
    if (!names.insert(item.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", item.name, " is listed twice"));
    }
  }
  return absl::OkStatus();
}

uint64_t NumElements(const PlanTensor& tensor) {
  uint64_t numel = 1;
  for (int64_t dim : tensor.shape) numel *= static_cast<uint64_t>(dim);  // Checked by the plan.
  return numel;
}

absl::Status SizeError(const std::string& name, size_t size, const PlanTensor& tensor,
                       absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("tensor ", name, " has ", size, " ", what, " for ",
                                                 NumElements(tensor), " elements"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShardedClient>> ShardedClient::Create(
    const std::vector<std::string>& targets, ClientOptions options) {
  if (targets.empty()) return absl::InvalidArgumentError("ShardedClient needs a target");
  std::vector<Shard> shards;
  for (size_t i = 0; i < targets.size(); ++i) {
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(targets[i], options);
    if (!client.ok()) {
      return absl::Status(client.status().code(),
                          absl::StrCat("target ", i, ": ", client.status().message()));
    }
    shards.push_back({absl::StrCat("shard ", i, " (", targets[i], ")"), *std::move(client)});
  }
  return absl::WrapUnique(new ShardedClient(std::move(shards)));
}

absl::StatusOr<std::unique_ptr<ShardedClient>> ShardedClient::CreateWithChannels(
    std::vector<std::shared_ptr<grpc::Channel>> channels, ClientOptions options) {
  if (channels.empty()) return absl::InvalidArgumentError("ShardedClient needs a channel");
  std::vector<Shard> shards;
  for (size_t i = 0; i < channels.size(); ++i) {
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::CreateWithChannel(std::move(channels[i]), options);
    if (!client.ok()) {
      return absl::Status(client.status().code(),
                          absl::StrCat("channel ", i, ": ", client.status().message()));
    }
    shards.push_back({absl::StrCat("shard ", i), *std::move(client)});
  }
  return absl::WrapUnique(new ShardedClient(std::move(shards)));
}

ShardedClient::ShardedClient(std::vector<Shard> shards)
    : shards_(std::move(shards)), versions_(shards_.size(), 0) {}

ShardedClient::~ShardedClient() = default;

absl::Status ShardedClient::RegisterParamGroup(const std::string& name,
                                               const ParamGroupOptions& options) {
  std::vector<size_t> all(shards_.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  const std::vector<absl::Status> statuses = ForEachShard(shards_.size(), all, [&](size_t i) {
    return shards_[i].client->RegisterParamGroup(name, options).status();
  });
  if (absl::Status status = FirstError(statuses); !status.ok()) return status;
  return absl::OkStatus();
}

template <typename T, typename Call>
absl::Status ShardedClient::CallShards(const std::vector<size_t>& shards, std::vector<T>* results,
                                       Call call) {
  return FirstError(ForEachShard(shards_.size(), shards, [&](size_t i) -> absl::Status {
    absl::StatusOr<T> result = call(i);
    if (!result.ok()) return result.status();
    (*results)[i] = *std::move(result);
    SetVersion(i, (*results)[i].version);
    return absl::OkStatus();
  }));
}

absl::StatusOr<std::vector<RegisterTensorsResult>> ShardedClient::Register(
    absl::Span<const TensorInit> tensors, uint64_t slice_elements) {
  if (tensors.empty()) return absl::InvalidArgumentError("Register needs a tensor");
  std::vector<PlanTensor> model;
  model.reserve(tensors.size());
  for (const TensorInit& tensor : tensors) {
    model.push_back({tensor.name, tensor.shape, tensor.param_group});
  }
  absl::StatusOr<ShardPlan> plan =
      ShardPlan::Make(model, static_cast<uint32_t>(shards_.size()), slice_elements);
  if (!plan.ok()) return plan.status();
  // Sizes are checked before the plan replaces the current one.
  for (const TensorInit& tensor : tensors) {
    const PlanTensor plan_tensor{tensor.name, tensor.shape, tensor.param_group};
    if (tensor.values.size() != NumElements(plan_tensor)) {
      return SizeError(tensor.name, tensor.values.size(), plan_tensor, "values");
    }
  }
  if (absl::Status status = SetPlan(*std::move(plan)); !status.ok()) return status;
  return RegisterTensors(tensors);
}

absl::Status ShardedClient::SetPlan(ShardPlan plan) {
  if (plan.shards() != shards_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the plan has ", plan.shards(), " shards; this client has ", shards_.size()));
  }
  auto layout = std::make_shared<const Layout>(std::move(plan));
  MutexLock lock(&mu_);
  layout_ = std::move(layout);
  return absl::OkStatus();
}

std::shared_ptr<const ShardPlan> ShardedClient::plan() const {
  MutexLock lock(&mu_);
  if (layout_ == nullptr) return nullptr;
  return std::shared_ptr<const ShardPlan>(layout_, &layout_->plan);
}

absl::StatusOr<std::shared_ptr<const ShardedClient::Layout>> ShardedClient::layout() const {
  MutexLock lock(&mu_);
  if (layout_ == nullptr) {
    return absl::FailedPreconditionError("no shard plan yet: call Register or SetPlan first");
  }
  return layout_;
}

absl::Status ShardedClient::FirstError(const std::vector<absl::Status>& statuses) const {
  for (size_t i = 0; i < statuses.size(); ++i) {
    if (!statuses[i].ok()) {
      return absl::Status(statuses[i].code(),
                          absl::StrCat(shards_[i].name, ": ", statuses[i].message()));
    }
  }
  return absl::OkStatus();
}

std::vector<uint64_t> ShardedClient::versions() const {
  MutexLock lock(&mu_);
  return versions_;
}

void ShardedClient::SetVersion(size_t shard, uint64_t version) {
  MutexLock lock(&mu_);
  versions_[shard] = version;
}

absl::StatusOr<std::vector<RegisterTensorsResult>> ShardedClient::RegisterTensors(
    absl::Span<const TensorInit> tensors) {
  absl::StatusOr<std::shared_ptr<const Layout>> layout = this->layout();
  if (!layout.ok()) return layout.status();
  const ShardPlan& plan = (*layout)->plan;
  if (absl::Status status = CheckUnique(tensors); !status.ok()) return status;
  // values of each slice's tensor, by slice index; each shard's slices in plan order.
  std::vector<absl::Span<const float>> values(plan.slices().size());
  std::vector<bool> listed(plan.slices().size(), false);
  for (const TensorInit& tensor : tensors) {
    absl::StatusOr<const Layout::TensorSlices*> found = (*layout)->Find(tensor.name);
    if (!found.ok()) return found.status();
    const PlanTensor& planned = *(*found)->tensor;
    const std::string group = tensor.param_group.empty() ? "default" : tensor.param_group;
    if (tensor.shape != planned.shape || group != planned.param_group) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", tensor.name, " differs in shape or group from the plan's"));
    }
    if (tensor.values.size() != NumElements(planned)) {
      return SizeError(tensor.name, tensor.values.size(), planned, "values");
    }
    for (size_t s : (*found)->slices) {
      listed[s] = true;
      values[s] = tensor.values;
    }
  }
  std::vector<std::vector<TensorInit>> inits(shards_.size());
  for (size_t s = 0; s < plan.slices().size(); ++s) {
    if (!listed[s]) continue;
    const PlanSlice& slice = plan.slices()[s];
    inits[slice.shard].push_back({slice.server_tensor, slice.server_shape, slice.param_group,
                                  values[s].subspan(slice.begin, slice.numel())});
  }
  std::vector<RegisterTensorsResult> results(shards_.size());
  if (absl::Status status = CallShards(
          Busy(inits), &results,
          [&](size_t i) { return shards_[i].client->RegisterTensors(inits[i], plan.hash()); });
      !status.ok()) {
    return status;
  }
  return results;
}

absl::StatusOr<std::vector<PushResult>> ShardedClient::PushGradients(
    const PushOptions& options, absl::Span<const TensorGrad> grads,
    absl::Span<const uint64_t> base_versions) {
  if (grads.empty()) return absl::InvalidArgumentError("PushGradients needs a tensor");
  if (!base_versions.empty() && base_versions.size() != shards_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("base_versions has ", base_versions.size(),
                                                   " entries for ", shards_.size(), " shards"));
  }
  absl::StatusOr<std::shared_ptr<const Layout>> layout = this->layout();
  if (!layout.ok()) return layout.status();
  const ShardPlan& plan = (*layout)->plan;
  if (absl::Status status = CheckUnique(grads); !status.ok()) return status;
  std::vector<std::vector<TensorGrad>> per_shard(shards_.size());
  for (const TensorGrad& grad : grads) {
    absl::StatusOr<const Layout::TensorSlices*> found = (*layout)->Find(grad.name);
    if (!found.ok()) return found.status();
    if (grad.grads.size() != NumElements(*(*found)->tensor)) {
      return SizeError(grad.name, grad.grads.size(), *(*found)->tensor, "gradients");
    }
    for (size_t s : (*found)->slices) {
      const PlanSlice& slice = plan.slices()[s];
      per_shard[slice.shard].push_back(
          {slice.server_tensor, grad.grads.subspan(slice.begin, slice.numel())});
    }
  }
  const std::vector<uint64_t> seen = versions();
  if (base_versions.empty()) base_versions = seen;
  std::vector<PushResult> results(shards_.size());
  for (size_t i = 0; i < results.size(); ++i) results[i].version = seen[i];
  if (absl::Status status = CallShards(Busy(per_shard), &results,
                                       [&](size_t i) {
                                         PushOptions shard_options = options;
                                         shard_options.base_version = base_versions[i];
                                         shard_options.plan_hash = plan.hash();
                                         return shards_[i].client->PushGradients(shard_options,
                                                                                 per_shard[i]);
                                       });
      !status.ok()) {
    return status;
  }
  return results;
}

absl::StatusOr<ShardedPullResult> ShardedClient::PullParameters(const PullOptions& options) {
  absl::StatusOr<std::shared_ptr<const Layout>> layout = this->layout();
  if (!layout.ok()) return layout.status();
  const ShardPlan& plan = (*layout)->plan;
  std::vector<const Layout::TensorSlices*> wanted;
  absl::flat_hash_set<absl::string_view> unique(options.tensors.begin(), options.tensors.end());
  if (unique.size() != options.tensors.size()) {
    return absl::InvalidArgumentError("PullParameters lists a tensor twice");
  }
  if (options.tensors.empty()) {
    for (const PlanTensor& tensor : plan.tensors()) wanted.push_back(*(*layout)->Find(tensor.name));
  }
  for (const std::string& name : options.tensors) {
    absl::StatusOr<const Layout::TensorSlices*> found = (*layout)->Find(name);
    if (!found.ok()) return found.status();
    wanted.push_back(*found);
  }
  std::vector<std::vector<std::string>> names(shards_.size());
  for (const Layout::TensorSlices* tensor : wanted) {
    for (size_t s : tensor->slices) {
      names[plan.slices()[s].shard].push_back(plan.slices()[s].server_tensor);
    }
  }
  ShardedPullResult result;
  result.versions = versions();
  std::vector<PullResult> pulled(shards_.size());
  if (absl::Status status = CallShards(Busy(names), &pulled,
                                       [&](size_t i) {
                                         PullOptions shard_options = options;
                                         shard_options.tensors = names[i];
                                         return shards_[i].client->PullParameters(shard_options);
                                       });
      !status.ok()) {
    return status;
  }
  for (size_t i = 0; i < shards_.size(); ++i) {
    if (!names[i].empty()) result.versions[i] = pulled[i].version;
  }
  // Gathers each tensor from its slices.
  for (const Layout::TensorSlices* tensor : wanted) {
    PulledTensor& whole = result.tensors[tensor->tensor->name];
    whole.shape = tensor->tensor->shape;
    whole.param_group = tensor->tensor->param_group;
    whole.values.resize(NumElements(*tensor->tensor));
    for (size_t k = 0; k < tensor->slices.size(); ++k) {
      const PlanSlice& slice = plan.slices()[tensor->slices[k]];
      auto it = pulled[slice.shard].tensors.find(slice.server_tensor);
      if (it == pulled[slice.shard].tensors.end() || it->second.values.size() != slice.numel()) {
        return absl::InternalError(absl::StrCat(shards_[slice.shard].name, " returned no ",
                                                slice.numel(), " values of ", slice.server_tensor));
      }
      if (tensor->slices.size() == 1) {
        whole.values = std::move(it->second.values);
      } else {
        std::copy(it->second.values.begin(), it->second.values.end(),
                  whole.values.begin() + static_cast<ptrdiff_t>(slice.begin));
      }
      whole.step = k == 0 ? it->second.step : std::min(whole.step, it->second.step);
    }
  }
  return result;
}

}  // namespace fusedps::client
