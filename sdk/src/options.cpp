#include "tessera/sdk/options.hpp"

#include <cmath>
#include <cstdlib>
#include <type_traits>
#include <utility>

#include "tessera/sdk/error.hpp"

namespace tessera::sdk {

Options::Options(std::string section, std::string source, toml::table table)
    : section_(std::move(section)), source_(std::move(source)), table_(std::move(table)) {}
Options::Options() : Options("", "<defaults>", toml::table{}) {}

bool Options::has(const std::string& key) const { return table_.contains(key); }

namespace {
Options::KeyObserver& key_observer() {
  static Options::KeyObserver observer;
  return observer;
}

/// `fallback` as a TOML value, for the observer.
toml::array as_array(const std::vector<std::string>& items) {
  toml::array out;
  for (const auto& item : items) out.push_back(item);
  return out;
}
toml::array as_array(const std::vector<double>& items) {
  toml::array out;
  for (double item : items) out.push_back(item);
  return out;
}
}  // namespace

Options::KeyObserver Options::observe_keys(KeyObserver observer) {
  return std::exchange(key_observer(), std::move(observer));
}

void Options::note_key(const Key& key, const toml::node& fallback, const std::vector<std::string>* choices) const {
  if (key_observer()) key_observer()(*this, KeyRecord{key, fallback, choices});
}

std::string Options::locate(const std::string& key) const {
  std::string where = source_;
  const toml::node* node = table_.get(key);
  if (node != nullptr && node->source().path && *node->source().path != source_)
    where = *node->source().path;  // a value from elsewhere, e.g. the host's "--set section.key=value"
  else if (node != nullptr && node->source().begin.line > 0)
    where += ":" + std::to_string(node->source().begin.line);
  return where + ": [" + section_ + "] " + key;
}

void Options::wrong_type(const std::string& key, const char* expected, const std::string& hint) const {
  const toml::node* node = table_.get(key);
  std::string found(toml::impl::node_type_friendly_names[static_cast<int>(node->type())]);
  if (node->is_string()) found += " \"" + node->as_string()->get() + "\"";
  TESSERA_FAIL(locate(key), " must be ", expected, ", found ", found, hint);
}

/// The key's node (null when absent), marking it used and reporting it with its fallback.
template <typename Fallback>
const toml::node* Options::read(const Key& key, const Fallback& fallback,
                                const std::vector<std::string>* choices) const {
  used_.insert(key.name);
  if (key_observer()) {
    if constexpr (std::is_same_v<Fallback, std::vector<std::string>> || std::is_same_v<Fallback, std::vector<double>>)
      note_key(key, as_array(fallback), choices);
    else note_key(key, toml::value<Fallback>(fallback), choices);
  }
  return table_.get(key.name);
}

std::int64_t Options::get_int(const Key& key, std::int64_t fallback, std::int64_t min, std::int64_t max) const {
  const toml::node* node = read(key, fallback);
  if (node == nullptr) return fallback;
  if (!node->is_integer()) wrong_type(key.name, "an integer");
  std::int64_t value = node->as_integer()->get();
  TESSERA_CHECK(value == fallback || (value >= min && value <= max), locate(key.name), " = ", value,
                " is out of range [", min, ", ", max, "]");
  return value;
}

double Options::get_double(const Key& key, double fallback, double min, double max) const {
  const toml::node* node = read(key, fallback);
  if (node == nullptr) return fallback;
  if (!node->is_number()) {
    // A quoted number, e.g. norm_type = "inf": TOML's numbers (inf and nan too) go unquoted.
    std::string hint;
    if (node->is_string()) {
      const std::string& text = node->as_string()->get();
      char* end = nullptr;
      std::strtod(text.c_str(), &end);
      if (!text.empty() && end == text.c_str() + text.size()) hint = ": write it without quotes (" + text + ")";
    }
    wrong_type(key.name, "a number", hint);
  }
  double value = node->is_integer() ? static_cast<double>(node->as_integer()->get()) : node->as_floating_point()->get();
  // A key may always be set to its default, e.g. a NaN that means "not set" (as listed by tessera config).
  const bool is_default = value == fallback || (std::isnan(value) && std::isnan(fallback));
  TESSERA_CHECK(is_default || (value >= min && value <= max), locate(key.name), " = ", value, " is out of range [", min,
                ", ", max, "]");
  return value;
}

bool Options::get_bool(const Key& key, bool fallback) const {
  const toml::node* node = read(key, fallback);
  if (node == nullptr) return fallback;
  if (!node->is_boolean()) wrong_type(key.name, "true or false");
  return node->as_boolean()->get();
}

std::string Options::string_value(const Key& key, const std::string& fallback,
                                  const std::vector<std::string>* choices) const {
  const toml::node* node = read(key, fallback, choices);
  if (node == nullptr) return fallback;
  if (!node->is_string()) wrong_type(key.name, "a string");
  return node->as_string()->get();
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
  const toml::node* node = read(key, fallback);
  if (node == nullptr) return fallback;
  if (node->is_string()) return {node->as_string()->get()};
  if (!node->is_array()) wrong_type(key.name, "an array of strings");
  std::vector<std::string> out;
  for (const toml::node& item : *node->as_array()) {
    if (!item.is_string()) wrong_type(key.name, "an array of strings");
    out.push_back(item.as_string()->get());
  }
  return out;
}

std::vector<double> Options::get_double_list(const Key& key, const std::vector<double>& fallback) const {
  const toml::node* node = read(key, fallback);
  if (node == nullptr) return fallback;
  if (!node->is_array()) wrong_type(key.name, "an array of numbers");
  std::vector<double> out;
  for (const toml::node& item : *node->as_array()) {
    if (!item.is_number()) wrong_type(key.name, "an array of numbers");
    out.push_back(item.is_integer() ? static_cast<double>(item.as_integer()->get()) : item.as_floating_point()->get());
  }
  return out;
}

void Options::mark_used(const std::string& key) const { used_.insert(key); }

void Options::check_all_used(const std::vector<std::string>& extra_known) const {
  std::set<std::string> names(used_.begin(), used_.end());
  names.insert(extra_known.begin(), extra_known.end());
  std::vector<std::string> known(names.begin(), names.end());
  for (const auto& [key, node] : table_) {
    std::string name(key.str());
    if (used_.count(name) || std::find(extra_known.begin(), extra_known.end(), name) != extra_known.end()) continue;
    TESSERA_FAIL(locate(name), " is not a known key", did_you_mean(name, known), "; known keys: ", join(known));
  }
}

}  // namespace tessera::sdk
