// LoadState over real gRPC: a load is read back exactly (every field, steps, version), later
// pushes continue from it bit for bit (the harness's host AdamW, kernels/adamw_math.h), it is
// ordered with the pushes around it, and every bad load gets its exact status, names the field
// at fault, and leaves the shard's whole state bit-identical.
#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <mutex>
#include <ostream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tests/integration/service_harness.h"

namespace fusedps::integration {
namespace {

using LoadStream = std::vector<v1::LoadStateRequest>;

// One tensor of a load: its step afterwards and the values of the fields it writes.
struct TensorLoad {
  std::string name;
  int64_t step = 0;
  std::map<v1::TensorField, std::vector<float>> values;
};

// Values a field may hold: the second moments are never negative.
std::vector<float> FieldValues(v1::TensorField field, uint64_t numel, uint32_t seed) {
  std::vector<float> values = RandomValues(numel, seed);
  if (field == v1::TENSOR_FIELD_EXP_AVG_SQ || field == v1::TENSOR_FIELD_MAX_EXP_AVG_SQ) {
    for (float& v : values) v = std::abs(v) * 0.01f;
  }
  return values;
}

v1::LoadStateHeader HeaderOf(const std::vector<TensorLoad>& loads) {
  v1::LoadStateHeader header;
  for (const TensorLoad& l : loads) {
    v1::TensorState* state = header.add_tensors();
    state->set_name(l.name);
    state->set_step(l.step);
    for (const auto& [field, values] : l.values) state->add_fields(field);
  }
  return header;
}

// Every field's values in chunks of at most chunk_bytes, shuffled.
std::vector<v1::TensorChunk> ChunksOf(const std::vector<TensorLoad>& loads,
                                      size_t chunk_bytes = 100) {
  std::vector<v1::TensorChunk> chunks;
  for (const TensorLoad& l : loads) {
    for (const auto& [field, values] : l.values) {
      for (v1::TensorChunk& c :
           SplitIntoChunks(l.name, Encode(GradDType::kFloat32, values), 4, chunk_bytes)) {
        c.set_field(field);
        chunks.push_back(std::move(c));
      }
    }
  }
  Shuffle(chunks, 11);
  return chunks;
}

LoadStream Stream(const v1::LoadStateHeader& header, const std::vector<v1::TensorChunk>& chunks) {
  return Messages<v1::LoadStateRequest>(header, chunks, /*chunks_in_first=*/1);
}

std::string F32(std::vector<float> values) { return Encode(GradDType::kFloat32, values); }

// Tensors "w" [16, 33] and "s" [] in "custom", "b" [33] in "default", "m" [5, 7] in "ams"
// (amsgrad); one push applied.
class LoadStateTest : public ServiceTest {
 protected:
  void SetUp() override {
    ServiceTest::SetUp();
    if (HasFatalFailure()) return;
    AdamWHyperparameters ams = CustomHyperparameters();
    ams.amsgrad = true;
    ASSERT_NO_FATAL_FAILURE(RegisterGroup("custom", CustomHyperparameters()));
    ASSERT_NO_FATAL_FAILURE(RegisterGroup("ams", ams));
    ASSERT_NO_FATAL_FAILURE(RegisterTensors(
        {{"w", {16, 33}, "custom"}, {"b", {33}, ""}, {"m", {5, 7}, "ams"}, {"s", {}, "custom"}}));
    PushAndStep(MakePushHeader(v1::DTYPE_FLOAT32), GradDType::kFloat32, Grads(1));
  }

  std::map<std::string, std::vector<float>> Grads(uint32_t seed) {
    return RandomGrads({"w", "b", "m", "s"}, seed);
  }

  // w: params and both moments; m: all four fields; b: params only. s is not loaded.
  std::vector<TensorLoad> GoodLoads() {
    std::vector<TensorLoad> loads = {{"w", 9, {}}, {"m", 4, {}}, {"b", 2, {}}};
    const std::vector<std::vector<v1::TensorField>> fields = {
        {v1::TENSOR_FIELD_PARAM, v1::TENSOR_FIELD_EXP_AVG, v1::TENSOR_FIELD_EXP_AVG_SQ},
        {v1::TENSOR_FIELD_PARAM, v1::TENSOR_FIELD_EXP_AVG, v1::TENSOR_FIELD_EXP_AVG_SQ,
         v1::TENSOR_FIELD_MAX_EXP_AVG_SQ},
        {v1::TENSOR_FIELD_PARAM}};
    uint32_t seed = 100;
    for (size_t i = 0; i < loads.size(); ++i) {
      for (v1::TensorField f : fields[i]) {
        loads[i].values[f] = FieldValues(f, host_.tensor(loads[i].name).numel, seed++);
      }
    }
    return loads;
  }

