// GPU tests of the CUDA backend's queued work, against the CPU backend: steps queued before any
// wait, group changes between queued steps, pushes from the staging arena, reads of whole
// tensors (coalesced, the param copy, into snapshots), and registration that fails or is
// undone. They skip cleanly on machines without a CUDA device.
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda_backend_test_util.h"
#ifdef FUSEDPS_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace fusedps {
namespace cuda_test {
namespace {

class CudaQueueTest : public NeedsCuda<::testing::TestWithParam<int>> {};

// Pushes of different tensor sets, queued one after another on the CUDA backend with no wait
// in between (more partial pushes than the chunk-list upload ring has slots), equal the same
// pushes stepped one at a time on the CPU backend.
TEST_P(CudaQueueTest, StepsQueuedBeforeAnyWaitEqualSynchronousSteps) {
  const int tensor_count = GetParam();
  std::mt19937 rng(7000 + tensor_count);
  const Case c = Cases()[6];  // bf16 grads, bf16 copy.
  Shard shard = MakeShard(c, tensor_count, rng);
  std::vector<Staged> pushes;
  for (int k = 0; k < 7; ++k) {
    std::vector<uint32_t> tensors;  // All; then every other from k % 3, in reverse order.
    for (int t = tensor_count - 1; t >= 0; --t) {
      if (k == 0 || t % 3 != k % 3) tensors.push_back(t);
    }
    if (k == 0) tensors = AllTensors(tensor_count);
    if (!tensors.empty()) pushes.push_back(Stage(shard, tensors, c.grad_dtype, 0, rng));
  }
  std::vector<Marker> markers;
  for (const Staged& push : pushes) {
    auto outcome = shard.cuda->Step(push.Request());
    ASSERT_TRUE(outcome.ok()) << outcome.status();
    ASSERT_FALSE(outcome->skipped);
    markers.push_back(outcome->marker);
  }
  for (const Staged& push : pushes) {
    ASSERT_TRUE(StepNow(*shard.cpu, push.Request()).ok());
    StepReference(c, push, *shard.cpu, shard);
  }
  for (auto it = markers.rbegin(); it != markers.rend(); ++it) {  // Any order.
    auto done = shard.cuda->Wait(*it);
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_GT(done->device_seconds, 0.0);
    EXPECT_GE(done->copy_wait_seconds, 0.0);
  }
  EXPECT_FALSE(shard.cuda->Wait(markers[0]).ok());  // Each marker is waited for once.
  for (int t = 0; t < tensor_count; ++t) ExpectSameState(c, shard, t);
}

// An lr change between two queued steps: the first step uses the old values, the second the
// new ones, and the host does not wait for the first step to set them.
TEST_P(CudaQueueTest, SetParamGroupBetweenQueuedStepsTakesEffectInStreamOrder) {
  const int tensor_count = GetParam();
  std::mt19937 rng(8000 + tensor_count);
  Case c = Cases()[8];  // Three groups.
  std::vector<uint64_t> sizes = Sizes(tensor_count, rng);
  sizes[0] = uint64_t{8} << 20;  // A first step long enough to be running when the lr changes.
  Shard shard = MakeShard(c, tensor_count, rng, sizes);
  const std::vector<uint32_t> all = AllTensors(tensor_count);
  const Staged first = Stage(shard, all, GradDType::kFloat32, 0, rng);
  const Staged second = Stage(shard, all, GradDType::kFloat32, 0, rng);
  Case changed = c;
  changed.groups[0].lr = 0.05;
  changed.groups[0].weight_decay = 0.2;
  changed.groups[1].lr = 1e-4;
  changed.groups[2].beta1 = 0.5;

  auto step1 = shard.cuda->Step(first.Request());
  ASSERT_TRUE(step1.ok()) << step1.status();
  for (uint32_t g = 0; g < 3; ++g) {
    ASSERT_TRUE(shard.cuda->SetParamGroup(g, changed.groups[g]).ok());
  }
  auto step2 = shard.cuda->Step(second.Request());
  ASSERT_TRUE(step2.ok()) << step2.status();
  ASSERT_TRUE(shard.cuda->Wait(step1->marker).ok());
  ASSERT_TRUE(shard.cuda->Wait(step2->marker).ok());

  ASSERT_TRUE(StepNow(*shard.cpu, first.Request()).ok());
  StepReference(c, first, *shard.cpu, shard);
  for (uint32_t g = 0; g < 3; ++g) {
    ASSERT_TRUE(shard.cpu->SetParamGroup(g, changed.groups[g]).ok());
  }
  ASSERT_TRUE(StepNow(*shard.cpu, second.Request()).ok());
  StepReference(changed, second, *shard.cpu, shard);
  for (int t = 0; t < tensor_count; ++t) ExpectSameState(changed, shard, t);
}

// The server's data path: grads written into the page-locked staging arena and copied to its
// device mirror range by range from other threads, then a step that waits for those copies.
TEST_P(CudaQueueTest, StepFromTheStagingArenaWaitsForItsCopies) {
  const int tensor_count = GetParam();
  std::mt19937 rng(9000 + tensor_count);
  const Case c = Cases()[6];  // bf16 grads.
  Shard shard = MakeShard(c, tensor_count, rng);
  const std::vector<uint32_t> all = AllTensors(tensor_count);
  const Staged staged = Stage(shard, all, c.grad_dtype, 0, rng);
  const uint64_t bytes = staged.half.size() * 2;
  constexpr uint64_t kLead = 4096;  // The push starts inside the arena, not at its start.
  auto arena = shard.cuda->AllocateStagingArena(kLead + bytes + 16);
  ASSERT_TRUE(arena.ok()) << arena.status();
  EXPECT_FALSE(shard.cuda->AllocateStagingArena(64).ok());
  std::memcpy(*arena + kLead, staged.half.data(), bytes);
  std::vector<std::thread> copiers;
  constexpr int kParts = 4;
  for (int p = 0; p < kParts; ++p) {
    copiers.emplace_back([&, p] {
      const uint64_t begin = bytes * p / kParts, end = bytes * (p + 1) / kParts;
      EXPECT_TRUE(shard.cuda->CopyStagingToDevice(kLead + begin, end - begin).ok());
    });
  }
  for (std::thread& t : copiers) t.join();
  StepRequest request = staged.Request();
  request.grads = *arena + kLead;
  auto outcome = shard.cuda->Step(request);
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  auto done = shard.cuda->Wait(outcome->marker);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_GE(done->copy_wait_seconds, 0.0);
  ASSERT_TRUE(StepNow(*shard.cpu, staged.Request()).ok());
  StepReference(c, staged, *shard.cpu, shard);
  for (int t = 0; t < tensor_count; ++t) ExpectSameState(c, shard, t);
  EXPECT_GE(shard.cuda->memory_bytes().at("grad_staging"), bytes);
}

INSTANTIATE_TEST_SUITE_P(TensorCounts, CudaQueueTest, ::testing::Values(1, 37, 424, 10000));

class CudaReadTest : public NeedsCuda<> {};

// The tensors of the read tests: tensors 1, 2 and 3 lie side by side in the arenas.
const std::vector<uint64_t> kReadSizes = {100, 9, 2049, 4099, 7, 0, 70001};

// A read laid out as a pull lays it out: tensors 1..3 at offsets that leave the arenas'
// padding between them (one coalesced copy), tensor 0 after a larger gap, tensor 6 right after
// tensor 0 in dst but not in the arenas, and the empty tensor 5. Returns the bytes it spans.
uint64_t PullLayout(uint64_t element, std::vector<uint32_t>& tensors,
                    std::vector<uint64_t>& offsets) {
  tensors = {1, 2, 3, 0, 6, 5};
  offsets.clear();
  uint64_t at = 0;
  for (uint32_t t : tensors) {
    if (t == 0) at += 64;  // A gap no arena has.
    offsets.push_back(at);
    at += AlignedNumel(kReadSizes[t]) * element;
  }
  return at;
}

TEST_F(CudaReadTest, ReadsOfManyTensorsAndOfTheParamCopyMatchReadsOfOne) {
  std::mt19937 rng(10000);
  Case c = Cases()[6];  // bf16 copy.
  Shard shard = MakeShard(c, static_cast<int>(kReadSizes.size()), rng, kReadSizes);
  const std::vector<uint32_t> all = AllTensors(static_cast<int>(kReadSizes.size()));
  ASSERT_TRUE(StepNow(*shard.cuda, Stage(shard, all, c.grad_dtype, 0, rng).Request()).ok());
  std::vector<uint32_t> tensors;
  std::vector<uint64_t> offsets;
  for (const bool param_copy : {false, true}) {
    SCOPED_TRACE(param_copy ? "param copy" : "exp_avg");
    const uint64_t element = param_copy ? 2 : 4;
    const uint64_t bytes = PullLayout(element, tensors, offsets);
    std::vector<char> dst(bytes + 64, 0x5a);  // 0x5a: bytes that no tensor may touch.
    ReadRequest read;
    read.field = param_copy ? TensorField::kParam : TensorField::kExpAvg;
    read.param_copy = param_copy;
    read.tensors = tensors;
    read.dst_offsets = offsets;
    read.dst = dst.data();
    ASSERT_TRUE(ReadNow(*shard.cuda, read).ok());
    for (size_t i = 0; i < tensors.size(); ++i) {
      const uint32_t t = tensors[i];
      const char* got = dst.data() + offsets[i];
      if (param_copy) {
        const std::vector<uint16_t> want = ReadCopy(*shard.cuda, t);
        ASSERT_EQ(0, std::memcmp(got, want.data(), want.size() * 2)) << "tensor " << t;
        const std::vector<float> params = ReadAll(*shard.cuda, TensorField::kParam, t);
        for (size_t k = 0; k < params.size(); ++k) {
          ASSERT_EQ(want[k], FloatToBFloat16(params[k])) << "tensor " << t << " element " << k;
        }
      } else {
        const std::vector<float> want = ReadAll(*shard.cuda, TensorField::kExpAvg, t);
        ASSERT_EQ(0, std::memcmp(got, want.data(), want.size() * 4)) << "tensor " << t;
      }
    }
    for (uint64_t k = offsets[3] - 64; k < offsets[3]; ++k) ASSERT_EQ(dst[k], 0x5a) << k;
    for (uint64_t k = offsets[4] + kReadSizes[6] * element; k < dst.size(); ++k) {
      ASSERT_EQ(dst[k], 0x5a) << k;
    }
  }
}

TEST_F(CudaReadTest, ReadsThatCannotBeServedFailAndQueueNothing) {
  for (const ParamCopyDType copy : {ParamCopyDType::kNone, ParamCopyDType::kBFloat16}) {
    BackendOptions options;
    options.param_copy_dtype = copy;
    auto cuda = MakeBackend("cuda:0", options);
    ASSERT_TRUE(cuda.ok());
    AdamWHyperparameters amsgrad;
    amsgrad.amsgrad = true;
    ASSERT_TRUE((*cuda)->SetParamGroup(0, {}).ok());
    ASSERT_TRUE((*cuda)->SetParamGroup(1, amsgrad).ok());
    EXPECT_EQ((*cuda)->SetParamGroup(3, {}).code(), absl::StatusCode::kInvalidArgument);
    ASSERT_TRUE((*cuda)->AddTensors({{16, 1}, {16, 0}}).ok());
    std::vector<float> dst(32, 7.0f);
    const std::vector<uint32_t> tensors = {0, 1};
    const std::vector<uint64_t> offsets = {0, 64};
    ReadRequest read;
    read.tensors = tensors;
    read.dst_offsets = offsets;
    read.dst = dst.data();
    read.field = TensorField::kMaxExpAvgSq;  // Tensor 1's group has no amsgrad.
    EXPECT_EQ((*cuda)->Read(read).code(), absl::StatusCode::kFailedPrecondition);
    read.field = TensorField::kExpAvg;
    read.param_copy = true;  // Only of params, only with a copy.
    EXPECT_EQ((*cuda)->Read(read).code(), absl::StatusCode::kFailedPrecondition);
    read.field = TensorField::kParam;
    EXPECT_EQ(ReadNow(**cuda, read).code(), copy == ParamCopyDType::kNone
                                                ? absl::StatusCode::kFailedPrecondition
                                                : absl::StatusCode::kOk);
    if (copy == ParamCopyDType::kNone) {
      EXPECT_EQ(dst, std::vector<float>(32, 7.0f));  // Nothing was copied.
    }
  }
}

// A pull's snapshot: read at one point of the stream order, then copied out from another
// thread while a step queued after the read runs: the copies hold the values from before it.
TEST_F(CudaReadTest, SnapshotHoldsTheValuesOfItsReadWhileAQueuedStepRuns) {
  std::mt19937 rng(11000);
  Shard shard = MakeShard(Cases()[0], static_cast<int>(kReadSizes.size()), rng, kReadSizes);
  const std::vector<uint32_t> all = AllTensors(static_cast<int>(kReadSizes.size()));
  std::vector<std::vector<float>> before;
  for (uint32_t t : all) before.push_back(ReadAll(*shard.cuda, TensorField::kParam, t));
  std::vector<uint32_t> tensors;
  std::vector<uint64_t> offsets;
  const uint64_t bytes = PullLayout(4, tensors, offsets);
  auto snapshot = shard.cuda->AllocateSnapshot(bytes);
  ASSERT_TRUE(snapshot.ok()) << snapshot.status();
  EXPECT_EQ(shard.cuda->memory_bytes().at("pull_snapshots"), bytes);
  ReadRequest read;
  read.tensors = tensors;
  read.dst_offsets = offsets;
  read.dst = *snapshot;
  read.dst_is_snapshot = true;
  ASSERT_TRUE(ReadNow(*shard.cuda, read).ok());
  const Staged staged = Stage(shard, all, GradDType::kFloat32, 0, rng);
  auto step = shard.cuda->Step(staged.Request());  // Queued, not waited for yet.
  ASSERT_TRUE(step.ok()) << step.status();
  std::thread puller([&] {
    for (size_t i = 0; i < tensors.size(); ++i) {
      const uint32_t t = tensors[i];
      std::vector<float> got(kReadSizes[t]);
      ASSERT_TRUE(
          shard.cuda->CopyFromSnapshot(*snapshot, offsets[i], got.size() * 4, got.data()).ok());
      EXPECT_EQ(got, before[t]) << "tensor " << t;
    }
    float past_the_end[2];
    EXPECT_EQ(shard.cuda->CopyFromSnapshot(*snapshot, bytes - 4, 8, past_the_end).code(),
              absl::StatusCode::kInvalidArgument);
  });
  puller.join();
  ASSERT_TRUE(shard.cuda->Wait(step->marker).ok());
  EXPECT_NE(ReadAll(*shard.cuda, TensorField::kParam, 0), before[0]);
  ASSERT_TRUE(shard.cuda->FreeSnapshot(*snapshot).ok());
  EXPECT_EQ(shard.cuda->memory_bytes().at("pull_snapshots"), 0u);
  EXPECT_FALSE(shard.cuda->FreeSnapshot(*snapshot).ok());
}

// Removing the newest tensors (a registration undone) and adding others in their place: the
// new ones start from zero, step 0, on the device as on the CPU backend.
TEST_F(CudaReadTest, TruncateTensorsThenAddTensorsStartsTheNewOnesFromZero) {
  std::mt19937 rng(12000);
  Case c = Cases()[7];  // amsgrad, fp16 grads, fp16 copy: every arena.
  Shard shard = MakeShard(c, 4, rng, {100, 2049, 7, 4099});
  const Staged first = Stage(shard, AllTensors(4), c.grad_dtype, 0, rng);
  for (OptimizerBackend* b : {shard.cpu.get(), shard.cuda.get()}) {
    ASSERT_TRUE(StepNow(*b, first.Request()).ok());
    EXPECT_EQ(b->TruncateTensors(5).code(), absl::StatusCode::kInvalidArgument);
    ASSERT_TRUE(b->TruncateTensors(1).ok());
    EXPECT_EQ(b->tensor_count(), 1u);
  }
  StepReference(c, first, *shard.cpu, shard);
  shard.sizes = {100, 2049 + 5, 3};  // Where tensors 1..3 were.
  shard.reference.resize(1);
  for (OptimizerBackend* b : {shard.cpu.get(), shard.cuda.get()}) {
    ASSERT_EQ(*b->AddTensors({{shard.sizes[1], 0}, {shard.sizes[2], 0}}), 1u);
  }
  for (uint32_t t = 1; t < 3; ++t) {
    EXPECT_EQ(shard.cuda->step(t), 0);
    for (TensorField f : {TensorField::kParam, TensorField::kExpAvg, TensorField::kExpAvgSq,
                          TensorField::kMaxExpAvgSq}) {
      EXPECT_EQ(ReadAll(*shard.cuda, f, t), std::vector<float>(shard.sizes[t], 0.0f)) << t;
    }
    EXPECT_EQ(ReadCopy(*shard.cuda, t), std::vector<uint16_t>(shard.sizes[t], 0)) << t;
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> values(shard.sizes[t]);
    shard.reference.emplace_back(values.size());
    for (uint64_t i = 0; i < values.size(); ++i) {
      values[i] = normal(rng);
      shard.reference[t][i].param = values[i];
    }
    ASSERT_TRUE(shard.cpu->WriteParams(t, 0, values).ok());
    ASSERT_TRUE(shard.cuda->WriteParams(t, 0, values).ok());
  }
  for (int step = 0; step < 2; ++step) {  // A full push, then a partial one.
    const Staged push =
        Stage(shard, step == 0 ? AllTensors(3) : std::vector<uint32_t>{2, 1}, c.grad_dtype, 0, rng);
    ASSERT_TRUE(StepNow(*shard.cuda, push.Request()).ok());
    ASSERT_TRUE(StepNow(*shard.cpu, push.Request()).ok());
    StepReference(c, push, *shard.cpu, shard);
  }
  for (uint32_t t = 0; t < 3; ++t) ExpectSameState(c, shard, t);
}

#ifdef FUSEDPS_HAVE_CUDA
// AddTensors that runs out of device memory, early (the params alone do not fit) or late (the
// third arena does not): RESOURCE_EXHAUSTED, and the backend is exactly as before: the same
// tensors, the same memory, and the next registration and steps work.
TEST_F(CudaReadTest, AddTensorsThatRunsOutOfMemoryChangesNothing) {
  std::mt19937 rng(13000);
  Case c = Cases()[3];  // amsgrad: four fp32 arenas.
  Shard shard = MakeShard(c, 2, rng, {1000, 37});
  const Staged first = Stage(shard, AllTensors(2), GradDType::kFloat32, 0, rng);
  for (OptimizerBackend* b : {shard.cpu.get(), shard.cuda.get()}) {
    ASSERT_TRUE(StepNow(*b, first.Request()).ok());
  }
  StepReference(c, first, *shard.cpu, shard);
  const auto bytes_before = shard.cuda->memory_bytes();
  size_t free = 0, total = 0;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_EQ(cudaMemGetInfo(&free, &total), cudaSuccess);
  for (const uint64_t numel : {uint64_t{total} / 4 + 1, uint64_t{free} * 3 / 10 / 4}) {
    SCOPED_TRACE(numel);
    auto added = shard.cuda->AddTensors({{5, 0}, {numel, 0}});
    EXPECT_EQ(added.status().code(), absl::StatusCode::kResourceExhausted) << added.status();
    EXPECT_EQ(shard.cuda->tensor_count(), 2u);
    EXPECT_EQ(shard.cuda->memory_bytes(), bytes_before);
    size_t free_after = 0;
    ASSERT_EQ(cudaMemGetInfo(&free_after, &total), cudaSuccess);
    EXPECT_LT(static_cast<int64_t>(free) - static_cast<int64_t>(free_after), int64_t{64} << 20)
        << "memory of the failed registration was not freed";
  }
  shard.sizes.push_back(300);
  for (OptimizerBackend* b : {shard.cpu.get(), shard.cuda.get()}) {
    ASSERT_EQ(*b->AddTensors({{300, 0}}), 2u);
  }
  shard.reference.emplace_back(300);
  for (int step = 0; step < 2; ++step) {
    const Staged push = Stage(shard, AllTensors(3), GradDType::kFloat32, 0, rng);
    ASSERT_TRUE(StepNow(*shard.cuda, push.Request()).ok());
    ASSERT_TRUE(StepNow(*shard.cpu, push.Request()).ok());
    StepReference(c, push, *shard.cpu, shard);
  }
  for (uint32_t t = 0; t < 3; ++t) ExpectSameState(c, shard, t);
}
#endif

}  // namespace
}  // namespace cuda_test
}  // namespace fusedps
