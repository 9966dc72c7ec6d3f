#include "server/auth/token_table.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace fusedps {
namespace {

constexpr size_t kMinTokenBytes = 16;
constexpr size_t kMaxTokenBytes = 1024;
constexpr size_t kMaxPrincipalBytes = 256;

bool PrintableAscii(absl::string_view s) {
  for (char c : s) {
    if (c < 0x21 || c > 0x7e) return false;
  }
  return true;
}

std::optional<Role> ParseRole(absl::string_view name) {
  for (Role role : {Role::kReader, Role::kTrainer, Role::kAdmin}) {
    if (name == RoleName(role)) return role;
  }
  return std::nullopt;
}

}  // namespace

const char* RoleName(Role role) {
  switch (role) {
    case Role::kReader:
      return "reader";
    case Role::kTrainer:
      return "trainer";
    case Role::kAdmin:
      return "admin";
  }
  return "unknown";
}

TokenTable::Digest TokenTable::Sha256(absl::string_view bytes) {
  Digest digest;
  unsigned int length = 0;
  // EVP_Digest fails only when OpenSSL cannot allocate or has no SHA-256: a broken process.
  if (EVP_Digest(bytes.data(), bytes.size(), digest.data(), &length, EVP_sha256(), nullptr) != 1 ||
      length != digest.size()) {
    std::abort();
  }
  return digest;
}

absl::StatusOr<TokenTable> TokenTable::Parse(absl::string_view text, absl::string_view source) {
  TokenTable table;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (fields.empty() || fields[0][0] == '#') continue;
    const auto bad = [&](absl::string_view what) {
      return absl::InvalidArgumentError(
          absl::StrCat("--auth-tokens ", source, " line ", line_number, ": ", what));
    };
    if (fields.size() != 3 && fields.size() != 4) {
      return bad(absl::StrCat("has ", fields.size(),
                              " fields; each line is 'TOKEN ROLE PRINCIPAL [models=NAME,...]'"));
    }
    const absl::string_view token = fields[0];
    if (token.size() < kMinTokenBytes || token.size() > kMaxTokenBytes || !PrintableAscii(token)) {
      return bad(absl::StrCat("the token must be ", kMinTokenBytes, " to ", kMaxTokenBytes,
                              " printable ASCII characters"));
    }
    const std::optional<Role> role = ParseRole(fields[1]);
    if (!role.has_value()) {
      return bad(absl::StrCat("role '", fields[1], "' must be reader, trainer or admin"));
    }
    if (fields[2].size() > kMaxPrincipalBytes) {
      return bad(absl::StrCat("the principal is longer than ", kMaxPrincipalBytes, " bytes"));
    }
    Entry entry{Sha256(token), Identity{std::string(fields[2]), *role, {}}};
    if (fields.size() == 4) {
      absl::string_view models = fields[3];
      if (!absl::ConsumePrefix(&models, "models=") || models.empty()) {
        return bad("the fourth field must be models=NAME[,NAME...]");
      }
      for (absl::string_view model : absl::StrSplit(models, ',')) {
        if (model.empty()) return bad("models= has an empty name");
        entry.identity.models.emplace_back(model);
      }
    }
    for (const Entry& other : table.entries_) {
      if (other.digest == entry.digest) return bad("repeats the token of an earlier line");
    }
    table.entries_.push_back(std::move(entry));
  }
  if (table.entries_.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth-tokens ", source, " has no token (lines 'TOKEN ROLE PRINCIPAL')"));
  }
  return table;
}

std::optional<Identity> TokenTable::Find(absl::string_view token) const {
  const Digest digest = Sha256(token);
  const Entry* found = nullptr;
  for (const Entry& entry : entries_) {
    // Every entry is compared, whichever matches: no early exit.
    const bool match = CRYPTO_memcmp(entry.digest.data(), digest.data(), digest.size()) == 0;
    if (match) found = &entry;
  }
  if (found == nullptr) return std::nullopt;
  return found->identity;
}

}  // namespace fusedps
