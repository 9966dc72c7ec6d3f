// token_table.h: the bearer tokens of --auth-tokens, and who each one is.
//
// The file has one token per line, `TOKEN ROLE PRINCIPAL [models=NAME,...]`, separated by spaces
// or tabs:
//   # comments and blank lines are ignored
//   3f9c0e1d7a2b4c5d8e6f01234567890a  trainer  trainer-0
//   77aa01c2d3e4f5a6b7c8d9e0f1a2b3c4  admin    ops
//   0123456789abcdef0123456789abcdef  reader   eval-job
//   fedcba9876543210fedcba9876543210  trainer  job-a-0   models=job-a
// - TOKEN: 16 to 1024 printable ASCII characters (no spaces), unique in the file. It is sent as
//   `authorization: Bearer TOKEN`.
// - ROLE: reader, trainer or admin (what each may call: authorizer.h).
// - PRINCIPAL: 1 to 256 bytes without spaces: who the caller is. A push's client_id must be its
//   principal. Several tokens may name one principal (for rotating a token: add the new one,
//   move the trainer over, remove the old one).
// - models= (optional): the models (server namespaces) the token may reach, comma-separated;
//   without it, every model. A call about another model is PERMISSION_DENIED ("wrong_model"),
//   ListModels shows only these, and an admin limited to some models may create and delete
//   only those.
//
// The table keeps SHA-256 digests of the tokens, not the tokens, and Find compares the digest
// of the presented token with every entry in constant time (CRYPTO_memcmp, no early exit), so
// the time it takes does not depend on how much of a token an attacker has guessed.
#ifndef FUSEDPS_SERVER_AUTH_TOKEN_TABLE_H_
#define FUSEDPS_SERVER_AUTH_TOKEN_TABLE_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fusedps {

enum class Role : uint8_t {
  kReader = 1,   // PullParameters, GetInfo, ListTensors.
  kTrainer = 2,  // The reader's calls and PushGradients.
  kAdmin = 3,    // Every call.
};

// "reader", "trainer" or "admin".
const char* RoleName(Role role);

struct Identity {
  std::string principal;
  Role role = Role::kReader;
  std::vector<std::string> models;  // The models it may reach; empty: every model.
};

class TokenTable {
 public:
  // Parses the file's text. `source` names it in errors (the path). Errors: INVALID_ARGUMENT
  // naming the line and what is wrong with it (never the token itself): a line that is not
  // three fields (or four, the fourth models=NAME[,NAME...]), a token shorter than 16 or longer
  // than 1024 characters or not printable ASCII, an unknown role, a principal longer than 256
  // bytes, a token given twice, or a file with no token at all.
  static absl::StatusOr<TokenTable> Parse(absl::string_view text, absl::string_view source);

  // Who `token` is, or nullopt when no line has it. Constant time in the token's content.
  std::optional<Identity> Find(absl::string_view token) const;

  size_t size() const { return entries_.size(); }

 private:
  using Digest = std::array<uint8_t, 32>;
  static Digest Sha256(absl::string_view bytes);

  struct Entry {
    Digest digest;
    Identity identity;
  };
  std::vector<Entry> entries_;
};

}  // namespace fusedps

#endif  // FUSEDPS_SERVER_AUTH_TOKEN_TABLE_H_
