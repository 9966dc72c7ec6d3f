// corpus_gen: writes the seed corpus of the fuzz targets: the calls the tests make (good ones
// and the bad ones of tests/integration/service_bad_input_test.cc), on the fuzz shards, in the
// targets' input format (fuzz_input.h).
//
//   fuzz_corpus_gen DIR   writes DIR/<target>/seed_<name> for every target
#include <sys/stat.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "fusedps/v1/parameter_service.pb.h"
#include "kernels/adamw_math.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/fuzz_shards.h"

namespace fusedps::fuzz {
namespace {

std::string F32(uint64_t count, uint32_t seed) {
  std::string bytes(count * 4, '\0');
  uint32_t x = seed * 2654435761u + 1;
  for (uint64_t i = 0; i < count; ++i) {
    x = x * 1664525u + 1013904223u;
    const float v = static_cast<float>(x >> 8) / 16777216.0f - 0.5f;
    std::memcpy(&bytes[i * 4], &v, 4);
  }
  return bytes;
}

std::string Half(uint64_t count, uint16_t bits) {
  std::string bytes(count * 2, '\0');
  for (uint64_t i = 0; i < count; ++i) std::memcpy(&bytes[i * 2], &bits, 2);
  return bytes;
}

v1::TensorChunk Chunk(const std::string& tensor, uint64_t offset, std::string data, int field = 0) {
  v1::TensorChunk c;
  c.set_tensor(tensor);
  c.set_offset(offset);
  c.set_data(std::move(data));
  c.set_field(static_cast<v1::TensorField>(field));
  return c;
}

uint64_t Numel(const TensorSpec& spec) { return *NumelOf(spec.shape); }

// Every tensor of `def` but the large ones as chunks of `element_size` bytes, the larger ones in
// two.
std::vector<v1::TensorChunk> AllChunks(const ShardDef& def, int element_size, uint32_t seed,
                                       int field = 0) {
  std::vector<v1::TensorChunk> chunks;
  for (const TensorSpec& t : def.tensors) {
    const uint64_t n = Numel(t);
    if (n == 0 || n > 4096) continue;
    const std::string bytes = element_size == 4 ? F32(n, seed++) : Half(n, 0x3c00);
    const uint64_t half = n > 4 ? n / 2 : n;
    chunks.push_back(Chunk(t.name, 0, bytes.substr(0, half * element_size), field));
    if (half < n) chunks.push_back(Chunk(t.name, half, bytes.substr(half * element_size), field));
  }
  return chunks;
}

// A call as the tests send it: the header and `in_first` chunks, then the others in at most
// seven more messages (the targets read eight), one chunk per message when they fit.
template <typename Request, typename Header>
std::vector<std::string> Call(const Header& header, const std::vector<v1::TensorChunk>& chunks,
                              size_t in_first = 0) {
  std::vector<Request> messages(1);
  *messages[0].mutable_header() = header;
  const size_t rest = chunks.size() > in_first ? chunks.size() - in_first : 0;
  const size_t per_message = (rest + 6) / 7;
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (i >= in_first && (i - in_first) % per_message == 0) messages.emplace_back();
    *messages.back().add_chunks() = chunks[i];
  }
  std::vector<std::string> out;
  for (const Request& m : messages) out.push_back(m.SerializeAsString());
  return out;
}

// The tensors of `def` small enough for a seed (not "big").
std::vector<TensorSpec> Small(const std::vector<TensorSpec>& tensors) {
  std::vector<TensorSpec> small;
  for (const TensorSpec& t : tensors) {
    if (Numel(t) <= 4096) small.push_back(t);
  }
  return small;
}

// The tensors a seed's push names: none (every tensor) when all are small.
std::vector<std::string> Pushed(const ShardDef& def) {
  std::vector<std::string> names;
  if (Small(def.tensors).size() == def.tensors.size()) return names;
  for (const TensorSpec& t : Small(def.tensors)) names.push_back(t.name);
  return names;
}

class Writer {
 public:
  explicit Writer(std::string dir) : dir_(std::move(dir)) { mkdir(dir_.c_str(), 0755); }
  void Write(const std::string& target, const std::string& name, const std::string& bytes) {
    const std::string dir = dir_ + "/" + target;
    mkdir(dir.c_str(), 0755);
    std::ofstream out(dir + "/seed_" + name, std::ios::binary);
    out << bytes;
    if (!out) {
      std::fprintf(stderr, "corpus_gen: cannot write %s/seed_%s\n", dir.c_str(), name.c_str());
      failed_ = true;
    }
  }
  bool failed() const { return failed_; }

