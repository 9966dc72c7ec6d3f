// The C ABI of fusedps_c.h over fc::Client.
#include "fusedps_c.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "fusedps/client.h"
#include "fusedps/pipelined_pull.h"

namespace fc = fusedps::client;

struct fusedps_client {
  std::unique_ptr<fc::Client> client;
};

struct fusedps_push {
  std::unique_ptr<fc::PushTransaction> push;
};

struct fusedps_pipelined_pull {
  std::unique_ptr<fc::PipelinedPull> pull;
};

namespace {

// A C string option: NULL reads as "".
std::string OptionalString(const char* s) { return s != nullptr ? s : ""; }

void CopyString(const std::string& from, char* to, size_t size) {
  const size_t n = std::min(from.size(), size - 1);
  std::memcpy(to, from.data(), n);
  to[n] = '\0';
}

// Reports the status of a call (local = false) or an error in the caller's arguments found
// here (local = true; fusedps_error.local).
int32_t Report(const absl::Status& status, fusedps_error* error, bool local = false) {
  const int32_t code = static_cast<int32_t>(status.code());
  if (error != nullptr) {
    error->code = code;
    error->local = local ? 1 : 0;
    CopyString(std::string(status.message()), error->message, sizeof(error->message));
  }
  return code;
}

// Reports a pull's status: a target of another size than the server's tensor (PullInto's
// INVALID_ARGUMENT "...; its target ...") is the caller's mistake, found against the reply.
int32_t ReportPull(const absl::Status& status, fusedps_error* error) {
  const bool local = absl::IsInvalidArgument(status) &&
                     status.message().find("; its target") != absl::string_view::npos;
  return Report(status, error, local);
}

absl::StatusOr<fc::DType> ToDType(int32_t dtype, bool pull) {
  switch (dtype) {
    case 1:
      return fc::DType::kFloat32;
    case 2:
      return fc::DType::kBFloat16;
    case 3:
      if (!pull) return fc::DType::kFloat16;
      break;
    default:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "dtype ", dtype, " is not ",
      pull ? "1 (float32) or 2 (bfloat16)" : "1, 2 or 3 (float32, bfloat16, float16)"));
}

absl::StatusOr<fc::TensorField> ToField(int32_t field) {
  if (field < 1 || field > 4) {
    return absl::InvalidArgumentError(absl::StrCat("field ", field, " is not in [1, 4]"));
  }
  return static_cast<fc::TensorField>(field);
}

// The options of a pull of `dtype` (1 float32, 2 bfloat16) and `field`, both checked.
absl::StatusOr<fc::PullOptions> PullOptionsOf(int32_t dtype, int32_t field) {
  absl::StatusOr<fc::DType> wire = ToDType(dtype, /*pull=*/true);
  if (!wire.ok()) return wire.status();
  absl::StatusOr<fc::TensorField> tensor_field = ToField(field);
  if (!tensor_field.ok()) return tensor_field.status();
  fc::PullOptions options;
  options.dtype = *wire;
  options.field = *tensor_field;
  return options;
}

void CopyResult(const fc::PushResult& pushed, fusedps_push_result* result) {
  result->version = pushed.version;
  result->step_skipped = pushed.step_skipped ? 1 : 0;
  CopyString(pushed.skip_reason, result->skip_reason, sizeof(result->skip_reason));
  result->tensors_updated = pushed.tensors_updated;
  result->grad_bytes = pushed.grad_bytes;
  result->duplicate = pushed.duplicate ? 1 : 0;
  result->round_workers = pushed.round_workers;
  result->round_timed_out = pushed.round_timed_out ? 1 : 0;
  CopyString(absl::StrJoin(pushed.missing_replicas, ","), result->missing_replicas,
             sizeof(result->missing_replicas));
  result->pulled_version = pushed.pulled_version;
}

// The push options of a C header; the dtype is checked.
absl::StatusOr<fc::PushOptions> PushOptionsOf(const fusedps_push_header& header) {
  absl::StatusOr<fc::DType> dtype = ToDType(header.grad_dtype, /*pull=*/false);
  if (!dtype.ok()) return dtype.status();
  fc::PushOptions options;
  options.client_id = header.client_id != nullptr ? header.client_id : "";
  options.sequence_number = header.sequence_number;
  options.grad_dtype = *dtype;
  if (header.grad_scale > 0) options.grad_scale = header.grad_scale;
  options.base_version = header.base_version;
  options.plan_hash = header.plan_hash != nullptr ? header.plan_hash : "";
  options.max_parts = header.max_parts;
  return options;
}

}  // namespace

