#include "common/logging.h"

#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace fusedps {
namespace {

// Collects the messages logged while it is alive.
class CapturingSink : public google::LogSink {
 public:
  CapturingSink() { google::AddLogSink(this); }
  ~CapturingSink() override { google::RemoveLogSink(this); }

  void send(google::LogSeverity, const char*, const char*, int, const google::LogMessageTime&,
            const char* message, size_t message_len) override {
    std::lock_guard<std::mutex> lock(mu_);
    messages_.emplace_back(message, message_len);
  }

  std::vector<std::string> messages() {
    std::lock_guard<std::mutex> lock(mu_);
    return messages_;
  }

 private:
  std::mutex mu_;
  std::vector<std::string> messages_;
};

void LogFailure(int call) { FUSEDPS_LOG_EVERY_SECONDS(WARNING, 3600) << "failure " << call; }

TEST(LogEverySecondsTest, LogsTheFirstCallAndSuppressesRepeatsWithinTheWindow) {
  CapturingSink sink;
  for (int call = 0; call < 5; ++call) LogFailure(call);
  EXPECT_EQ(sink.messages(), std::vector<std::string>{"failure 0"});
}

TEST(LogEverySecondsTest, LogsAgainOnceTheWindowHasPassed) {
  CapturingSink sink;
  for (int round = 0; round < 2; ++round) {
    for (int call = 0; call < 3; ++call) {
      FUSEDPS_LOG_EVERY_SECONDS(WARNING, 0.05) << "round " << round << " call " << call;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(60));
  }
  EXPECT_EQ(sink.messages(), (std::vector<std::string>{"round 0 call 0", "round 1 call 0"}));
}

TEST(LogEverySecondsTest, EachStatementHasItsOwnWindow) {
  CapturingSink sink;
  for (int call = 0; call < 3; ++call) {
    FUSEDPS_LOG_EVERY_SECONDS(WARNING, 3600) << "first statement";
    FUSEDPS_LOG_EVERY_SECONDS(WARNING, 3600) << "second statement";
  }
  EXPECT_EQ(sink.messages(), (std::vector<std::string>{"first statement", "second statement"}));
}

TEST(LogEverySecondsTest, IsOneStatementUnderAnUnbracedIf) {
  CapturingSink sink;
  for (int call = 0; call < 3; ++call) {
    if (call == 1)
      FUSEDPS_LOG_EVERY_SECONDS(WARNING, 3600) << "call " << call;
    else
      LOG(INFO) << "else " << call;
  }
  EXPECT_EQ(sink.messages(), (std::vector<std::string>{"else 0", "call 1", "else 2"}));
}

TEST(LogEverySecondsTest, ConcurrentCallersLogOnce) {
  CapturingSink sink;
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([] {
      for (int call = 0; call < 100; ++call) {
        FUSEDPS_LOG_EVERY_SECONDS(ERROR, 3600) << "concurrent";
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(sink.messages(), std::vector<std::string>{"concurrent"});
}

}  // namespace
}  // namespace fusedps

int main(int argc, char** argv) {
  fusedps::InitLogging(argv[0]);
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
