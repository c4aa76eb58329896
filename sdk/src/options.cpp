#include "tessera/sdk/options.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <utility>

#include "tessera/sdk/error.hpp"
#include "tessera/sdk/toml_options.hpp"

namespace tessera::sdk {

Value::Value(const std::vector<std::string>& items) : variant(std::vector<Value>(items.begin(), items.end())) {}
Value::Value(const std::vector<double>& items) : variant(std::vector<Value>(items.begin(), items.end())) {}

const char* Value::type_name() const {
  static const char* const names[] = {"nothing", "boolean", "integer", "floating-point", "string", "array", "table"};
  return names[index()];
}

namespace {
/// `node` as a Value; a date or time in it is refused as the value of `where()` (a key's location,
/// worked out only then).
template <typename Where>
Value to_value(const toml::node& node, const Where& where) {
  if (const auto* table = node.as_table()) {
    std::map<std::string, Value> out;
    for (const auto& [key, item] : *table) out.emplace(std::string(key.str()), to_value(item, where));
    return out;
  }
  if (const auto* array = node.as_array()) {
    std::vector<Value> out;
    for (const toml::node& item : *array) out.push_back(to_value(item, where));
    return out;
  }
  if (const auto* v = node.as_boolean()) return v->get();
  if (const auto* v = node.as_integer()) return v->get();
  if (const auto* v = node.as_floating_point()) return v->get();
  if (const auto* v = node.as_string()) return v->get();
  // A date is no string: refused, naming the key, rather than read as anything.
  TESSERA_FAIL(where(), " holds a TOML ", toml::impl::node_type_friendly_names[static_cast<int>(node.type())],
               ", which no key takes");
}
}  // namespace

Value to_value(const toml::node& node) {
  return to_value(node, [] { return std::string("a configuration value"); });
}

Options::Options(std::string section, std::string source, std::shared_ptr<const Table> table)
    : section_(std::move(section)), source_(std::move(source)), table_(std::move(table)) {}
Options::Options() : Options("", "<defaults>", std::make_shared<const Table>()) {}

bool Options::has(const std::string& key) const { return table_->table.contains(key); }

std::vector<std::string> Options::keys() const {
  std::vector<std::string> out;
  for (const auto& [key, node] : table_->table) out.emplace_back(key.str());
  return out;
}

Value Options::value(const std::string& key) const {
  const toml::node* node = table_->table.get(key);
  if (node == nullptr) return Value();
  return to_value(*node, [&] { return locate(key); });
}

Options Options::sub_table(const std::string& key) const {
  mark_used(key);
  const toml::node* node = table_->table.get(key);
  if (node == nullptr) return make_options(section_ + "." + key, source_, toml::table{});
  TESSERA_CHECK(node->is_table(), locate(key), " must be a table, e.g. [", section_, ".", key, "]");
  return make_options(section_ + "." + key, source_, *node->as_table());
}

namespace {
Options::KeyObserver& key_observer() {
  static Options::KeyObserver observer;
  return observer;
}
}  // namespace

Options::KeyObserver Options::observe_keys(KeyObserver observer) {
  return std::exchange(key_observer(), std::move(observer));
}

void Options::note_key(const Key& key, const Value& fallback, const std::vector<std::string>* choices) const {
  if (key_observer()) key_observer()(*this, KeyRecord{key, fallback, choices});
}

std::string Options::locate(const std::string& key) const {
  std::string where = source_;
  const toml::node* node = table_->table.get(key);
  if (node != nullptr && node->source().path && *node->source().path != source_)
    where = *node->source().path;  // a value from elsewhere, e.g. the host's "--set section.key=value"
  else if (node != nullptr && node->source().begin.line > 0)
    where += ":" + std::to_string(node->source().begin.line);
  return where + ": [" + section_ + "] " + key;
}

void Options::wrong_type(const std::string& key, const char* expected, const std::string& hint) const {
  const Value found = value(key);
  TESSERA_FAIL(locate(key), " must be ", expected, ", found ", found.type_name(),
               found.is<std::string>() ? " \"" + found.as<std::string>() + "\"" : "", hint);
}

Value Options::read(const Key& key, const Value& fallback, const std::vector<std::string>* choices) const {
  used_.insert(key.name);
  note_key(key, fallback, choices);
  return value(key.name);
}

std::int64_t Options::get_int(const Key& key, std::int64_t fallback, std::int64_t min, std::int64_t max) const {
  const Value found = read(key, fallback);
  if (found.absent()) return fallback;
  if (!found.is<std::int64_t>()) wrong_type(key.name, "an integer");
  const std::int64_t value = found.as<std::int64_t>();
  TESSERA_CHECK(value == fallback || (value >= min && value <= max), locate(key.name), " = ", value,
                " is out of range [", min, ", ", max, "]");
  return value;
}

namespace {
/// An integer or a float as a double; null for anything else.
std::optional<double> number(const Value& value) {
  if (value.is<std::int64_t>()) return static_cast<double>(value.as<std::int64_t>());
  if (value.is<double>()) return value.as<double>();
  return std::nullopt;
}
}  // namespace

double Options::get_double(const Key& key, double fallback, double min, double max) const {
  const Value found = read(key, fallback);
  if (found.absent()) return fallback;
  const std::optional<double> value = number(found);
  if (!value) {
    // A quoted number, e.g. norm_type = "inf": TOML's numbers (inf and nan too) go unquoted.
    std::string hint;
    if (found.is<std::string>()) {
      const std::string& text = found.as<std::string>();
      char* end = nullptr;
      std::strtod(text.c_str(), &end);
      if (!text.empty() && end == text.c_str() + text.size()) hint = ": write it without quotes (" + text + ")";
    }
    wrong_type(key.name, "a number", hint);
  }
  // A key may always be set to its default, e.g. a NaN that means "not set" (as listed by tessera config).
  const bool is_default = *value == fallback || (std::isnan(*value) && std::isnan(fallback));
  TESSERA_CHECK(is_default || (*value >= min && *value <= max), locate(key.name), " = ", *value, " is out of range [",
                min, ", ", max, "]");
  return *value;
}

bool Options::get_bool(const Key& key, bool fallback) const {
  const Value found = read(key, fallback);
  if (found.absent()) return fallback;
  if (!found.is<bool>()) wrong_type(key.name, "true or false");
  return found.as<bool>();
}

std::string Options::string_value(const Key& key, const std::string& fallback,
                                  const std::vector<std::string>* choices) const {
  const Value found = read(key, fallback, choices);
  if (found.absent()) return fallback;
  if (!found.is<std::string>()) wrong_type(key.name, "a string");
  return found.as<std::string>();
}

std::string Options::get_string(const Key& key, const std::string& fallback) const {
  return string_value(key, fallback, nullptr);
}

std::string Options::get_choice(const Key& key, const std::string& fallback,
                                const std::vector<std::string>& choices) const {
  std::string value = string_value(key, fallback, &choices);
  for (const auto& choice : choices)
    if (choice == value) return value;
  TESSERA_FAIL(locate(key.name), " = \"", value, "\" is not valid", did_you_mean(value, choices),
               "; valid: ", join(choices));
}

std::vector<std::string> Options::get_string_list(const Key& key, const std::vector<std::string>& fallback) const {
  const Value found = read(key, fallback);
  if (found.absent()) return fallback;
  if (found.is<std::string>()) return {found.as<std::string>()};
  if (!found.is<std::vector<Value>>()) wrong_type(key.name, "an array of strings");
  std::vector<std::string> out;
  for (const Value& item : found.as<std::vector<Value>>()) {
    if (!item.is<std::string>()) wrong_type(key.name, "an array of strings");
    out.push_back(item.as<std::string>());
  }
  return out;
}

std::vector<double> Options::get_double_list(const Key& key, const std::vector<double>& fallback) const {
  const Value found = read(key, fallback);
  if (found.absent()) return fallback;
  if (!found.is<std::vector<Value>>()) wrong_type(key.name, "an array of numbers");
  std::vector<double> out;
  for (const Value& item : found.as<std::vector<Value>>()) {
    const std::optional<double> value = number(item);
    if (!value) wrong_type(key.name, "an array of numbers");
    out.push_back(*value);
  }
  return out;
}

void Options::mark_used(const std::string& key) const { used_.insert(key); }

void Options::check_all_used(const std::vector<std::string>& extra_known) const {
  std::set<std::string> names(used_.begin(), used_.end());
  names.insert(extra_known.begin(), extra_known.end());
  std::vector<std::string> known(names.begin(), names.end());
  for (const auto& [key, node] : table_->table) {
    std::string name(key.str());
    if (used_.count(name) || std::find(extra_known.begin(), extra_known.end(), name) != extra_known.end()) continue;
    TESSERA_FAIL(locate(name), " is not a known key", did_you_mean(name, known), "; known keys: ", join(known));
  }
}

}  // namespace tessera::sdk
