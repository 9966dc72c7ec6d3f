// device_arenas.cu: a shard's device arenas (device_arenas.cuh).
#include <algorithm>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_arenas.cuh"

namespace fusedps {
namespace gpu {
namespace {

// Queues zeroing elements [from, capacity) of an array.
template <typename T>
absl::Status ZeroTail(DeviceArray<T>& array, uint64_t from, cudaStream_t stream) {
  if (array.capacity() <= from) return absl::OkStatus();
  FUSEDPS_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(array.data() + from, 0, (array.capacity() - from) * sizeof(T), stream));
  return absl::OkStatus();
}

}  // namespace

std::vector<BufferGrowth> DeviceArenaSet::ToHold(const ArenaSizes& n, bool amsgrad, bool copy) {
  std::vector<BufferGrowth> growths = {
      params32_.ToHold(n.params32), params16_.ToHold(n.params16),
      exp_avg32_.ToHold(n.state32), exp_avg_sq32_.ToHold(n.state32),
      exp_avg16_.ToHold(n.state16), exp_avg_sq16_.ToHold(n.state16),
      exp_avg8_.ToHold(n.state8),   exp_avg_sq8_.ToHold(n.state8),
      absmax_m_.ToHold(n.scales()), absmax_v_.ToHold(n.scales())};
  if (amsgrad) growths.push_back(max_exp_avg_sq_.ToHold(n.state32));
  if (copy) growths.push_back(copy_.ToHold(n.params32));
  return growths;
}

absl::Status DeviceArenaSet::ZeroFrom(const ArenaSizes& n, cudaStream_t stream) {
  for (absl::Status s :
       {ZeroTail(params32_, n.params32, stream), ZeroTail(copy_, n.params32, stream),
        ZeroTail(params16_, n.params16, stream), ZeroTail(exp_avg32_, n.state32, stream),
        ZeroTail(exp_avg_sq32_, n.state32, stream), ZeroTail(max_exp_avg_sq_, n.state32, stream),
        ZeroTail(exp_avg16_, n.state16, stream), ZeroTail(exp_avg_sq16_, n.state16, stream),
        ZeroTail(exp_avg8_, n.state8, stream), ZeroTail(exp_avg_sq8_, n.state8, stream),
        ZeroTail(absmax_m_, n.scales(), stream), ZeroTail(absmax_v_, n.scales(), stream)}) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

Arenas DeviceArenaSet::Pointers() const {
  return {params32_.data(),       params16_.data(),  exp_avg32_.data(),    exp_avg_sq32_.data(),
          max_exp_avg_sq_.data(), exp_avg16_.data(), exp_avg_sq16_.data(), exp_avg8_.data(),
          exp_avg_sq8_.data(),    absmax_m_.data(),  absmax_v_.data()};
}

DeviceArenas DeviceArenaSet::KernelView() const {
  DeviceArenas a{};
  a.params32 = params32_.data();
  a.params16 = params16_.data();
  a.copy = copy_.data();
  a.exp_avg32 = exp_avg32_.data();
  a.exp_avg_sq32 = exp_avg_sq32_.data();
  a.max_exp_avg_sq = max_exp_avg_sq_.data();
  a.exp_avg16 = exp_avg16_.data();
  a.exp_avg_sq16 = exp_avg_sq16_.data();
  a.exp_avg8 = exp_avg8_.data();
  a.exp_avg_sq8 = exp_avg_sq8_.data();
  a.absmax_m = absmax_m_.data();
  a.absmax_v = absmax_v_.data();
  return a;
}

std::map<std::string, uint64_t> DeviceArenaSet::Bytes() const {
  return {{"params", params32_.bytes() + params16_.bytes()},
          {"exp_avg", exp_avg32_.bytes() + exp_avg16_.bytes() + exp_avg8_.bytes()},
          {"exp_avg_sq", exp_avg_sq32_.bytes() + exp_avg_sq16_.bytes() + exp_avg_sq8_.bytes()},
          {"max_exp_avg_sq", max_exp_avg_sq_.bytes()},
          {"state_scales", absmax_m_.bytes() + absmax_v_.bytes()},
          {"param_copy", copy_.bytes()}};
}

std::vector<DeviceBuffer*> DeviceArenaSet::Buffers() {
  return {&params32_,  &params16_,     &copy_,     &exp_avg32_,   &exp_avg_sq32_, &max_exp_avg_sq_,
          &exp_avg16_, &exp_avg_sq16_, &exp_avg8_, &exp_avg_sq8_, &absmax_m_,     &absmax_v_};
}

}  // namespace gpu
}  // namespace fusedps
