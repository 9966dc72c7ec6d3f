// Models (server namespaces) over real gRPC on the CPU backend: independent shards side by side,
// create/list/delete, deletion under load (the concurrent part runs under ASan and TSan), the
// durable records under --checkpoint-dir, and tokens limited to some models. On the GPU
// machine, FUSEDPS_TEST_DEVICE=cuda runs it on the CUDA backend (each model's backend then
// shares the server's staging arena and its device mirror).
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fusedps/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/server.h"

namespace fusedps {
namespace {

using client::Client;
using client::ClientOptions;
using ::testing::HasSubstr;

class ModelsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/models_test_", getpid(), "_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override {
    server_.reset();
    std::filesystem::remove_all(dir_);
  }

  void Start(bool checkpoints = false, const std::string& tokens = "") {
    ServerOptions options;
    options.listen = "127.0.0.1:0";
    const char* device = getenv("FUSEDPS_TEST_DEVICE");
    options.device = device != nullptr && *device != '\0' ? device : "cpu";
    options.staging_pool_bytes = 64 << 20;
    if (checkpoints) options.checkpoint.root = dir_ + "/ckpt";
    if (!tokens.empty()) {
      const std::string path = dir_ + "/tokens";
      std::ofstream(path) << tokens;
      options.auth_tokens_file = path;
    }
    absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  std::unique_ptr<Client> Connect(const std::string& model, const std::string& token = "") {
    ClientOptions options;
    options.model = model;
    options.token = token;
    absl::StatusOr<std::unique_ptr<Client>> c =
        Client::Create(absl::StrCat("127.0.0.1:", server_->port()), options);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  // Registers "w" (n elements, all `value`) in the client's model.
  static void RegisterW(Client& c, size_t n, float value) {
    const std::vector<float> w(n, value);
    absl::StatusOr<client::RegisterTensorsResult> r =
        c.RegisterTensors({{"w", {static_cast<int64_t>(n)}, "", w}});
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->tensors_created, 1u);
  }

  static absl::StatusOr<client::PushResult> PushW(Client& c, size_t n, float grad) {
    const std::vector<float> g(n, grad);
    client::PushOptions push;
    push.grad_dtype = client::DType::kFloat32;
    return c.PushGradients(push, {{"w", g}});
  }

  static std::vector<float> PullW(Client& c) {
    absl::StatusOr<client::PullResult> pulled = c.PullParameters({});
    EXPECT_TRUE(pulled.ok()) << pulled.status();
    return pulled.ok() ? pulled->tensors.at("w").values : std::vector<float>{};
  }

  std::string dir_;
  std::unique_ptr<Server> server_;
};

TEST_F(ModelsTest, ModelsAreIndependentShards) {
  ASSERT_NO_FATAL_FAILURE(Start());
  std::unique_ptr<Client> admin = Connect("");
  ASSERT_TRUE(admin->CreateModel("job-a").ok());
  client::Consistency bounded;
  bounded.mode = "bounded";
  bounded.max_staleness = 3;
  absl::StatusOr<client::CreateModelResult> b = admin->CreateModel("job-b", bounded);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(b->created);
  EXPECT_EQ(b->model.consistency.mode, "bounded");

  std::unique_ptr<Client> a_client = Connect("job-a");
  std::unique_ptr<Client> b_client = Connect("job-b");
  // The same tensor name in both models, with other shapes and values.
  ASSERT_NO_FATAL_FAILURE(RegisterW(*a_client, 16, 1.0f));
  ASSERT_NO_FATAL_FAILURE(RegisterW(*b_client, 8, -2.0f));
  ASSERT_TRUE(PushW(*a_client, 16, 0.5f).ok());
  ASSERT_TRUE(PushW(*a_client, 16, 0.5f).ok());

  absl::StatusOr<client::ServerInfo> a_info = a_client->GetInfo();
  absl::StatusOr<client::ServerInfo> b_info = b_client->GetInfo();
  absl::StatusOr<client::ServerInfo> d_info = admin->GetInfo();
  ASSERT_TRUE(a_info.ok() && b_info.ok() && d_info.ok());
  EXPECT_EQ(a_info->model, "job-a");
  EXPECT_EQ(a_info->version, 2u);
  EXPECT_EQ(a_info->parameter_count, 16u);
  EXPECT_EQ(b_info->version, 0u);
  EXPECT_EQ(b_info->parameter_count, 8u);
  EXPECT_EQ(b_info->consistency.mode, "bounded");
  EXPECT_EQ(d_info->model, "default");
  EXPECT_EQ(d_info->tensor_count, 0u);
  EXPECT_EQ(d_info->model_count, 3u);
  EXPECT_GT(a_info->memory_bytes, 0u);
  EXPECT_GE(d_info->server_memory_bytes, a_info->memory_bytes + b_info->memory_bytes);
  EXPECT_EQ(PullW(*b_client), std::vector<float>(8, -2.0f));  // Untouched by a's steps.
  EXPECT_NE(PullW(*a_client), std::vector<float>(16, 1.0f));

  absl::StatusOr<std::vector<client::ModelInfo>> models = admin->ListModels();
  ASSERT_TRUE(models.ok()) << models.status();
  ASSERT_EQ(models->size(), 3u);
  EXPECT_EQ((*models)[0].name, "default");
  EXPECT_EQ((*models)[1].name, "job-a");
  EXPECT_EQ((*models)[1].version, 2u);
  EXPECT_EQ((*models)[2].name, "job-b");
}

TEST_F(ModelsTest, CreateChecksItsInputAndIsIdempotent) {
  ASSERT_NO_FATAL_FAILURE(Start());
  std::unique_ptr<Client> admin = Connect("");
  absl::StatusOr<client::CreateModelResult> first = admin->CreateModel("m1");
  ASSERT_TRUE(first.ok());
  EXPECT_TRUE(first->created);
  absl::StatusOr<client::CreateModelResult> again = admin->CreateModel("m1");
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->created);
  client::Consistency sync;
  sync.mode = "sync";
  sync.replicas_to_aggregate = 2;
  sync.total_replicas = 2;
  absl::StatusOr<client::CreateModelResult> other = admin->CreateModel("m1", sync);
  EXPECT_EQ(other.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(other.status().message(), HasSubstr("m1"));
  for (const std::string& bad :
       std::vector<std::string>{"", "Upper", "-x", "a/b", std::string(65, 'a')}) {
    EXPECT_EQ(admin->CreateModel(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  sync.replicas_to_aggregate = 3;  // K > N.
  EXPECT_EQ(admin->CreateModel("m2", sync).status().code(), absl::StatusCode::kInvalidArgument);

  std::unique_ptr<Client> missing = Connect("nope");
  absl::StatusOr<client::ServerInfo> info = missing->GetInfo();
  EXPECT_EQ(info.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(info.status().message(), HasSubstr("'nope'"));
  EXPECT_EQ(PushW(*missing, 4, 1.0f).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing->PullParameters({}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(admin->DeleteModel("nope").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ModelsTest, DeleteFreesTheModelAndLeavesTheOthers) {
  ASSERT_NO_FATAL_FAILURE(Start());
  std::unique_ptr<Client> admin = Connect("");
  ASSERT_TRUE(admin->CreateModel("big").ok());
  ASSERT_TRUE(admin->CreateModel("small").ok());
  std::unique_ptr<Client> big = Connect("big");
  std::unique_ptr<Client> small = Connect("small");
  ASSERT_NO_FATAL_FAILURE(RegisterW(*big, 1 << 20, 1.0f));
  ASSERT_NO_FATAL_FAILURE(RegisterW(*small, 64, 1.0f));
  const uint64_t before = admin->GetInfo()->server_memory_bytes;
  const uint64_t big_bytes = big->GetInfo()->memory_bytes;
  EXPECT_GE(big_bytes, (uint64_t{1} << 20) * 12);  // params, exp_avg, exp_avg_sq.

  absl::StatusOr<client::DeleteModelResult> deleted = admin->DeleteModel("big");
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  EXPECT_EQ(deleted->freed_bytes, big_bytes);
  EXPECT_TRUE(deleted->memory_freed);
  EXPECT_EQ(admin->GetInfo()->server_memory_bytes, before - big_bytes);
  EXPECT_EQ(admin->GetInfo()->model_count, 2u);
  EXPECT_EQ(big->GetInfo().status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(PushW(*big, 1 << 20, 1.0f).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(PushW(*small, 64, 1.0f).ok());
  EXPECT_EQ(small->GetInfo()->version, 1u);

  // A model made again under the name starts empty.
  ASSERT_TRUE(admin->CreateModel("big").ok());
  EXPECT_EQ(big->GetInfo()->tensor_count, 0u);

  // Deleting "default" empties it.
  ASSERT_NO_FATAL_FAILURE(RegisterW(*admin, 32, 3.0f));
  ASSERT_TRUE(admin->DeleteModel("default").ok());
  absl::StatusOr<client::ServerInfo> fresh = admin->GetInfo();
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_EQ(fresh->tensor_count, 0u);
  EXPECT_EQ(fresh->version, 0u);
}

// Pushes and pulls of a model from several threads while it is deleted, and of another model
// all along: every call ends OK or NOT_FOUND, the other model loses no push, nothing leaks or
// races (ASan, TSan).
TEST_F(ModelsTest, DeleteUnderLoad) {
  ASSERT_NO_FATAL_FAILURE(Start());
  std::unique_ptr<Client> admin = Connect("");
  ASSERT_TRUE(admin->CreateModel("doomed").ok());
  ASSERT_TRUE(admin->CreateModel("survivor").ok());
  {
    std::unique_ptr<Client> d = Connect("doomed");
    ASSERT_NO_FATAL_FAILURE(RegisterW(*d, 4096, 1.0f));
    std::unique_ptr<Client> s = Connect("survivor");
    ASSERT_NO_FATAL_FAILURE(RegisterW(*s, 256, 1.0f));
  }
  std::atomic<bool> stop{false};
  std::atomic<int> unexpected{0};
  std::atomic<int> survivor_pushes{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::unique_ptr<Client> c = Connect(t < 3 ? "doomed" : "survivor");
      while (!stop.load()) {
        absl::Status s = t < 3 && t % 2 == 1 ? c->PullParameters({}).status()
                                             : PushW(*c, t < 3 ? 4096 : 256, 0.1f).status();
        if (t == 3) {
          if (s.ok()) {
            ++survivor_pushes;
          } else {
            ++unexpected;
          }
        } else if (!s.ok() && s.code() != absl::StatusCode::kNotFound) {
          ADD_FAILURE() << s;
          ++unexpected;
        }
      }
    });
  }
  absl::SleepFor(absl::Milliseconds(200));
  absl::StatusOr<client::DeleteModelResult> deleted = admin->DeleteModel("doomed");
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  EXPECT_TRUE(deleted->memory_freed);
  absl::SleepFor(absl::Milliseconds(200));
  stop = true;
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(unexpected.load(), 0);
  std::unique_ptr<Client> s = Connect("survivor");
  EXPECT_EQ(s->GetInfo()->version, static_cast<uint64_t>(survivor_pushes.load()));
}

TEST_F(ModelsTest, CreatedModelsSurviveARestartAndDeletedOnesDoNot) {
  ASSERT_NO_FATAL_FAILURE(Start(/*checkpoints=*/true));
  {
    std::unique_ptr<Client> admin = Connect("");
    client::Consistency bounded;
    bounded.mode = "bounded";
    bounded.max_staleness = 2;
    ASSERT_TRUE(admin->CreateModel("keep", bounded).ok());
    ASSERT_TRUE(admin->CreateModel("drop").ok());
    ASSERT_TRUE(admin->CreateModel("empty").ok());
    std::unique_ptr<Client> keep = Connect("keep");
    std::unique_ptr<Client> drop = Connect("drop");
    ASSERT_NO_FATAL_FAILURE(RegisterW(*keep, 64, 1.0f));
    ASSERT_NO_FATAL_FAILURE(RegisterW(*drop, 64, 1.0f));
    ASSERT_NO_FATAL_FAILURE(RegisterW(*admin, 64, 5.0f));
    ASSERT_TRUE(PushW(*keep, 64, 0.5f).ok());
    ASSERT_TRUE(PushW(*drop, 64, 0.5f).ok());
    ASSERT_TRUE(keep->Checkpoint().ok());
    ASSERT_TRUE(drop->Checkpoint().ok());
    ASSERT_TRUE(admin->Checkpoint().ok());
    ASSERT_TRUE(admin->DeleteModel("drop").ok());
    ASSERT_TRUE(admin->DeleteModel("default").ok());
  }
  server_.reset();
  ASSERT_NO_FATAL_FAILURE(Start(/*checkpoints=*/true));
  std::unique_ptr<Client> admin = Connect("");
  absl::StatusOr<std::vector<client::ModelInfo>> models = admin->ListModels();
  ASSERT_TRUE(models.ok()) << models.status();
  std::map<std::string, client::ModelInfo> by_name;
  for (const client::ModelInfo& m : *models) by_name[m.name] = m;
  ASSERT_EQ(by_name.size(), 3u);
  EXPECT_EQ(by_name.count("drop"), 0u);
  EXPECT_EQ(by_name["keep"].version, 1u);
  EXPECT_EQ(by_name["keep"].consistency.mode, "bounded");
  EXPECT_EQ(by_name["keep"].consistency.max_staleness, 2u);
  EXPECT_EQ(by_name["empty"].tensor_count, 0u);
  EXPECT_EQ(by_name["default"].tensor_count, 0u);  // Its delete removed its checkpoints.
  std::unique_ptr<Client> keep = Connect("keep");
  EXPECT_EQ(PullW(*keep), PullW(*keep));
  EXPECT_NE(PullW(*keep), std::vector<float>(64, 1.0f));
}

TEST_F(ModelsTest, TokensLimitedToAModelReachOnlyIt) {
  const std::string admin_token = "admin-token-0123456789";
  const std::string a_token = "job-a-admin-token-0123";
  const std::string a_trainer = "job-a-trainer-token-01";
  ASSERT_NO_FATAL_FAILURE(
      Start(false, absl::StrCat(admin_token, " admin ops\n", a_token, " admin a-ops models=job-a\n",
                                a_trainer, " trainer a-0 models=job-a\n")));
  std::unique_ptr<Client> ops = Connect("", admin_token);
  ASSERT_TRUE(ops->CreateModel("job-b").ok());
  std::unique_ptr<Client> a_admin = Connect("job-a", a_token);
  ASSERT_TRUE(a_admin->CreateModel("job-a").ok());
  ASSERT_NO_FATAL_FAILURE(RegisterW(*a_admin, 16, 1.0f));
  absl::StatusOr<client::CreateModelResult> other = a_admin->CreateModel("job-c");
  EXPECT_EQ(other.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(other.status().message(), HasSubstr("job-c"));
  EXPECT_EQ(a_admin->DeleteModel("job-b").status().code(), absl::StatusCode::kPermissionDenied);

  std::unique_ptr<Client> b_by_a = Connect("job-b", a_trainer);
  absl::StatusOr<client::ServerInfo> info = b_by_a->GetInfo();
  EXPECT_EQ(info.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(info.status().message(), HasSubstr("job-b"));
  EXPECT_EQ(b_by_a->PullParameters({}).status().code(), absl::StatusCode::kPermissionDenied);
  std::unique_ptr<Client> default_by_a = Connect("", a_trainer);
  EXPECT_EQ(default_by_a->GetInfo().status().code(), absl::StatusCode::kPermissionDenied);

  std::unique_ptr<Client> a_by_a = Connect("job-a", a_trainer);
  EXPECT_TRUE(a_by_a->GetInfo().ok());
  absl::StatusOr<std::vector<client::ModelInfo>> seen = a_by_a->ListModels();
  ASSERT_TRUE(seen.ok()) << seen.status();
  ASSERT_EQ(seen->size(), 1u);
  EXPECT_EQ((*seen)[0].name, "job-a");
  EXPECT_EQ(ops->ListModels()->size(), 3u);
}

}  // namespace
}  // namespace fusedps
