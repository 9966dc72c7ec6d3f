#include "server/auth/token_table.h"

#include <string>

#include "gtest/gtest.h"

namespace fusedps {
namespace {

constexpr char kTrainerToken[] = "trainer-token-0123456789";
constexpr char kAdminToken[] = "admin-token-abcdefghijk";

TEST(TokenTableTest, FindsEachTokensIdentity) {
  const std::string text = std::string("# fusedps tokens\n\n") + kTrainerToken +
                           "  trainer\ttrainer-0\r\n" + kAdminToken + " admin ops\n" +
                           "reader-token-0123456789 reader eval\n";
  absl::StatusOr<TokenTable> table = TokenTable::Parse(text, "tokens.txt");
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(table->size(), 3u);
  std::optional<Identity> trainer = table->Find(kTrainerToken);
  ASSERT_TRUE(trainer.has_value());
  EXPECT_EQ(trainer->principal, "trainer-0");
  EXPECT_EQ(trainer->role, Role::kTrainer);
  std::optional<Identity> admin = table->Find(kAdminToken);
  ASSERT_TRUE(admin.has_value());
  EXPECT_EQ(admin->principal, "ops");
  EXPECT_EQ(admin->role, Role::kAdmin);
  EXPECT_EQ(table->Find("reader-token-0123456789")->role, Role::kReader);
}

TEST(TokenTableTest, ModelsLimitAToken) {
  absl::StatusOr<TokenTable> table =
      TokenTable::Parse(std::string(kTrainerToken) + " trainer t0 models=job-a,job-b\n" +
                            kAdminToken + " admin ops\n",
                        "t");
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(table->Find(kTrainerToken)->models, (std::vector<std::string>{"job-a", "job-b"}));
  EXPECT_TRUE(table->Find(kAdminToken)->models.empty());  // Every model.
}

TEST(TokenTableTest, UnknownPrefixesAndExtensionsAreNotFound) {
  absl::StatusOr<TokenTable> table =
      TokenTable::Parse(std::string(kTrainerToken) + " trainer trainer-0\n", "t");
  ASSERT_TRUE(table.ok()) << table.status();
  const std::string token = kTrainerToken;
  EXPECT_FALSE(table->Find("").has_value());
  EXPECT_FALSE(table->Find(token.substr(0, token.size() - 1)).has_value());
  EXPECT_FALSE(table->Find(token + "x").has_value());
  EXPECT_FALSE(table->Find("Trainer-token-0123456789").has_value());
}

TEST(TokenTableTest, RefusesBadLinesNamingTheLineButNotTheToken) {
  struct Case {
    std::string text;
    std::string error;
  };
  const std::string good = std::string(kTrainerToken) + " trainer t0\n";
  const Case cases[] = {
      {good + "only-two-fields-here-1234 admin\n", "line 2: has 2 fields"},
      {good + "short admin ops\n", "line 2: the token must be 16 to 1024"},
      {good + "admin-token-abcdefghijk superuser ops\n", "role 'superuser'"},
      {good + std::string(kTrainerToken) + " admin ops\n", "line 2: repeats the token"},
      {good + "admin-token-abcdefghijk admin " + std::string(257, 'p') + "\n",
       "principal is longer than 256"},
      {good + "admin-token-abcdefghijk admin ops job-a\n", "fourth field must be models="},
      {good + "admin-token-abcdefghijk admin ops models=\n", "fourth field must be models="},
      {good + "admin-token-abcdefghijk admin ops models=a,,b\n", "models= has an empty name"},
      {good + "admin-token-abcdefghijk admin ops models=a extra\n", "has 5 fields"},
      {"# nothing\n\n", "has no token"},
      {"", "has no token"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<TokenTable> table = TokenTable::Parse(c.text, "tokens.txt");
    ASSERT_FALSE(table.ok()) << c.text;
    EXPECT_EQ(table.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(table.status().message().find(c.error), absl::string_view::npos) << table.status();
    EXPECT_NE(table.status().message().find("tokens.txt"), absl::string_view::npos);
    EXPECT_EQ(table.status().message().find(kTrainerToken), absl::string_view::npos);
  }
}

}  // namespace
}  // namespace fusedps
