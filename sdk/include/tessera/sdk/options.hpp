#pragma once
/// A plugin's TOML table, as handed to its factory. Typed getters validate and remember
/// which keys were read; the host rejects any key no one read ("unknown key, did you mean").
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <toml++/toml.h>

#include "tessera/sdk/export.hpp"

namespace tessera::sdk {

class TESSERA_SDK_API Options {
 public:
  /// `section` is the dotted table name ("strategy"), `source` the file it came from.
  Options(std::string section, std::string source, toml::table table);
  Options();  ///< An empty table (plugins created from code, e.g. in tests).

  const std::string& section() const { return section_; }
  const std::string& source() const { return source_; }
  const toml::table& table() const { return table_; }
  bool has(const std::string& key) const;

  // Each getter marks the key as used, checks the TOML type (an integer is accepted
  // where a float is expected) and throws sdk::Error naming file, line and key.
  std::int64_t get_int(const std::string& key, std::int64_t fallback, std::int64_t min = INT64_MIN,
                       std::int64_t max = INT64_MAX) const;
  double get_double(const std::string& key, double fallback, double min = -1e300, double max = 1e300) const;
  bool get_bool(const std::string& key, bool fallback) const;
  std::string get_string(const std::string& key, const std::string& fallback) const;
  /// A string that must be one of `choices` (error lists them, with "did you mean").
  std::string get_choice(const std::string& key, const std::string& fallback,
                         const std::vector<std::string>& choices) const;
  /// An array of strings; a single string is accepted as a one-element list.
  std::vector<std::string> get_string_list(const std::string& key, const std::vector<std::string>& fallback) const;
  std::vector<double> get_double_list(const std::string& key, const std::vector<double>& fallback) const;

  /// Declare a key as known without reading it (e.g. "plugin", read by the host).
  void mark_used(const std::string& key) const;
  /// Throws for the first key that no getter read, suggesting the closest used/known key.
  void check_all_used(const std::vector<std::string>& extra_known = {}) const;

  /// "file.toml:12: [strategy] key" — for messages about a key's value.
  std::string locate(const std::string& key) const;

  /// Reports the value a key absent from the table takes (the getters do, with their
  /// fallback): a factory that parses a key itself (a string or an integer, say) calls it, so
  /// that `tessera config` lists the key with its default.
  void note_default(const std::string& key, const toml::node& value) const;
  /// While set, receives every default noted by any Options (tessera config's listing);
  /// returns the observer it replaces.
  using DefaultObserver = std::function<void(const Options& options, const std::string& key, const toml::node& value)>;
  static DefaultObserver observe_defaults(DefaultObserver observer);

 private:
  const toml::node* find(const std::string& key) const;
  /// "... key must be <expected>, found string \"x\"<hint>"
  [[noreturn]] void wrong_type(const std::string& key, const char* expected, const std::string& hint = "") const;

  std::string section_;
  std::string source_;
  toml::table table_;
  mutable std::set<std::string> used_;
};

}  // namespace tessera::sdk