 private:
  const std::string dir_;
  bool failed_ = false;
};

v1::PushHeader PushHeader(const ShardDef& def, v1::DType dtype,
                          const std::vector<std::string>& tensors = {}) {
  v1::PushHeader h;
  h.set_client_id("trainer-0");
  h.set_sequence_number(1);
  h.set_grad_dtype(dtype);
  h.set_plan_hash(def.plan_hash);
  for (const std::string& t : tensors) h.add_tensors(t);
  return h;
}

void PushMessageSeeds(Writer& w) {
  const ShardDef& def = ShardDefs()[0];
  const std::vector<v1::TensorChunk> chunks = AllChunks(def, 4, 1);
  v1::PushGradientsRequest first;
  *first.mutable_header() = PushHeader(def, v1::DTYPE_FLOAT32, {"w", "b"});
  first.mutable_header()->set_grad_scale(1024.0f);
  *first.add_chunks() = chunks[0];
  *first.add_chunks() = Chunk("e", 0, "");
  v1::PushGradientsRequest more;
  for (const v1::TensorChunk& c : chunks) *more.add_chunks() = c;
  // A chunk whose data comes first (legal protobuf, from an unusual writer), and a field the
  // reader does not know (TensorChunk.field).
  std::string odd_chunk;
  {
    v1::TensorChunk data_only = Chunk("", 0, F32(3, 9));
    v1::TensorChunk rest = Chunk("b", 7, "", 2);
    odd_chunk = data_only.SerializeAsString() + rest.SerializeAsString();
  }
  std::string odd = std::string(1, static_cast<char>(2 << 3 | 2)) +
                    std::string(1, static_cast<char>(odd_chunk.size())) + odd_chunk;
  const std::vector<std::pair<std::string, std::string>> messages = {
      {"header_and_chunks", first.SerializeAsString()},
      {"chunks", more.SerializeAsString()},
      {"header_only", Call<v1::PushGradientsRequest>(first.header(), {})[0]},
      {"data_first", odd},
      {"empty", ""},
  };
  const uint8_t slicings[] = {0, 7, 0x41};
  for (const auto& [name, bytes] : messages) {
    for (uint8_t slicing : slicings) {
      w.Write("push_message_fuzz", name + "_slicing" + std::to_string(slicing),
              std::string{0, static_cast<char>(slicing)} + bytes);
    }
  }
  w.Write("push_message_fuzz", "refuse_second", std::string{6, 0} + more.SerializeAsString());
}

void PushCheckSeeds(Writer& w) {
  const char* target = "push_checks_fuzz";
  for (uint8_t s = 0; s < ShardDefs().size(); ++s) {
    const ShardDef& def = ShardDefs()[s];
    const std::string at = "shard" + std::to_string(s) + "_";
    const std::vector<v1::TensorChunk> f32 = AllChunks(def, 4, 3);
    w.Write(target, at + "f32",
            EncodeFuzzInput(s, 0,
                            Call<v1::PushGradientsRequest>(
                                PushHeader(def, v1::DTYPE_FLOAT32, Pushed(def)), f32, 1)));
    w.Write(target, at + "bf16_sliced",
            EncodeFuzzInput(
                s, 5,
                Call<v1::PushGradientsRequest>(PushHeader(def, v1::DTYPE_BFLOAT16, Pushed(def)),
                                               AllChunks(def, 2, 4))));
    v1::PushHeader parts = PushHeader(def, v1::DTYPE_FLOAT16, Pushed(def));
    parts.set_part_count(2);
    parts.set_part_index(1);
    w.Write(target, at + "f16_part",
            EncodeFuzzInput(s, 0, Call<v1::PushGradientsRequest>(parts, AllChunks(def, 2, 5), 2)));
    if (def.tensors.empty()) continue;
    const TensorSpec t = Small(def.tensors).back();
    const uint64_t n = Numel(t);
    std::vector<v1::TensorChunk> bad = f32;
    bad.push_back(Chunk(t.name, n - 1, F32(2, 6)));  // Past the end.
    w.Write(target, at + "past_end",
            EncodeFuzzInput(s, 0,
                            Call<v1::PushGradientsRequest>(
                                PushHeader(def, v1::DTYPE_FLOAT32, Pushed(def)), bad)));
    bad = f32;
    bad.push_back(Chunk(t.name, 0, F32(1, 7)));  // Overlap.
    bad.push_back(Chunk("nope", 0, F32(1, 7)));
    w.Write(target, at + "overlap",
            EncodeFuzzInput(s, 0,
                            Call<v1::PushGradientsRequest>(
                                PushHeader(def, v1::DTYPE_FLOAT32, {t.name}), bad, 3)));
    v1::PushHeader long_id = PushHeader(def, v1::DTYPE_FLOAT32, {t.name});
    long_id.set_client_id(std::string(257, 'c'));
    w.Write(target, at + "long_client_id",
            EncodeFuzzInput(s, 0, Call<v1::PushGradientsRequest>(long_id, {})));
    long_id.set_client_id("c");
    long_id.set_plan_hash(std::string(65, 'p'));
    w.Write(target, at + "long_plan_hash",
            EncodeFuzzInput(s, 0, Call<v1::PushGradientsRequest>(long_id, {})));
    v1::PushHeader scaled = PushHeader(def, v1::DTYPE_FLOAT32, {t.name, t.name});
    scaled.set_grad_scale(0.0f);
    w.Write(target, at + "bad_header",
            EncodeFuzzInput(s, 0, Call<v1::PushGradientsRequest>(scaled, f32)));
  }
}

v1::RegisterTensorsHeader RegisterHeader(const std::vector<TensorSpec>& specs,
                                         const std::string& plan_hash) {
  v1::RegisterTensorsHeader h;
  for (const TensorSpec& s : specs) {
    v1::TensorSpec* p = h.add_tensors();
    p->set_name(s.name);
    for (int64_t d : s.shape) p->add_shape(d);
    p->set_param_group(s.param_group);
  }
  h.set_plan_hash(plan_hash);
  return h;
}

void RegistrationSeeds(Writer& w) {
  const char* target = "registration_fuzz";
  const ShardDef added = {{{"x", {4}, ""}, {"y", {2, 3}, kCustomGroup}, {"z", {}, ""}}, ""};
  for (uint8_t s = 0; s < ShardDefs().size(); ++s) {
    const ShardDef& def = ShardDefs()[s];
    const std::string at = "shard" + std::to_string(s) + "_";
    for (uint8_t window = 0; window < 4; window += 3) {
      w.Write(target, at + "new_window" + std::to_string(window),
              EncodeFuzzInput(
                  s | window << 2, 0,
                  Call<v1::RegisterTensorsRequest>(RegisterHeader(added.tensors, def.plan_hash),
                                                   AllChunks(added, 4, 8), 1)));
    }
    std::vector<TensorSpec> mixed = Small(def.tensors);
    mixed.insert(mixed.end(), added.tensors.begin(), added.tensors.end());
    w.Write(target, at + "existing_and_new",
            EncodeFuzzInput(s | 1 << 2, 0,
                            Call<v1::RegisterTensorsRequest>(RegisterHeader(mixed, def.plan_hash),
                                                             AllChunks({mixed, ""}, 4, 9), 4)));
    std::vector<v1::TensorChunk> missing = AllChunks(added, 4, 10);
    missing.pop_back();
    w.Write(target, at + "missing",
            EncodeFuzzInput(s, 0,
                            Call<v1::RegisterTensorsRequest>(
                                RegisterHeader(added.tensors, "plan-other"), missing)));
    w.Write(target, at + "bad_specs",
            EncodeFuzzInput(
                s, 0,
                Call<v1::RegisterTensorsRequest>(
                    RegisterHeader({{"x", {2, -1}, ""}, {"q", {1}, "nope"}}, def.plan_hash), {})));
    const std::vector<TensorSpec> too_large = {{"x", {1 << 20, 1 << 20}, ""},
                                               {std::string(257, 'n'), {1}, ""}};
    w.Write(
        target, at + "too_large",
        EncodeFuzzInput(
            s, 0, Call<v1::RegisterTensorsRequest>(RegisterHeader(too_large, def.plan_hash), {})));
    w.Write(
        target, at + "large",
        EncodeFuzzInput(s, 0,
                        Call<v1::RegisterTensorsRequest>(
                            RegisterHeader({{"x", {1 << 18, 1 << 18}, ""}}, def.plan_hash), {})));
  }
}

void StateLoaderSeeds(Writer& w) {
  const char* target = "state_loader_fuzz";
  for (uint8_t s = 0; s < ShardDefs().size(); ++s) {
    const ShardDef& def = ShardDefs()[s];
    const std::string at = "shard" + std::to_string(s) + "_";
    v1::LoadStateHeader header;
    header.set_plan_hash(def.plan_hash);
    std::vector<v1::TensorChunk> chunks;
    uint32_t seed = 20;
    for (const TensorSpec& t : def.tensors) {
      if (Numel(t) > 4096) continue;  // Larger than the staging pool with the others.
      v1::TensorState* state = header.add_tensors();
      state->set_name(t.name);
      state->set_step(7);
      const bool amsgrad = t.param_group == kCustomGroup;
      for (int field = 1; field <= (amsgrad ? 4 : 3); ++field) {
        state->add_fields(static_cast<v1::TensorField>(field));
        for (v1::TensorChunk& c : AllChunks({{t}, ""}, 4, seed++, field)) chunks.push_back(c);
      }
    }
    w.Write(target, at + "all_fields",
            EncodeFuzzInput(s, 0, Call<v1::LoadStateRequest>(header, chunks, 2)));
    v1::LoadStateHeader steps_only;
    steps_only.set_plan_hash(def.plan_hash);
    v1::TensorState* state = steps_only.add_tensors();
    state->set_name(def.tensors.empty() ? "nope" : def.tensors[0].name);
    state->set_step(-1);
    w.Write(target, at + "negative_step",
            EncodeFuzzInput(s, 0, Call<v1::LoadStateRequest>(steps_only, {})));
    state->set_step(3);
    w.Write(target, at + "steps_only",
            EncodeFuzzInput(s, 0, Call<v1::LoadStateRequest>(steps_only, {})));
    if (def.tensors.empty()) continue;
    state->add_fields(v1::TENSOR_FIELD_UNSPECIFIED);
    std::vector<v1::TensorChunk> params = AllChunks({{def.tensors[0]}, ""}, 4, 30);
    params.push_back(Chunk(def.tensors[0].name, 0, F32(1, 31), 2));
    w.Write(target, at + "params_and_stray",
            EncodeFuzzInput(s, 0, Call<v1::LoadStateRequest>(steps_only, params)));
  }
  // A tensor larger than the staging pool.
  v1::LoadStateHeader big;
  big.set_plan_hash(ShardDefs()[1].plan_hash);
  v1::TensorState* state = big.add_tensors();
  state->set_name("big");
  state->add_fields(v1::TENSOR_FIELD_EXP_AVG);
  w.Write(target, "shard1_big", EncodeFuzzInput(1, 0, Call<v1::LoadStateRequest>(big, {})));
}

}  // namespace
}  // namespace fusedps::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR (writes DIR/<target>/seed_*)\n", argv[0]);
    return 2;
  }
  fusedps::fuzz::Writer writer(argv[1]);
  fusedps::fuzz::PushMessageSeeds(writer);
  fusedps::fuzz::PushCheckSeeds(writer);
  fusedps::fuzz::RegistrationSeeds(writer);
  fusedps::fuzz::StateLoaderSeeds(writer);
  return writer.failed() ? 1 : 0;
}