extern "C" {

int32_t fusedps_c_api_version(void) { return FUSEDPS_C_API_VERSION; }

fusedps_client* fusedps_client_create(const char* target, const fusedps_client_options* options,
                                      fusedps_error* error) {
  if (target == nullptr || options == nullptr) {
    Report(absl::InvalidArgumentError("target and options must not be NULL"), error, true);
    return nullptr;
  }
  fc::ClientOptions client_options;
  client_options.max_chunk_bytes = options->max_chunk_bytes;
  client_options.streams = options->streams;
  client_options.timeout = options->timeout_seconds > 0 ? absl::Seconds(options->timeout_seconds)
                                                        : absl::InfiniteDuration();
  if (!(options->min_bytes_per_second >= 0)) {
    Report(absl::InvalidArgumentError(absl::StrCat("min_bytes_per_second must be >= 0, got ",
                                                   options->min_bytes_per_second)),
           error, true);
    return nullptr;
  }
  client_options.min_bytes_per_second = static_cast<uint64_t>(options->min_bytes_per_second);
  client_options.tls = options->tls != 0;
  client_options.tls_ca_file = OptionalString(options->tls_ca_file);
  client_options.tls_cert_file = OptionalString(options->tls_cert_file);
  client_options.tls_key_file = OptionalString(options->tls_key_file);
  client_options.token = OptionalString(options->token);
  client_options.model = OptionalString(options->model);
  absl::StatusOr<std::unique_ptr<fc::Client>> client = fc::Client::Create(target, client_options);
  if (!client.ok()) {
    Report(client.status(), error, true);  // Bad options, or TLS files that cannot be read.
    return nullptr;
  }
  return new fusedps_client{std::move(*client)};
}

void fusedps_client_destroy(fusedps_client* client) { delete client; }

int32_t fusedps_client_wait_ready(fusedps_client* client, double timeout_seconds,
                                  fusedps_error* error) {
  if (client == nullptr || !(timeout_seconds >= 0)) {
    return Report(absl::InvalidArgumentError("a NULL client, or a negative timeout"), error, true);
  }
  return Report(client->client->WaitForReady(absl::Seconds(timeout_seconds)), error);
}

int32_t fusedps_client_set_workspace(fusedps_client* client, const char* workspace_id,
                                     const void* data, uint64_t bytes, fusedps_error* error) {
  if (client == nullptr) return Report(absl::InvalidArgumentError("a NULL client"), error, true);
  fc::Workspace workspace;
  if (workspace_id != nullptr && workspace_id[0] != '\0') {
    if (data == nullptr || bytes == 0) {
      return Report(absl::InvalidArgumentError("a workspace with no memory"), error, true);
    }
    workspace = fc::Workspace{workspace_id, static_cast<const char*>(data), bytes};
  }
  client->client->SetWorkspace(std::move(workspace));
  return Report(absl::OkStatus(), error);
}

int32_t fusedps_push_gradients(fusedps_client* client, const fusedps_push_header* header,
                               size_t count, const char* const* names, const float* const* grads,
                               const uint64_t* numels, fusedps_push_result* result,
                               fusedps_error* error) {
  if (client == nullptr || header == nullptr || result == nullptr ||
      (count > 0 && (names == nullptr || grads == nullptr || numels == nullptr))) {
    return Report(absl::InvalidArgumentError("a required pointer is NULL"), error, true);
  }
  absl::StatusOr<fc::PushOptions> options = PushOptionsOf(*header);
  if (!options.ok()) return Report(options.status(), error, true);
  std::vector<fc::TensorGrad> tensor_grads(count);
  for (size_t i = 0; i < count; ++i) {
    tensor_grads[i].name = names[i];
    tensor_grads[i].grads = absl::MakeConstSpan(grads[i], numels[i]);
  }
  absl::StatusOr<fc::PushResult> pushed = client->client->PushGradients(*options, tensor_grads);
  if (!pushed.ok()) return Report(pushed.status(), error);
  CopyResult(*pushed, result);
  return Report(absl::OkStatus(), error);
}

fusedps_push* fusedps_push_begin(fusedps_client* client, const fusedps_push_header* header,
                                 size_t count, const char* const* names, const uint64_t* numels,
                                 fusedps_error* error) {
  if (client == nullptr || header == nullptr || count == 0 || names == nullptr ||
      numels == nullptr) {
    Report(absl::InvalidArgumentError("a required pointer is NULL, or count is 0"), error, true);
    return nullptr;
  }
  absl::StatusOr<fc::PushOptions> options = PushOptionsOf(*header);
  if (!options.ok()) {
    Report(options.status(), error, true);
    return nullptr;
  }
  options->grad_scale.reset();  // The commit carries it.
  std::vector<fc::TensorSize> tensors(count);
  for (size_t i = 0; i < count; ++i) tensors[i] = {names[i], numels[i]};
  absl::StatusOr<std::unique_ptr<fc::PushTransaction>> push =
      client->client->BeginPush(*options, tensors);
  if (!push.ok()) {
    Report(push.status(), error, true);
    return nullptr;
  }
  Report(absl::OkStatus(), error);
  return new fusedps_push{std::move(*push)};
}

int32_t fusedps_push_write(fusedps_push* push, size_t count, const uint64_t* tensors,
                           const uint64_t* offsets, const uint64_t* counts, const void* const* data,
                           fusedps_error* error) {
  if (push == nullptr || (count > 0 && (tensors == nullptr || offsets == nullptr ||
                                        counts == nullptr || data == nullptr))) {
    return Report(absl::InvalidArgumentError("a required pointer is NULL"), error, true);
  }
  std::vector<fc::PushTransaction::Piece> pieces(count);
  for (size_t i = 0; i < count; ++i) {
    pieces[i] = {static_cast<size_t>(tensors[i]), offsets[i], counts[i], data[i]};
  }
  const absl::Status written = push->push->Write(pieces);
  return Report(written, error, absl::IsInvalidArgument(written));
}

int32_t fusedps_push_commit(fusedps_push* push, float grad_scale, fusedps_push_result* result,
                            fusedps_error* error) {
  if (push == nullptr || result == nullptr) {
    return Report(absl::InvalidArgumentError("a required pointer is NULL"), error, true);
  }
  absl::StatusOr<fc::PushResult> pushed =
      push->push->Commit(grad_scale > 0 ? std::optional<float>(grad_scale) : std::nullopt);
  if (!pushed.ok()) return Report(pushed.status(), error);
  CopyResult(*pushed, result);
  return Report(absl::OkStatus(), error);
}

int32_t fusedps_push_commit_pull(fusedps_push* push, float grad_scale, int32_t dtype, size_t count,
                                 const char* const* names, void* const* dst, const uint64_t* numels,
                                 fusedps_push_result* result, fusedps_error* error) {
  if (push == nullptr || result == nullptr || count == 0 || names == nullptr || dst == nullptr ||
      numels == nullptr) {
    return Report(absl::InvalidArgumentError("a required pointer is NULL, or count is 0"), error,
                  true);
  }
  absl::StatusOr<fc::DType> pull_dtype = ToDType(dtype, /*pull=*/true);
  if (!pull_dtype.ok()) return Report(pull_dtype.status(), error, true);
  std::vector<fc::PullTarget> targets(count);
  for (size_t i = 0; i < count; ++i) targets[i] = {names[i], dst[i], numels[i]};
  absl::StatusOr<fc::PushResult> pushed = push->push->Commit(
      grad_scale > 0 ? std::optional<float>(grad_scale) : std::nullopt, *pull_dtype, targets);
  if (!pushed.ok()) return Report(pushed.status(), error);
  CopyResult(*pushed, result);
  return Report(absl::OkStatus(), error);
}

void fusedps_push_cancel(fusedps_push* push) {
  if (push != nullptr) push->push->Cancel();
}

void fusedps_push_destroy(fusedps_push* push) { delete push; }

int32_t fusedps_pull_into(fusedps_client* client, int32_t stream, int32_t dtype, int32_t field,
                          size_t count, const char* const* names, void* const* dst,
                          const uint64_t* numels, uint64_t* version, int64_t* steps,
                          fusedps_error* error) {
  if (client == nullptr || version == nullptr || count == 0 || names == nullptr || dst == nullptr ||
      numels == nullptr || steps == nullptr || stream < 0) {
    return Report(
        absl::InvalidArgumentError("a required pointer is NULL, count is 0 or stream < 0"), error,
        true);
  }
  absl::StatusOr<fc::PullOptions> options = PullOptionsOf(dtype, field);
  if (!options.ok()) return Report(options.status(), error, true);
  std::vector<fc::PullTarget> targets(count);
  for (size_t i = 0; i < count; ++i) targets[i] = {names[i], dst[i], numels[i]};
  absl::StatusOr<fc::PullIntoResult> pulled = client->client->PullInto(*options, targets, stream);
  if (!pulled.ok()) return ReportPull(pulled.status(), error);
  *version = pulled->version;
  std::copy(pulled->steps.begin(), pulled->steps.end(), steps);
  return Report(absl::OkStatus(), error);
}

int32_t fusedps_pull(fusedps_client* client, int32_t dtype, int32_t field, size_t count,
                     const char* const* names, float* const* dst, const uint64_t* ranks,
                     const int64_t* dims, uint64_t* version, int64_t* steps, fusedps_error* error) {
  if (client == nullptr || version == nullptr || count == 0 || names == nullptr || dst == nullptr ||
      ranks == nullptr || dims == nullptr || steps == nullptr) {
    return Report(absl::InvalidArgumentError("a required pointer is NULL, or count is 0"), error,
                  true);
  }
  absl::StatusOr<fc::PullOptions> options = PullOptionsOf(dtype, field);
  if (!options.ok()) return Report(options.status(), error, true);
  options->tensors.assign(names, names + count);
  absl::StatusOr<fc::PullResult> pulled = client->client->PullParameters(*options);
  if (!pulled.ok()) return Report(pulled.status(), error);
  const int64_t* shape = dims;
  for (size_t i = 0; i < count; ++i) {
    auto it = pulled->tensors.find(names[i]);
    if (it == pulled->tensors.end()) {
      return Report(
          absl::InternalError(absl::StrCat("the pull's reply lacks tensor '", names[i], "'")),
          error);
    }
    const std::vector<int64_t> expected(shape, shape + ranks[i]);
    shape += ranks[i];
    if (it->second.shape != expected) {
      return Report(
          absl::InvalidArgumentError(absl::StrCat(
              "tensor '", names[i], "': server shape [", absl::StrJoin(it->second.shape, ", "),
              "] != local shape [", absl::StrJoin(expected, ", "), "]")),
          error, true);
    }
    const std::vector<float>& values = it->second.values;
    std::memcpy(dst[i], values.data(), values.size() * sizeof(float));
    steps[i] = it->second.step;
  }
  *version = pulled->version;
  return Report(absl::OkStatus(), error);
}

}  // extern "C"

