#include "server/server_options.h"

#include <functional>
#include <string>

#include "absl/flags/marshalling.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace fusedps {
namespace {

// The options main.cc builds from default flags: valid.
ServerOptions Defaults() { return ServerOptions(); }

// ValidateServerOptions(options with `change` applied) is INVALID_ARGUMENT with `message`.
void ExpectInvalid(const std::function<void(ServerOptions&)>& change, const std::string& message) {
  ServerOptions options = Defaults();
  change(options);
  const absl::Status status = ValidateServerOptions(options);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_EQ(status.message(), message);
}

TEST(ValidateServerOptionsTest, DefaultsAreValid) {
  EXPECT_TRUE(ValidateServerOptions(Defaults()).ok());
}

TEST(ValidateServerOptionsTest, ValuesAtTheirLimitsAreValid) {
  ServerOptions options = Defaults();
  options.call_idle = absl::ZeroDuration();
  options.window_bytes = 4096;
  options.checkpoint.keep = 1;
  options.checkpoint.root = "/tmp/checkpoints";
  options.checkpoint.interval = absl::Seconds(1);
  options.checkpoint.every_versions = 10;
  options.restore = "none";
  EXPECT_TRUE(ValidateServerOptions(options).ok()) << ValidateServerOptions(options);
}

TEST(ValidateServerOptionsTest, PushPartWaitMustBePositive) {
  const std::string message = "--push-part-wait-seconds must be > 0";
  ExpectInvalid([](ServerOptions& o) { o.push_part_wait = absl::ZeroDuration(); }, message);
  ExpectInvalid([](ServerOptions& o) { o.push_part_wait = absl::Seconds(-1); }, message);
  ExpectInvalid([](ServerOptions& o) { o.push_part_wait = -absl::InfiniteDuration(); }, message);
}

TEST(ValidateServerOptionsTest, CallIdleKeepaliveAndWindow) {
  const std::string message =
      "--call-idle-seconds must be >= 0, --keepalive-seconds > 0 and --window-bytes >= 4096";
  ExpectInvalid([](ServerOptions& o) { o.call_idle = absl::Seconds(-1); }, message);
  ExpectInvalid([](ServerOptions& o) { o.keepalive = absl::ZeroDuration(); }, message);
  ExpectInvalid([](ServerOptions& o) { o.window_bytes = 4095; }, message);
}

TEST(ValidateServerOptionsTest, CheckpointIntervalKeepAndRestore) {
  const std::string message =
      "--checkpoint-interval-seconds must be >= 0, --checkpoint-keep >= 1, and --restore "
      "latest, none or a path";
  ExpectInvalid([](ServerOptions& o) { o.checkpoint.interval = absl::Seconds(-1); }, message);
  ExpectInvalid([](ServerOptions& o) { o.checkpoint.keep = 0; }, message);
  ExpectInvalid([](ServerOptions& o) { o.restore = ""; }, message);
}

TEST(ValidateServerOptionsTest, CheckpointTriggersNeedADirectory) {
  const std::string message =
      "--checkpoint-interval-seconds and --checkpoint-every-versions need --checkpoint-dir";
  ExpectInvalid([](ServerOptions& o) { o.checkpoint.interval = absl::Seconds(60); }, message);
  ExpectInvalid([](ServerOptions& o) { o.checkpoint.every_versions = 100; }, message);
}

TEST(ValidateServerOptionsTest, CredentialsReloadMustBePositive) {
  const std::string message = "--credentials-reload-seconds must be > 0";
  ExpectInvalid([](ServerOptions& o) { o.tls.reload_interval = absl::ZeroDuration(); }, message);
  ExpectInvalid([](ServerOptions& o) { o.auth_tokens_reload = absl::Seconds(-1); }, message);
}

TEST(ValidateServerOptionsTest, SyncConsistency) {
  ExpectInvalid(
      [](ServerOptions& o) {
        o.consistency.mode = ConsistencyMode::kSync;
        o.consistency.total_replicas = 0;
      },
      "--total-replicas=0 must be >= 1");
  ExpectInvalid(
      [](ServerOptions& o) {
        o.consistency.mode = ConsistencyMode::kSync;
        o.consistency.total_replicas = 2;
        o.consistency.replicas_to_aggregate = 3;
      },
      "--replicas-to-aggregate=3 must be in 1..--total-replicas (2)");
  ExpectInvalid(
      [](ServerOptions& o) {
        o.consistency.mode = ConsistencyMode::kSync;
        o.consistency.round_timeout = absl::InfiniteDuration();
      },
      "--round-timeout-seconds=inf must be finite and >= 0 (0: no timeout)");
}

// --param-copy-dtype and --mode are flags of these types: a name that is none of theirs does
// not parse (main exits 2 naming the flag), with the same message as before.
TEST(OptionFlagsTest, ParamCopyDTypeParsesByName) {
  ParamCopyDType copy = ParamCopyDType::kNone;
  std::string error;
  EXPECT_TRUE(absl::ParseFlag("bf16", &copy, &error)) << error;
  EXPECT_EQ(copy, ParamCopyDType::kBFloat16);
  EXPECT_EQ(absl::UnparseFlag(copy), "bf16");
  EXPECT_FALSE(absl::ParseFlag("int8", &copy, &error));
  EXPECT_EQ(error, "--param-copy-dtype = 'int8' must be none, bf16 or fp16");
}

TEST(OptionFlagsTest, ConsistencyModeParsesByName) {
  ConsistencyMode mode = ConsistencyMode::kAsync;
  std::string error;
  EXPECT_TRUE(absl::ParseFlag("bounded", &mode, &error)) << error;
  EXPECT_EQ(mode, ConsistencyMode::kBounded);
  EXPECT_EQ(absl::UnparseFlag(mode), "bounded");
  EXPECT_FALSE(absl::ParseFlag("eventual", &mode, &error));
  EXPECT_EQ(error, "--mode=eventual must be async, sync or bounded");
}

}  // namespace
}  // namespace fusedps
