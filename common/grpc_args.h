// grpc_args.h: the HTTP/2 transport settings of fusedps's channels and server, one list for
// both ends, and an override from the environment for tuning on a new network.
//
// FUSEDPS_GRPC_ARGS="name=int,name=int" (gRPC channel argument names, integer values, e.g.
// "grpc.http2.max_frame_size=1048576") adds or replaces arguments of every channel a fusedps
// client makes and of the server's listener; it is read once per channel or server. Anything
// that does not parse is ignored (the tuning is an optimization, never a requirement).
//
// Usage:
//   ForEachTransportArg([&](const std::string& name, int value) { args.SetInt(name, value); });
#ifndef FUSEDPS_COMMON_GRPC_ARGS_H_
#define FUSEDPS_COMMON_GRPC_ARGS_H_

#include <cstdlib>
#include <functional>
#include <map>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

namespace fusedps {

// Calls set(name, value) for each transport argument: the defaults, then FUSEDPS_GRPC_ARGS.
// The defaults: HTTP/2 frames of up to 16 MiB (gRPC's default is 16 KiB: a 4 MiB message then
// takes 256 frames, each framed, flow-controlled and parsed on the connection's one thread) and
// a 16 MiB write buffer. On an H100 host's loopback they took one trainer's pushes over 8
// streams from 5.75 to 7.6-8.3 GB/s, and one stream's from 2.06 to 2.69 (docs/benchmarks.md).
inline void ForEachTransportArg(const std::function<void(const std::string&, int)>& set) {
  std::map<std::string, int> args = {{"grpc.http2.max_frame_size", 16777215},
                                     {"grpc.http2.write_buffer_size", 16777215}};
  if (const char* env = std::getenv("FUSEDPS_GRPC_ARGS"); env != nullptr) {
    for (absl::string_view item : absl::StrSplit(env, ',', absl::SkipEmpty())) {
      std::pair<std::string, std::string> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
      int value = 0;
      if (!kv.first.empty() && absl::SimpleAtoi(kv.second, &value)) args[kv.first] = value;
    }
  }
  for (const auto& [name, value] : args) set(name, value);
}

}  // namespace fusedps

#endif  // FUSEDPS_COMMON_GRPC_ARGS_H_