  std::pair<grpc::Status, v1::LoadStateResponse> Load(const LoadStream& messages) {
    grpc::ClientContext context;
    SetDeadline(context);
    v1::LoadStateResponse response;
    auto writer = stub_->LoadState(&context, &response);
    for (const v1::LoadStateRequest& message : messages) {
      if (!writer->Write(message)) break;
    }
    writer->WritesDone();
    return {writer->Finish(), response};
  }

  // What a load must leave as it is: Snapshot() and m's max_exp_avg_sq.
  std::pair<ShardState, std::string> Everything() {
    Pulled max = Pull({"m"}, v1::DTYPE_FLOAT32, v1::TENSOR_FIELD_MAX_EXP_AVG_SQ);
    EXPECT_TRUE(max.status.ok()) << max.status.error_message();
    return {Snapshot(), max.data["m"]};
  }

  // Loads and mirrors the load in host_; returns the reply.
  v1::LoadStateResponse LoadAndMirror(const std::vector<TensorLoad>& loads) {
    auto [status, response] = Load(Stream(HeaderOf(loads), ChunksOf(loads)));
    EXPECT_TRUE(status.ok()) << status.error_message();
    if (!status.ok()) return response;
    for (const TensorLoad& l : loads) {
      HostModel::Tensor& t = host_.tensor(l.name);
      t.step = l.step;
      for (const auto& [field, values] : l.values) {
        switch (field) {
          case v1::TENSOR_FIELD_EXP_AVG:
            t.exp_avg = values;
            break;
          case v1::TENSOR_FIELD_EXP_AVG_SQ:
            t.exp_avg_sq = values;
            break;
          case v1::TENSOR_FIELD_MAX_EXP_AVG_SQ:
            t.max_exp_avg_sq = values;
            break;
          default:
            t.param = values;
            break;
        }
      }
    }
    return response;
  }
};

TEST_F(LoadStateTest, ALoadIsReadBackExactlyWithItsStepsAndVersion) {
  const v1::LoadStateResponse response = LoadAndMirror(GoodLoads());
  EXPECT_EQ(response.version(), 2u);
  EXPECT_EQ(response.tensors_loaded(), 3u);
  // Every field of every tensor: the loaded ones, and those not loaded (b's moments, all of s)
  // as the first push left them.
  ExpectMatchesHost(2);
}

TEST_F(LoadStateTest, PushesAreOrderedAroundALoadAndContinueFromIt) {
  PushAndStep(MakePushHeader(v1::DTYPE_FLOAT32, "trainer", 1), GradDType::kFloat32, Grads(2));
  EXPECT_EQ(LoadAndMirror(GoodLoads()).version(), 3u);
  for (uint32_t i = 0; i < 2; ++i) {
    const v1::PushGradientsResponse ack = PushAndStep(
        MakePushHeader(v1::DTYPE_BFLOAT16, "trainer", 2 + i), GradDType::kBFloat16, Grads(3 + i));
    EXPECT_EQ(ack.version(), 4u + i);
  }
  // w at step 11 = 9 loaded + 2, m at 6, b at 4, s at 4 (never loaded): each step's bias
  // corrections and moments start from the loaded ones.
  ExpectMatchesHost(5);
}

// Loads and pushes from two threads at once: each is applied once, as a version of its own.
TEST_F(LoadStateTest, ConcurrentLoadsAndPushesEachTakeOneVersion) {
  constexpr int kPushes = 12, kLoads = 6;
  const std::vector<TensorLoad> loads = GoodLoads();
  const LoadStream load = Stream(HeaderOf(loads), ChunksOf(loads));
  const std::vector<v1::PushGradientsRequest> push = Messages<v1::PushGradientsRequest>(
      MakePushHeader(v1::DTYPE_FLOAT32), GradChunks(GradDType::kFloat32, Grads(5)));
  std::vector<uint64_t> versions;
  std::mutex mu;
  const auto record = [&](bool ok, uint64_t version) {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_TRUE(ok);
    versions.push_back(version);
  };
  std::thread pusher([&] {
    for (int i = 0; i < kPushes; ++i) {
      auto [status, ack] = Push(push);
      record(status.ok(), ack.version());
    }
  });
  for (int i = 0; i < kLoads; ++i) {
    auto [status, response] = Load(load);
    record(status.ok(), response.version());
  }
  pusher.join();
  std::sort(versions.begin(), versions.end());
  for (size_t i = 0; i < versions.size(); ++i) EXPECT_EQ(versions[i], i + 2);
  EXPECT_EQ(ListTensors().version(), 1u + kPushes + kLoads);
}

struct LoadCase {
  const char* name;
  // The stream, built from the fixture's good loads.
  std::function<LoadStream(std::vector<TensorLoad>)> messages;
  grpc::StatusCode code;
  std::vector<std::string> message_has;  // Substrings of the error message.
};

// The good stream, with `change` applied to its header and chunks.
LoadStream Changed(
    const std::vector<TensorLoad>& loads,
    const std::function<void(v1::LoadStateHeader&, std::vector<v1::TensorChunk>&)>& change) {
  v1::LoadStateHeader header = HeaderOf(loads);
  std::vector<v1::TensorChunk> chunks = ChunksOf(loads);
  change(header, chunks);
  return Stream(header, chunks);
}

// The chunk of (tensor, field) at offset 0 (25 elements).
v1::TensorChunk& ChunkOf(std::vector<v1::TensorChunk>& chunks, const std::string& tensor,
                         v1::TensorField field) {
  for (v1::TensorChunk& c : chunks) {
    if (c.tensor() == tensor && c.field() == field && c.offset() == 0) return c;
  }
  ADD_FAILURE() << "no chunk of " << tensor;
  return chunks.front();
}

using Header = v1::LoadStateHeader;
using Chunks = std::vector<v1::TensorChunk>;

const LoadCase kLoadCases[] = {
    {"UnknownTensorInHeader",
     [](auto loads) {
       return Changed(loads, [](Header& h, Chunks&) { h.add_tensors()->set_name("nope"); });
     },
     grpc::StatusCode::NOT_FOUND,
     {"header.tensors[3].name", "'nope'"}},
    {"ChunkOfUnknownTensor",
     [](auto loads) {
       return Changed(
           loads, [](Header&, Chunks& c) { c.insert(c.begin() + 5, Chunk("nope", 0, F32({1}))); });
     },
     grpc::StatusCode::NOT_FOUND,
     {"chunks.tensor", "'nope'"}},
    {"TensorTwice",
     [](auto loads) {
       return Changed(loads, [](Header& h, Chunks&) { *h.add_tensors() = h.tensors(0); });
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"header.tensors[3]", "'w'", "second time"}},
    {"FieldTwice",
     [](auto loads) {
       return Changed(loads, [](Header& h, Chunks&) {
         h.mutable_tensors(0)->add_fields(v1::TENSOR_FIELD_EXP_AVG);
       });
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"header.tensors[0].fields", "'w'", "exp_avg", "second time"}},
    {"UnspecifiedAndParam",
     [](auto loads) {
       return Changed(loads, [](Header& h, Chunks&) {
         h.mutable_tensors(2)->add_fields(v1::TENSOR_FIELD_UNSPECIFIED);
       });
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"header.tensors[2].fields", "'b'", "param", "second time"}},
    {"FieldNotATensorField",
     [](auto loads) {
       return Changed(loads, [](Header& h, Chunks&) {
         h.mutable_tensors(1)->add_fields(static_cast<v1::TensorField>(9));
       });
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"header.tensors[1].fields", "'m'", "9", "not a TensorField"}},
    {"ChunkFieldNotATensorField",
     [](auto loads) {
       return Changed(
           loads, [](Header&, Chunks& c) { c.back().set_field(static_cast<v1::TensorField>(9)); });
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"chunks.field", "9", "not a TensorField"}},
    {"NegativeStep",
     [](auto loads) {
       loads[1].step = -1;
       return Changed(loads, [](Header&, Chunks&) {});
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"header.tensors[1].step", "'m'", "-1"}},
    {"MaxExpAvgSqWithoutAmsgrad",
     [](auto loads) {
       loads[0].values[v1::TENSOR_FIELD_MAX_EXP_AVG_SQ] =
           FieldValues(v1::TENSOR_FIELD_MAX_EXP_AVG_SQ, 528, 7);
       return Changed(loads, [](Header&, Chunks&) {});
     },
     grpc::StatusCode::FAILED_PRECONDITION,
     {"header.tensors[0].fields", "'w'", "max_exp_avg_sq", "amsgrad", "'custom'"}},
    {"ChunkOfAFieldNotListed",
     [](auto loads) {
       return Changed(loads, [](Header&, Chunks& c) {
         c.push_back(Chunk("b", 0, F32({1})));
         c.back().set_field(v1::TENSOR_FIELD_EXP_AVG);
       });
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"chunks.field exp_avg", "'b'"}},
    {"ChunkOfATensorNotListed",
     [](auto loads) {
       return Changed(loads, [](Header&, Chunks& c) { c.push_back(Chunk("s", 0, F32({1}))); });
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"chunks.field param", "'s'"}},
    {"ChunksMissing",
     [](auto loads) {
       return Changed(loads, [](Header&, Chunks& c) {
         v1::TensorChunk& gone = ChunkOf(c, "w", v1::TENSOR_FIELD_EXP_AVG);
         c.erase(c.begin() + (&gone - c.data()));
       });
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"field exp_avg", "'w'", "503 of its 528", "missing"}},
    {"WrongSize",
     [](auto loads) {
       loads[2].values[v1::TENSOR_FIELD_PARAM].push_back(1.0f);  // 34 values of b's 33.
       return Changed(loads, [](Header&, Chunks&) {});
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"field param", "'b'", "34", "33"}},
    {"OverlappingChunks",
     [](auto loads) {
       return Changed(loads, [](Header&, Chunks& c) {
         c.push_back(ChunkOf(c, "m", v1::TENSOR_FIELD_MAX_EXP_AVG_SQ));
       });
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"field max_exp_avg_sq", "'m'", "overlaps"}},
    {"NotWholeElements",
     [](auto loads) {
       return Changed(loads, [](Header&, Chunks& c) {
         ChunkOf(c, "b", v1::TENSOR_FIELD_PARAM).mutable_data()->append("xy");
       });
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"field param", "'b'", "multiple"}},
    {"PlanHashMismatch",
     [](auto loads) {
       return Changed(loads, [](Header& h, Chunks&) { h.set_plan_hash("0123abcd"); });
     },
     grpc::StatusCode::FAILED_PRECONDITION,
     {"header.plan_hash", "0123abcd"}},
    {"NoTensors",
     [](auto) { return Stream(Header(), {}); },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"header.tensors"}},
    {"NoHeader",
     [](auto loads) {
       LoadStream messages = Changed(loads, [](Header&, Chunks&) {});
       messages.erase(messages.begin());
       return messages;
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"LoadStateRequest", "header"}},
    {"EmptyStream",
     [](auto) { return LoadStream{}; },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"header"}},
    {"SecondHeaderMidStream",
     [](auto loads) {
       LoadStream messages = Changed(loads, [](Header&, Chunks&) {});
       *messages[3].mutable_header() = messages[0].header();
       return messages;
     },
     grpc::StatusCode::INVALID_ARGUMENT,
     {"header", "first message"}},
};

void PrintTo(const LoadCase& c, std::ostream* os) { *os << c.name; }

class BadLoadTest : public LoadStateTest, public ::testing::WithParamInterface<LoadCase> {};

TEST_P(BadLoadTest, IsRejectedAndChangesNothing) {
  const LoadCase& c = GetParam();
  const auto before = Everything();
  auto [status, response] = Load(c.messages(GoodLoads()));
  EXPECT_EQ(status.error_code(), c.code) << status.error_message();
  for (const std::string& part : c.message_has) {
    EXPECT_NE(status.error_message().find(part), std::string::npos)
        << "'" << status.error_message() << "' does not contain '" << part << "'";
  }
  const auto after = Everything();
  ExpectSameState(before.first, after.first);
  ExpectSameBytes(after.second, before.second, 4, "MAX_EXP_AVG_SQ of 'm'");
  // The shard still takes a good load, as the next version.
  EXPECT_EQ(LoadAndMirror(GoodLoads()).version(), before.first.version + 1);
  ExpectMatchesHost(before.first.version + 1);
}

INSTANTIATE_TEST_SUITE_P(Load, BadLoadTest, ::testing::ValuesIn(kLoadCases),
                         [](const ::testing::TestParamInfo<LoadCase>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace fusedps::integration
