// fuzz_input.h: the layout of the fuzz targets' inputs, which corpus_gen writes and the targets
// read.
//
// An input is two setup bytes, then the messages of one call:
//   byte 0   mode: what the target does with it is in its file (which shard, which window)
//   byte 1   slicing: how each message is cut into slices, as gRPC hands a receive buffer over
//            (Slices below)
//   then     the messages, each a 2-byte little-endian length and that many bytes of a
//            serialized request; the last one may be shorter than its length says.
// push_message_fuzz takes everything after the two bytes as one message, without a length.
#ifndef FUSEDPS_TESTS_FUZZ_FUZZ_INPUT_H_
#define FUSEDPS_TESTS_FUZZ_FUZZ_INPUT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace fusedps::fuzz {

struct FuzzInput {
  uint8_t mode = 0;
  uint8_t slicing = 0;
  absl::string_view rest;                   // Everything after the two setup bytes.
  std::vector<absl::string_view> messages;  // rest, split (at most max_messages).
};

inline FuzzInput ParseFuzzInput(const uint8_t* data, size_t size, size_t max_messages) {
  FuzzInput input;
  if (size >= 1) input.mode = data[0];
  if (size >= 2) input.slicing = data[1];
  if (size <= 2) return input;
  input.rest = absl::string_view(reinterpret_cast<const char*>(data) + 2, size - 2);
  absl::string_view left = input.rest;
  while (left.size() >= 2 && input.messages.size() < max_messages) {
    const size_t length = static_cast<uint8_t>(left[0]) | static_cast<uint8_t>(left[1]) << 8;
    left.remove_prefix(2);
    input.messages.push_back(left.substr(0, length));
    left.remove_prefix(input.messages.back().size());
  }
  return input;
}

inline std::string EncodeFuzzInput(uint8_t mode, uint8_t slicing,
                                   const std::vector<std::string>& messages) {
  std::string out = {static_cast<char>(mode), static_cast<char>(slicing)};
  for (const std::string& m : messages) {
    out.push_back(static_cast<char>(m.size() & 0xff));
    out.push_back(static_cast<char>(m.size() >> 8 & 0xff));
    out += m;
  }
  return out;
}

// `message` cut into slices: one slice when slicing % 64 is 0, else slices of slicing % 64
// bytes (the last shorter); with bit 6, an empty slice in front of each. Bit 7 is left to the
// target.
inline std::vector<absl::string_view> Slices(absl::string_view message, uint8_t slicing) {
  const size_t size = slicing & 0x3f;
  const bool empties = (slicing & 0x40) != 0;
  std::vector<absl::string_view> slices;
  if (size == 0) {
    if (empties) slices.push_back(absl::string_view());
    slices.push_back(message);
    return slices;
  }
  for (size_t at = 0; at < message.size(); at += size) {
    if (empties) slices.push_back(absl::string_view());
    slices.push_back(message.substr(at, size));
  }
  return slices;
}

}  // namespace fusedps::fuzz

#endif  // FUSEDPS_TESTS_FUZZ_FUZZ_INPUT_H_
