// security_test: TLS, mutual TLS, bearer tokens and the identity binding of pushes, against a
// real server in-process (CPU backend) over real gRPC, with certificates made by the openssl
// CLI for each test (make_test_certs.sh). Docs: server/auth/authorizer.h, tls.h,
// docs/operations.md "Security".
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "fusedps/client.h"
#include "fusedps/v1/parameter_service.grpc.pb.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "server/server.h"

namespace fusedps {
namespace {

using client::Client;
using client::ClientOptions;

constexpr char kAdminToken[] = "admin-token-0123456789abcdef";
constexpr char kTrainer0Token[] = "trainer0-token-0123456789abcdef";
constexpr char kTrainer1Token[] = "trainer1-token-0123456789abcdef";
constexpr char kReaderToken[] = "reader-token-0123456789abcdef";
constexpr int kNumel = 4096;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Replaces `path` atomically (a rename), as Kubernetes and cert-manager do.
void WriteFileAtomically(const std::string& path, const std::string& text) {
  const std::string temporary = path + ".new";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    out << text;
  }
  ASSERT_EQ(std::rename(temporary.c_str(), path.c_str()), 0) << path;
}

class SecurityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = ::testing::TempDir() + "/fusedps-security-XXXXXX";
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    const std::string command =
        absl::StrCat(FUSEDPS_MAKE_TEST_CERTS, " ", dir_, " >/dev/null 2>&1");
    ASSERT_EQ(std::system(command.c_str()), 0) << command << " (is openssl installed?)";
    tokens_file_ = dir_ + "/tokens";
    WriteFileAtomically(tokens_file_,
                        absl::StrCat("# role tokens\n", kAdminToken, " admin ops\n", kTrainer0Token,
                                     " trainer trainer-0\n", kTrainer1Token, " trainer trainer-1\n",
                                     kReaderToken, " reader eval\n"));
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(absl::ZeroDuration());
    server_.reset();
    std::system(absl::StrCat("rm -rf ", dir_).c_str());
  }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  ServerOptions BaseOptions() const {
    ServerOptions options;
    options.listen = "127.0.0.1:0";
    options.device = "cpu";
    options.backend.threads = 2;
    options.staging_pool_bytes = 64 << 20;
    options.pull_snapshot_bytes = 64 << 20;
    options.tls.reload_interval = absl::Seconds(1);
    options.auth_tokens_reload = absl::Milliseconds(100);
    return options;
  }

  ServerOptions TlsOptions(bool mutual) const {
    ServerOptions options = BaseOptions();
    options.tls.cert_file = Path("server.crt");
    options.tls.key_file = Path("server.key");
    if (mutual) options.tls.client_ca_file = Path("ca.crt");
    return options;
  }

  void Start(const ServerOptions& options) {
    absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    // An IP address, which the certificates name too: "localhost" would go through c-ares,
    // whose resolver leaks under LeakSanitizer (Debian's libcares, uninstrumented).
    target_ = absl::StrCat("127.0.0.1:", server_->port());
  }

  // A client with a short deadline (a refused handshake fails within it).
  std::unique_ptr<Client> Connect(ClientOptions options) {
    options.timeout = absl::Seconds(10);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(target_, options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  ClientOptions Tls(const std::string& cert = "") const {
    ClientOptions options;
    options.tls_ca_file = Path("ca.crt");
    if (!cert.empty()) {
      options.tls_cert_file = Path(cert + ".crt");
      options.tls_key_file = Path(cert + ".key");
    }
    return options;
  }

  static ClientOptions WithToken(ClientOptions options, const std::string& token) {
    options.token = token;
    return options;
  }

  // Registers one tensor "w" of kNumel zeros as `admin`.
  void RegisterW(Client& admin) {
    const std::vector<float> zeros(kNumel, 0.0f);
    absl::StatusOr<client::RegisterTensorsResult> registered =
        admin.RegisterTensors({{"w", {kNumel}, "default", zeros}});
    ASSERT_TRUE(registered.ok()) << registered.status();
  }

  static absl::StatusOr<client::PushResult> Push(Client& client, const std::string& client_id,
                                                 uint64_t sequence_number) {
    static const std::vector<float> grads(kNumel, 0.5f);
    client::PushOptions push;
    push.client_id = client_id;
    push.sequence_number = sequence_number;
    return client.PushGradients(push, {{"w", grads}});
  }

  // The value of a series (name and labels, as /metrics spells it) in the server's metrics,
  // or -1 when it is absent.
  double Metric(const std::string& series) const {
    const std::string text = server_->metrics().ScrapeText();
    const size_t at = text.find("\n" + series + " ");
    if (at == std::string::npos) return -1;
    return std::stod(text.substr(at + series.size() + 2));
  }

  double AuthFailures(const std::string& reason) const {
    return Metric(absl::StrCat("fusedps_auth_failures_total{reason=\"", reason, "\"}"));
  }

  std::string dir_;
  std::string tokens_file_;
  std::unique_ptr<Server> server_;
  std::string target_;
};

TEST_F(SecurityTest, TlsServerRefusesPlaintextAndServesTls) {
  Start(TlsOptions(/*mutual=*/false));
  std::unique_ptr<Client> plaintext = Connect(ClientOptions());
  absl::StatusOr<client::ServerInfo> refused = plaintext->GetInfo();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();

  std::unique_ptr<Client> tls = Connect(Tls());
  absl::StatusOr<client::ServerInfo> info = tls->GetInfo();
  EXPECT_TRUE(info.ok()) << info.status();
  // A client that trusts another CA refuses the server.
  ClientOptions wrong_ca;
  wrong_ca.tls_ca_file = Path("other-ca.crt");
  EXPECT_EQ(Connect(wrong_ca)->GetInfo().status().code(), absl::StatusCode::kUnavailable);

  // The certificate's expiry, as openssl reads it ("notAfter=Nov 24 09:21:44 2026 GMT").
  const std::string end_file = Path("enddate");
  ASSERT_EQ(std::system(absl::StrCat("openssl x509 -noout -enddate -in ", Path("server.crt"), " > ",
                                     end_file)
                            .c_str()),
            0);
  std::string end = ReadFile(end_file);
  ASSERT_EQ(end.rfind("notAfter=", 0), 0u) << end;
  end = end.substr(9, end.find('\n') - 9);
  absl::Time expiry;
  std::string error;
  ASSERT_TRUE(absl::ParseTime("%b %e %H:%M:%S %Y GMT", end, &expiry, &error)) << end << error;
  EXPECT_EQ(Metric("fusedps_tls_certificate_expiry_timestamp_seconds"),
            static_cast<double>(absl::ToUnixSeconds(expiry)));
}

TEST_F(SecurityTest, MutualTlsRefusesClientsWithoutACertificateOfItsCa) {
  Start(TlsOptions(/*mutual=*/true));
  absl::StatusOr<client::ServerInfo> no_cert = Connect(Tls())->GetInfo();
  EXPECT_EQ(no_cert.status().code(), absl::StatusCode::kUnavailable) << no_cert.status();
  absl::StatusOr<client::ServerInfo> other_ca = Connect(Tls("other-client"))->GetInfo();
  EXPECT_EQ(other_ca.status().code(), absl::StatusCode::kUnavailable) << other_ca.status();

  // A certificate of the CA is an admin; its SAN (trainer-0) is its identity.
  std::unique_ptr<Client> trainer0 = Connect(Tls("client"));
  RegisterW(*trainer0);
  absl::StatusOr<client::PushResult> own = Push(*trainer0, "trainer-0", 1);
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_EQ(own->version, 1u);
  absl::StatusOr<client::PushResult> forged = Push(*trainer0, "trainer-1", 1);
  EXPECT_EQ(forged.status().code(), absl::StatusCode::kPermissionDenied) << forged.status();
  EXPECT_NE(forged.status().message().find("trainer-0"), absl::string_view::npos);
  EXPECT_EQ(AuthFailures("client_id_mismatch"), 1);
}

TEST_F(SecurityTest, TokensAuthenticateAndRolesAuthorize) {
  ServerOptions options = TlsOptions(/*mutual=*/false);
  options.auth_tokens_file = tokens_file_;
  Start(options);

  absl::StatusOr<client::ServerInfo> anonymous = Connect(Tls())->GetInfo();
  EXPECT_EQ(anonymous.status().code(), absl::StatusCode::kUnauthenticated) << anonymous.status();
  absl::StatusOr<client::ServerInfo> unknown =
      Connect(WithToken(Tls(), "not-a-token-of-this-server"))->GetInfo();
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kUnauthenticated) << unknown.status();
  EXPECT_EQ(AuthFailures("missing_credentials"), 1);
  EXPECT_EQ(AuthFailures("invalid_token"), 1);

  std::unique_ptr<Client> admin = Connect(WithToken(Tls(), kAdminToken));
  std::unique_ptr<Client> trainer = Connect(WithToken(Tls(), kTrainer0Token));
  std::unique_ptr<Client> reader = Connect(WithToken(Tls(), kReaderToken));
  // Registration is the admin's.
  const std::vector<float> zeros(kNumel, 0.0f);
  absl::StatusOr<client::RegisterTensorsResult> by_trainer =
      trainer->RegisterTensors({{"w", {kNumel}, "default", zeros}});
  EXPECT_EQ(by_trainer.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(by_trainer.status().message().find("needs role admin"), absl::string_view::npos)
      << by_trainer.status();
  RegisterW(*admin);
  // A reader pulls and reads info, but does not push.
  EXPECT_TRUE(reader->GetInfo().ok());
  EXPECT_TRUE(reader->ListTensors().ok());
  EXPECT_TRUE(reader->PullParameters({}).ok());
  EXPECT_EQ(Push(*reader, "eval", 1).status().code(), absl::StatusCode::kPermissionDenied);
  client::ParamGroupOptions lr;
  lr.lr = 0.1;
  EXPECT_EQ(trainer->SetHyperparameters("default", lr).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(trainer->Checkpoint().status().code(), absl::StatusCode::kPermissionDenied);
  // A trainer pushes under its principal.
  absl::StatusOr<client::PushResult> pushed = Push(*trainer, "trainer-0", 1);
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_EQ(pushed->tensors_updated, 1u);
  EXPECT_TRUE(admin->SetHyperparameters("default", lr).ok());
  EXPECT_EQ(AuthFailures("wrong_role"), 4);
  // Health needs no token.
  absl::StatusOr<bool> healthy = Connect(Tls())->CheckHealth();
  ASSERT_TRUE(healthy.ok()) << healthy.status();
  EXPECT_TRUE(*healthy);
}

// Every method of ParameterService, called without a token with an empty request, is
// UNAUTHENTICATED: no handler forgets to ask. Reflection answers without one.
TEST_F(SecurityTest, EveryParameterServiceMethodNeedsATokenButReflectionDoesNot) {
  ServerOptions options = BaseOptions();
  options.auth_tokens_file = tokens_file_;
  Start(options);
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(target_, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          v1::ParameterService::service_full_name());
  ASSERT_NE(service, nullptr);
  ASSERT_EQ(service->method_count(), 16);
  // One call on the raw stream: `request` written (unless empty), then the reply read.
  const auto call = [&](const std::string& method, const std::string& request, std::string* reply) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::CompletionQueue cq;
    std::unique_ptr<grpc::GenericClientAsyncReaderWriter> rw =
        stub.PrepareCall(&context, method, &cq);
    void* tag;
    bool ok;
    rw->StartCall(reinterpret_cast<void*>(1));
    cq.Next(&tag, &ok);
    grpc::Slice slice(request);
    grpc::ByteBuffer message(&slice, 1);
    rw->Write(message, reinterpret_cast<void*>(2));
    cq.Next(&tag, &ok);
    rw->WritesDone(reinterpret_cast<void*>(3));
    cq.Next(&tag, &ok);
    grpc::ByteBuffer read;
    rw->Read(&read, reinterpret_cast<void*>(4));
    cq.Next(&tag, &ok);
    if (ok && reply != nullptr) {
      std::vector<grpc::Slice> slices;
      if (read.Dump(&slices).ok()) {
        for (const grpc::Slice& s : slices) reply->append(s.begin(), s.end());
      }
    }
    grpc::Status status;
    rw->Finish(&status, reinterpret_cast<void*>(5));
    while (cq.Next(&tag, &ok) && tag != reinterpret_cast<void*>(5)) {
    }
    cq.Shutdown();
    while (cq.Next(&tag, &ok)) {
    }
    return status;
  };
  for (int i = 0; i < service->method_count(); ++i) {
    const std::string method =
        absl::StrCat("/", service->full_name(), "/", service->method(i)->name());
    const grpc::Status status = call(method, "", nullptr);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << method << ": " << status.error_message();
  }
  // grpc.reflection.v1alpha.ServerReflectionRequest{list_services: ""}: field 7, length 0.
  std::string reply;
  const grpc::Status listed = call("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                   std::string("\x3a\x00", 2), &reply);
  EXPECT_TRUE(listed.ok()) << listed.error_message();
  EXPECT_NE(reply.find("fusedps.v1.ParameterService"), std::string::npos);
}

// The attack the binding stops: another principal's client_id with a huge sequence number.
// Without authentication it works (the control): the victim's next push is refused as stale
// and never applied. With tokens it is PERMISSION_DENIED, and the victim's push is applied.
TEST_F(SecurityTest, APushUnderAnotherPrincipalsClientIdIsRefused) {
  {
    Start(BaseOptions());
    std::unique_ptr<Client> anyone = Connect(ClientOptions());
    RegisterW(*anyone);
    ASSERT_TRUE(Push(*anyone, "trainer-0", uint64_t{1} << 60).ok());
    absl::StatusOr<client::PushResult> victim = Push(*anyone, "trainer-0", 1);
    EXPECT_EQ(victim.status().code(), absl::StatusCode::kAborted) << victim.status();
    server_->Shutdown(absl::ZeroDuration());
    server_.reset();
  }
  ServerOptions options = BaseOptions();
  options.auth_tokens_file = tokens_file_;
  Start(options);
  RegisterW(*Connect(WithToken(ClientOptions(), kAdminToken)));
  std::unique_ptr<Client> attacker = Connect(WithToken(ClientOptions(), kTrainer1Token));
  absl::StatusOr<client::PushResult> forged = Push(*attacker, "trainer-0", uint64_t{1} << 60);
  EXPECT_EQ(forged.status().code(), absl::StatusCode::kPermissionDenied) << forged.status();
  EXPECT_NE(forged.status().message().find("'trainer-1'"), absl::string_view::npos)
      << forged.status();
  std::unique_ptr<Client> victim = Connect(WithToken(ClientOptions(), kTrainer0Token));
  absl::StatusOr<client::PushResult> pushed = Push(*victim, "trainer-0", 1);
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_FALSE(pushed->duplicate);
  EXPECT_EQ(pushed->version, 1u);
  EXPECT_EQ(pushed->tensors_updated, 1u);
  // The retry of that push is still recognized, under the victim's own identity.
  absl::StatusOr<client::PushResult> retry = Push(*victim, "trainer-0", 1);
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_TRUE(retry->duplicate);
  EXPECT_EQ(server_->engine().version(), 1u);
  // And an empty client_id is no way around the binding.
  EXPECT_EQ(Push(*attacker, "", 0).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(AuthFailures("client_id_mismatch"), 2);
}

TEST_F(SecurityTest, TokenFileChangesApplyWithoutRestart) {
  ServerOptions options = BaseOptions();
  options.auth_tokens_file = tokens_file_;
  Start(options);
  constexpr char kNewToken[] = "new-token-0123456789abcdef";
  std::unique_ptr<Client> newcomer = Connect(WithToken(ClientOptions(), kNewToken));
  std::unique_ptr<Client> old = Connect(WithToken(ClientOptions(), kReaderToken));
  ASSERT_EQ(newcomer->GetInfo().status().code(), absl::StatusCode::kUnauthenticated);
  ASSERT_TRUE(old->GetInfo().ok());

  // The reader's token is replaced by a new one.
  WriteFileAtomically(tokens_file_,
                      absl::StrCat(kAdminToken, " admin ops\n", kNewToken, " reader eval\n"));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!newcomer->GetInfo().ok() && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(50));
  EXPECT_TRUE(newcomer->GetInfo().ok());
  EXPECT_EQ(old->GetInfo().status().code(), absl::StatusCode::kUnauthenticated);

  // A file that does not parse leaves the last good table in force.
  WriteFileAtomically(tokens_file_, "this line is not three fields long at all\n");
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_TRUE(newcomer->GetInfo().ok());
  EXPECT_EQ(old->GetInfo().status().code(), absl::StatusCode::kUnauthenticated);
}

// Reloads race calls: four readers call GetInfo while the token file is rewritten again and
// again (their token always in it), every 100 ms reload swapping the table under them. No call
// may fail (for ASan and TSan: the table's swap and its readers).
TEST_F(SecurityTest, CallsRaceTokenReloads) {
  ServerOptions options = BaseOptions();
  options.auth_tokens_file = tokens_file_;
  options.auth_tokens_reload = absl::Milliseconds(10);
  Start(options);
  std::atomic<bool> stop{false};
  std::atomic<int> calls{0};
  std::atomic<int> failures{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 4; ++t) {
    readers.emplace_back([&] {
      std::unique_ptr<Client> reader = Connect(WithToken(ClientOptions(), kReaderToken));
      while (!stop.load()) {
        if (reader->GetInfo().ok()) {
          calls.fetch_add(1);
        } else {
          failures.fetch_add(1);
        }
      }
    });
  }
  for (int i = 0; i < 40; ++i) {
    // Each version differs (a new admin token), so that each one is a real reload.
    WriteFileAtomically(tokens_file_, absl::StrCat(kReaderToken, " reader eval\n", "admin-token-",
                                                   i, "-0123456789 admin ops\n"));
    absl::SleepFor(absl::Milliseconds(20));
  }
  stop.store(true);
  for (std::thread& reader : readers) reader.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_GT(calls.load(), 0);
  // The last file is in force: its admin token works, the first file's does not.
  std::unique_ptr<Client> admin = Connect(WithToken(ClientOptions(), "admin-token-39-0123456789"));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!admin->GetInfo().ok() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_TRUE(admin->GetInfo().ok());
  EXPECT_EQ(Connect(WithToken(ClientOptions(), kAdminToken))->GetInfo().status().code(),
            absl::StatusCode::kUnauthenticated);
}

// The server's certificate is replaced while trainers push, some on open connections and one
// on a new connection for every push: no call fails, and new connections get the new
// certificate.
TEST_F(SecurityTest, CertificateRotatedUnderLoad) {
  Start(TlsOptions(/*mutual=*/true));
  RegisterW(*Connect(Tls("client")));
  std::atomic<bool> stop{false};
  std::atomic<int> pushes{0};
  std::atomic<int> failures{0};
  std::vector<std::thread> trainers;
  for (int t = 0; t < 3; ++t) {
    trainers.emplace_back([&, t] {
      std::unique_ptr<Client> open = t < 2 ? Connect(Tls("client")) : nullptr;
      for (uint64_t sequence = 1; !stop.load(); ++sequence) {
        std::unique_ptr<Client> fresh = open == nullptr ? Connect(Tls("client")) : nullptr;
        absl::StatusOr<client::PushResult> pushed = Push(open ? *open : *fresh, "trainer-0", 0);
        if (pushed.ok()) {
          pushes.fetch_add(1);
        } else {
          failures.fetch_add(1);
          ADD_FAILURE() << "trainer " << t << ": " << pushed.status();
        }
      }
    });
  }
  // The certificate a new connection gets, as PEM.
  const auto served_certificate = [&]() -> std::string {
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
        client::CreateChannel(target_, Tls("client"));
    if (!channel.ok()) return "";
    std::unique_ptr<v1::ParameterService::Stub> stub = v1::ParameterService::NewStub(*channel);
    grpc::ClientContext context;
    v1::GetInfoResponse info;
    if (!stub->GetInfo(&context, v1::GetInfoRequest(), &info).ok()) return "";
    std::vector<grpc::string_ref> pem = context.auth_context()->FindPropertyValues("x509_pem_cert");
    return pem.empty() ? "" : std::string(pem[0].data(), pem[0].size());
  };
  const std::string old_pem = ReadFile(Path("server.crt"));
  const std::string new_pem = ReadFile(Path("server2.crt"));
  ASSERT_EQ(served_certificate(), old_pem);
  while (pushes.load() < 20) absl::SleepFor(absl::Milliseconds(10));

  const int before = pushes.load();
  WriteFileAtomically(Path("server.key"), ReadFile(Path("server2.key")));
  WriteFileAtomically(Path("server.crt"), new_pem);
  const absl::Time deadline = absl::Now() + absl::Seconds(15);
  std::string served;
  while ((served = served_certificate()) != new_pem && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(served, new_pem) << "new connections still get the old certificate";
  // Pushes go on after the rotation too, on the old connections and on new ones.
  const int after_rotation = pushes.load();
  while (pushes.load() < after_rotation + 20 && absl::Now() < deadline + absl::Seconds(15)) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  stop.store(true);
  for (std::thread& trainer : trainers) trainer.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_GT(after_rotation, before);
  EXPECT_GE(pushes.load(), after_rotation + 20);
  EXPECT_EQ(server_->engine().version(), static_cast<uint64_t>(pushes.load()));
}

TEST_F(SecurityTest, BadTlsAndTokenFilesFailStartNamingTheFlag) {
  ServerOptions options = TlsOptions(/*mutual=*/false);
  options.tls.key_file = Path("server2.key");  // Not server.crt's key.
  absl::StatusOr<std::unique_ptr<Server>> mismatched = Server::Start(options);
  EXPECT_EQ(mismatched.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(mismatched.status().message().find("--tls-key"), absl::string_view::npos)
      << mismatched.status();

  options = BaseOptions();
  options.tls.client_ca_file = Path("ca.crt");
  EXPECT_EQ(Server::Start(options).status().code(), absl::StatusCode::kInvalidArgument);

  options = BaseOptions();
  options.auth_tokens_file = Path("no-such-file");
  absl::StatusOr<std::unique_ptr<Server>> missing = Server::Start(options);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("--auth-tokens"), absl::string_view::npos)
      << missing.status();
}

}  // namespace
}  // namespace fusedps