fusedps_pipelined_pull* fusedps_pipelined_pull_start(fusedps_client* const* clients,
                                                     size_t client_count, int32_t dtype,
                                                     int32_t field, int32_t threads, size_t groups,
                                                     size_t count, const uint64_t* group_of,
                                                     const uint64_t* client_of,
                                                     const char* const* names, void* const* dst,
                                                     const uint64_t* numels, fusedps_error* error) {
  if (clients == nullptr || client_count == 0 || groups == 0 || count == 0 || group_of == nullptr ||
      client_of == nullptr || names == nullptr || dst == nullptr || numels == nullptr) {
    Report(absl::InvalidArgumentError("a required pointer is NULL, or a count is 0"), error, true);
    return nullptr;
  }
  absl::StatusOr<fc::PullOptions> options = PullOptionsOf(dtype, field);
  if (!options.ok()) {
    Report(options.status(), error, true);
    return nullptr;
  }
  std::vector<fc::Client*> cs(client_count);
  for (size_t c = 0; c < client_count; ++c) {
    if (clients[c] == nullptr) {
      Report(absl::InvalidArgumentError(absl::StrCat("clients[", c, "] is NULL")), error, true);
      return nullptr;
    }
    cs[c] = clients[c]->client.get();
  }
  std::vector<fc::PipelinedPull::Group> made(groups);
  for (size_t i = 0; i < count; ++i) {
    const uint64_t g = group_of[i], c = client_of[i];
    if (g >= groups || c >= client_count || (i > 0 && g < group_of[i - 1]) || names[i] == nullptr ||
        dst[i] == nullptr) {
      Report(absl::InvalidArgumentError(
                 absl::StrCat("target ", i, ": group ", g, " of ", groups, ", client ", c, " of ",
                              client_count, " (groups nondecreasing, names and dst not NULL)")),
             error, true);
      return nullptr;
    }
    fc::PipelinedPull::Group& group = made[g];
    auto part = std::find_if(group.begin(), group.end(),
                             [&](const auto& p) { return p.first == static_cast<int>(c); });
    if (part == group.end()) part = group.insert(group.end(), {static_cast<int>(c), {}});
    part->second.push_back({names[i], dst[i], numels[i]});
  }
  auto* pull = new fusedps_pipelined_pull;
  pull->pull = std::make_unique<fc::PipelinedPull>(std::move(cs), *std::move(options),
                                                   std::move(made), threads);
  Report(absl::OkStatus(), error);
  return pull;
}

int32_t fusedps_pipelined_pull_wait(fusedps_pipelined_pull* pull, int64_t group,
                                    fusedps_error* error) {
  if (pull == nullptr || group < 0) {
    return Report(absl::InvalidArgumentError("pull is NULL or group < 0"), error, true);
  }
  return ReportPull(
      pull->pull->WaitUpTo(static_cast<int>(std::min<int64_t>(group, pull->pull->groups() - 1))),
      error);
}

int64_t fusedps_pipelined_pull_landed(fusedps_pipelined_pull* pull) {
  return pull == nullptr ? 0 : pull->pull->LandedPrefix();
}

uint64_t fusedps_pipelined_pull_version(fusedps_pipelined_pull* pull, size_t client) {
  return pull == nullptr ? 0 : pull->pull->Version(static_cast<int>(client));
}

double fusedps_pipelined_pull_seconds(fusedps_pipelined_pull* pull) {
  return pull == nullptr ? 0 : pull->pull->Seconds();
}

void fusedps_pipelined_pull_destroy(fusedps_pipelined_pull* pull) { delete pull; }
