// json_string.h: a string as a JSON string literal, for tools that print JSON by hand.
#ifndef FUSEDPS_COMMON_JSON_STRING_H_
#define FUSEDPS_COMMON_JSON_STRING_H_

#include <string>

#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

namespace fusedps {

// Quotes `text`, escaping '"', '\' and control characters; other bytes (UTF-8) pass through.
inline std::string JsonString(absl::string_view text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", static_cast<unsigned char>(c));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

}  // namespace fusedps

#endif  // FUSEDPS_COMMON_JSON_STRING_H_
