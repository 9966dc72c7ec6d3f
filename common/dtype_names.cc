#include "common/dtype_names.h"

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace fusedps::dtypes {
namespace {

struct Entry {
  std::string name = "?";        // "bfloat16"; "?": no dtype (UNSPECIFIED, a code not in the enum)
  std::string short_name = "?";  // "bf16"
  int element_bytes = 0;
};

// One enum's members, indexed by code (the codes are small); UNSPECIFIED and the codes the enum
// lacks are the "?" entry.
struct Table {
  std::vector<Entry> by_code;
  std::map<std::string, int> by_spelling;  // Both spellings, lower case.
  std::vector<std::string> short_names;    // In declaration order.
};

Table Build(const google::protobuf::EnumDescriptor& enum_type, absl::string_view prefix) {
  Table table;
  for (int i = 0; i < enum_type.value_count(); ++i) {
    const google::protobuf::EnumValueDescriptor& value = *enum_type.value(i);
    std::string member = value.name();
    if (!absl::StartsWith(member, prefix)) continue;  // Not a dtype of this enum's pattern.
    member = absl::AsciiStrToLower(member.substr(prefix.size()));
    if (member == "unspecified") continue;
    Entry entry;
    entry.name = member;
    entry.short_name = absl::StrReplaceAll(member, {{"bfloat", "bf"}, {"float", "fp"}});
    // The trailing bit count: "bfloat16" -> 16 -> 2 bytes.
    size_t digits = member.size();
    while (digits > 0 && absl::ascii_isdigit(static_cast<unsigned char>(member[digits - 1]))) {
      --digits;
    }
    entry.element_bytes = digits < member.size() ? std::stoi(member.substr(digits)) / 8 : 0;
    table.by_spelling[entry.name] = value.number();
    table.by_spelling[entry.short_name] = value.number();
    table.short_names.push_back(entry.short_name);
    if (static_cast<size_t>(value.number()) >= table.by_code.size()) {
      table.by_code.resize(static_cast<size_t>(value.number()) + 1);
    }
    table.by_code[static_cast<size_t>(value.number())] = std::move(entry);
  }
  return table;
}

const Table& Wire() {
  static const Table* const table = new Table(Build(*v1::DType_descriptor(), "DTYPE_"));
  return *table;
}

const Table& State() {
  static const Table* const table = new Table(Build(*v1::StateDType_descriptor(), "STATE_DTYPE_"));
  return *table;
}

const Table& Fields() {
  static const Table* const table =
      new Table(Build(*v1::TensorField_descriptor(), "TENSOR_FIELD_"));
  return *table;
}

const Entry& Find(const Table& table, int code) {
  static const Entry* const none = new Entry();
  const bool known = code >= 0 && static_cast<size_t>(code) < table.by_code.size();
  return known ? table.by_code[static_cast<size_t>(code)] : *none;
}

std::string Join(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) absl::StrAppend(&out, i + 1 == names.size() ? " or " : ", ");
    absl::StrAppend(&out, names[i]);
  }
  return out;
}

absl::StatusOr<int> Parse(const Table& table, absl::string_view spelling) {
  auto it = table.by_spelling.find(absl::AsciiStrToLower(spelling));
  if (it != table.by_spelling.end()) return it->second;
  return absl::InvalidArgumentError(
      absl::StrCat("must be ", Join(table.short_names), ", not ", spelling));
}

}  // namespace

const char* Name(v1::DType dtype) { return Find(Wire(), dtype).name.c_str(); }
const char* Name(v1::StateDType dtype) { return Find(State(), dtype).name.c_str(); }
const char* ShortName(v1::DType dtype) { return Find(Wire(), dtype).short_name.c_str(); }
const char* ShortName(v1::StateDType dtype) { return Find(State(), dtype).short_name.c_str(); }
int ElementBytes(v1::DType dtype) { return Find(Wire(), dtype).element_bytes; }
int ElementBytes(v1::StateDType dtype) { return Find(State(), dtype).element_bytes; }

absl::StatusOr<v1::DType> ParseDType(absl::string_view spelling) {
  absl::StatusOr<int> code = Parse(Wire(), spelling);
  if (!code.ok()) return code.status();
  return static_cast<v1::DType>(*code);
}

absl::StatusOr<v1::StateDType> ParseStateDType(absl::string_view spelling) {
  absl::StatusOr<int> code = Parse(State(), spelling);
  if (!code.ok()) return code.status();
  return static_cast<v1::StateDType>(*code);
}

const char* TensorFieldName(v1::TensorField field) { return Find(Fields(), field).name.c_str(); }

absl::StatusOr<v1::TensorField> ParseTensorField(absl::string_view name) {
  absl::StatusOr<int> code = Parse(Fields(), name);
  if (!code.ok()) return code.status();
  return static_cast<v1::TensorField>(*code);
}

}  // namespace fusedps::dtypes
