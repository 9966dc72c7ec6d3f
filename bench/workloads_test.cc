// Tests of the benchmarks' workload lists: the named ones DESIGN.md's table
// gives, and the t<count>x<numel> form that measures how a step's time grows
// with the tensor count.
#include "bench/workloads.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fusedps {
namespace {

TEST(WorkloadsTest, NamedWorkloadsHaveDesignSizes) {
  absl::StatusOr<std::vector<Workload>> all = MakeWorkloads("all", 1.0);
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), 4u);
  EXPECT_EQ((*all)[0].numels, std::vector<uint64_t>{100'000'000});
  EXPECT_EQ((*all)[1].numels.size(), 148u);
  EXPECT_EQ((*all)[1].total_numel(), 124'439'808u);  // GPT-2 small.
  EXPECT_EQ((*all)[2].numels, std::vector<uint64_t>(1000, 100'000));
  EXPECT_EQ((*all)[3].numels, std::vector<uint64_t>(10000, 1'000));
}

TEST(WorkloadsTest, UniformNamesGiveCountTimesNumel) {
  struct Case {
    std::string name;
    uint64_t count, numel;
  };
  for (const Case& c : {Case{"t10000x1k", 10000, 1'000}, Case{"t40000x1024", 40000, 1024},
                        Case{"t3x2m", 3, 2'000'000}, Case{"t1x1", 1, 1}}) {
    absl::StatusOr<std::vector<Workload>> w = MakeWorkloads(c.name, 1.0);
    ASSERT_TRUE(w.ok()) << c.name << ": " << w.status();
    ASSERT_EQ(w->size(), 1u);
    EXPECT_EQ((*w)[0].name, c.name);
    EXPECT_EQ((*w)[0].numels, std::vector<uint64_t>(c.count, c.numel)) << c.name;
  }
  // Scaling changes each tensor's size, never the count.
  absl::StatusOr<std::vector<Workload>> scaled = MakeWorkloads("t20x1k", 0.5);
  ASSERT_TRUE(scaled.ok()) << scaled.status();
  EXPECT_EQ((*scaled)[0].numels, std::vector<uint64_t>(20, 500));
}

TEST(WorkloadsTest, MalformedNamesAreInvalidArgument) {
  for (const char* name : {"", "t", "tx1k", "t10x", "t0x1k", "t10x0", "t10x1q", "t-1x5", "10x1k",
                           "t10y1k", "t10x1kk", "t10000001x1", "t1x10000000000k"}) {
    absl::StatusOr<std::vector<Workload>> w = MakeWorkloads(name, 1.0);
    EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument) << '"' << name << '"';
  }
  EXPECT_EQ(MakeWorkloads("t10x1k", 0.0).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace fusedps
