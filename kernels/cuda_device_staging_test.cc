// GPU tests of device workspaces' backend side (kernels/cuda/device_staging.cuh): shared device
// memory, and gradients copied from device memory into the staging arena's mirror, checked on
// the way, then stepped, against the CPU backend stepping the same gradients from host memory
// (and the float64 reference), with the check against the host's (SeeGrads). Skipped without a
// CUDA device.
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda_backend_test_util.h"
#include "kernels/grad_check.h"
#ifdef FUSEDPS_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace fusedps {
namespace cuda_test {
namespace {

#ifdef FUSEDPS_HAVE_CUDA

class CudaDeviceStagingTest : public NeedsCuda<::testing::Test> {};

TEST_F(CudaDeviceStagingTest, SharedMemoryIsZeroedAndExportedOnlyWithADevice) {
  BackendOptions options;
  absl::StatusOr<std::unique_ptr<OptimizerBackend>> cuda = MakeBackend("cuda:0", options);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  absl::StatusOr<SharedDeviceMemory> shared = (*cuda)->AllocateSharedDeviceMemory(5000);
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_EQ(shared->ipc_handle.size(), sizeof(cudaIpcMemHandle_t));
  EXPECT_EQ(shared->device_uuid.size(), 40u);
  EXPECT_EQ(shared->device_uuid.substr(0, 4), "GPU-");
  std::vector<char> host(5000, 1);
  ASSERT_EQ(cudaMemcpy(host.data(), shared->data, host.size(), cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(std::vector<char>(5000, 0), host);
  (*cuda)->FreeSharedDeviceMemory(shared->data);
  const absl::StatusOr<SharedDeviceMemory> none =
      MakeCpuBackend(options)->AllocateSharedDeviceMemory(5000);
  EXPECT_TRUE(absl::IsFailedPrecondition(none.status())) << none.status();
}

// The wire bytes of staged's tensors packed one after another from byte `shift` of a device
// buffer (as a trainer's bucket lies in its workspace: no alignment between tensors), and the
// copies that move each to its place in the arena.
struct OnDevice {
  char* memory = nullptr;
  std::vector<DeviceStagingCopy> copies;
  ~OnDevice() { cudaFree(memory); }
};

void PutOnDevice(const Staged& staged, const std::vector<uint64_t>& sizes, uint64_t shift,
                 const std::vector<uint16_t>& half, OnDevice* out) {  // half: staged's.
  const uint64_t size = DTypeSize(staged.dtype);
  std::vector<char> packed(shift);
  for (size_t r = 0; r < staged.tensors.size(); ++r) {
    const uint64_t bytes = sizes[staged.tensors[r]] * size;
    const char* src = staged.dtype == GradDType::kFloat32
                          ? reinterpret_cast<const char*>(staged.f32.data() + staged.offsets[r])
                          : reinterpret_cast<const char*>(half.data() + staged.offsets[r]);
    out->copies.push_back({nullptr, staged.offsets[r] * size, bytes});
    out->copies.back().src = reinterpret_cast<const void*>(packed.size());  // Fixed below.
    packed.insert(packed.end(), src, src + bytes);
  }
  ASSERT_EQ(cudaMalloc(&out->memory, packed.size() + 1), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(out->memory, packed.data(), packed.size(), cudaMemcpyHostToDevice),
            cudaSuccess);
  for (DeviceStagingCopy& c : out->copies) {
    c.src = out->memory + reinterpret_cast<uintptr_t>(c.src);
  }
}

// staged's gradients put on the device and copied into `backend`'s arena: what the copy's
// check saw, and what the host's check sees of the same values.
struct Copied {
  absl::StatusOr<GradCheck> seen;
  GradCheck expected;
};

GradCheck SeenOnHost(const Staged& staged, const std::vector<uint64_t>& sizes,
                     const std::vector<uint16_t>& half);

Copied CopyFromDevice(OptimizerBackend& backend, const Staged& staged,
                      const std::vector<uint64_t>& sizes, uint64_t shift) {
  OnDevice device;
  PutOnDevice(staged, sizes, shift, staged.half, &device);
  return {backend.CopyDeviceToStaging(device.copies, staged.dtype),
          SeenOnHost(staged, sizes, staged.half)};
}

GradCheck SeenOnHost(const Staged& staged, const std::vector<uint64_t>& sizes,
                     const std::vector<uint16_t>& half) {
  GradCheck seen;
  for (size_t r = 0; r < staged.tensors.size(); ++r) {
    const void* at = staged.dtype == GradDType::kFloat32
                         ? static_cast<const void*>(staged.f32.data() + staged.offsets[r])
                         : static_cast<const void*>(half.data() + staged.offsets[r]);
    MergeGradChecks(&seen, SeeGrads(at, staged.dtype, sizes[staged.tensors[r]]));
  }
  return seen;
}

// fp32 and bf16 gradients, from 16-byte aligned places and from places one element further
// (the kernel's vector and element paths), over more tensors than one launch takes (96): three
// steps each, then every stored byte against the CPU backend's.
TEST_F(CudaDeviceStagingTest, CopiedGradsStepAsHostGradsDoAndTheCheckSeesWhatTheHostSees) {
  for (const int which : {0, 6}) {  // defaults (fp32 grads); bf16 grads with a bf16 copy.
    for (const int shift_elements : {0, 1}) {
      const Case c = Cases()[which];
      const uint64_t shift = shift_elements * DTypeSize(c.grad_dtype);
      SCOPED_TRACE(c.name + " shift " + std::to_string(shift));  // Bytes.
      std::mt19937 rng(77 + which + shift);
      const int tensor_count = 130;
      Shard shard = MakeShard(c, tensor_count, rng);
      const std::vector<uint32_t> all = AllTensors(tensor_count);
      uint64_t arena_bytes = 0;
      for (uint64_t n : shard.sizes) arena_bytes += AlignedNumel(n) * 4;
      absl::StatusOr<char*> arena = shard.cuda->AllocateStagingArena(arena_bytes);
      ASSERT_TRUE(arena.ok()) << arena.status();
      for (int step = 1; step <= 3; ++step) {
        const Staged staged = Stage(shard, all, c.grad_dtype, 0, rng);
        const Copied copied = CopyFromDevice(*shard.cuda, staged, shard.sizes, shift);
        ASSERT_TRUE(copied.seen.ok()) << copied.seen.status();
        EXPECT_TRUE(copied.seen->finite);
        EXPECT_EQ(copied.seen->max_abs, copied.expected.max_abs);
        StepRequest from_arena = staged.Request();
        from_arena.grads = *arena;  // Its mirror holds them now.
        ASSERT_NO_FATAL_FAILURE(StepBoth(c, staged, shard, from_arena));
      }
      for (int t = 0; t < tensor_count; ++t) ExpectSameState(c, shard, t);
      // One non-finite element anywhere is seen; the largest finite magnitude still is.
      const Staged bad = Stage(shard, all, c.grad_dtype, 0, rng);
      Staged poisoned = bad;
      const uint32_t victim = 5;
      ASSERT_GT(shard.sizes[victim], 0u);
      poisoned.f32[bad.offsets[victim]] = INFINITY;
      poisoned.half[bad.offsets[victim]] = 0x7f80;  // +inf in bf16.
      const Copied copied = CopyFromDevice(*shard.cuda, poisoned, shard.sizes, shift);
      ASSERT_TRUE(copied.seen.ok()) << copied.seen.status();
      EXPECT_FALSE(copied.seen->finite);
      EXPECT_FALSE(copied.expected.finite);
      EXPECT_EQ(copied.seen->max_abs, copied.expected.max_abs);
    }
  }
}

TEST_F(CudaDeviceStagingTest, RangesOutsideTheArenaOrOfPartElementsAreInvalid) {
  BackendOptions options;
  absl::StatusOr<std::unique_ptr<OptimizerBackend>> cuda = MakeBackend("cuda:0", options);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  char* src = nullptr;
  ASSERT_EQ(cudaMalloc(&src, 4096), cudaSuccess);
  const std::vector<DeviceStagingCopy> before = {{src, 0, 64}};
  EXPECT_TRUE(absl::IsInvalidArgument(
      (*cuda)->CopyDeviceToStaging(before, GradDType::kFloat32).status()));  // No arena yet.
  ASSERT_TRUE((*cuda)->AllocateStagingArena(1024).ok());
  for (const DeviceStagingCopy& bad :
       {DeviceStagingCopy{src, 1000, 64}, DeviceStagingCopy{src, 0, 6},
        DeviceStagingCopy{nullptr, 0, 64}, DeviceStagingCopy{src + 2, 0, 64}}) {
    const std::vector<DeviceStagingCopy> copies = {{src, 0, 64}, bad};
    const absl::Status s = (*cuda)->CopyDeviceToStaging(copies, GradDType::kFloat32).status();
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_NE(s.message().find("copy 1"), absl::string_view::npos) << s;
  }
  cudaFree(src);
}

#endif  // FUSEDPS_HAVE_CUDA

}  // namespace
}  // namespace cuda_test
}  // namespace fusedps
