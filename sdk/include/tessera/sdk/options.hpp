#pragma once
/// A plugin's TOML table, as handed to its factory. Typed getters validate and remember
/// which keys were read; the host rejects any key no one read ("unknown key, did you mean").
/// No TOML library's type is part of it: the host parses the file (sdk/internal/).
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "tessera/sdk/export.hpp"

namespace tessera::sdk {

/// A key as a getter reads it, with its one-line doc next to the field it sets:
/// `o.get_int({"min_num_params", "the size policy's threshold"}, 100000000, 0)`. The doc is what
/// `tessera config` prints beside the key and what docs/configuration-reference.md is generated
/// from; a plain "name" reads a key without one (plugins of one's own, tests).
struct TESSERA_SDK_API Key {
  Key(const char* name) : name(name) {}             // NOLINT: implicit, as a plain name
  Key(std::string name) : name(std::move(name)) {}  // NOLINT
  Key(std::string name, std::string doc) : name(std::move(name)), doc(std::move(doc)) {}
  std::string name, doc;
};

/// A configuration value (TOML's types, without a TOML library in the plugin contract): what
/// value() returns for a key a factory parses itself, and the default a key reports. Empty
/// (std::monostate) for a key that is absent.
struct TESSERA_SDK_API Value : std::variant<std::monostate, bool, std::int64_t, double, std::string, std::vector<Value>,
                                            std::map<std::string, Value>> {
  using variant::variant;
  Value(const char* text) : variant(std::string(text)) {}  // NOLINT: a string, never a bool
  Value(const std::vector<std::string>& items);            // NOLINT: an array of strings
  Value(const std::vector<double>& items);                 // NOLINT: an array of numbers

  bool absent() const { return std::holds_alternative<std::monostate>(*this); }
  template <typename T>
  bool is() const { return std::holds_alternative<T>(*this); }
  /// The value as T (std::bad_variant_access when it holds another type). On a temporary, such as
  /// what Options::value() returns, a copy: a reference into it would dangle.
  template <typename T>
  const T& as() const& { return std::get<T>(*this); }
  template <typename T>
  T as() && { return std::get<T>(std::move(*this)); }
  /// TOML's name of the type ("integer", "string", ...), for messages.
  const char* type_name() const;
};

/// What a getter reports of each key it reads (tessera config's listing, the generated reference).
struct KeyRecord {
  const Key& key;
  const Value& fallback;                    ///< the value the key takes when absent
  const std::vector<std::string>* choices;  ///< get_choice's valid values, else null
};

class TESSERA_SDK_API Options {
 public:
  Options();  ///< An empty table (plugins created from code, e.g. in tests).

  /// `section` is the dotted table name ("strategy"), `source` the file it came from.
  const std::string& section() const { return section_; }
  const std::string& source() const { return source_; }
  bool has(const std::string& key) const;
  /// The keys present, in name order.
  std::vector<std::string> keys() const;
  /// A key's value as the file gives it (empty when absent), neither marking it used nor reporting
  /// it: for a key a factory parses itself (a string or an integer, say), with mark_used and note_key.
  Value value(const std::string& key) const;
  /// The sub-table [section.key] as Options of its own (empty when absent), marking `key` used;
  /// a key that is not a table is an error naming it.
  Options sub_table(const std::string& key) const;

  // Each getter marks the key as used, checks the TOML type (an integer is accepted
  // where a float is expected) and throws sdk::Error naming file, line and key.
  std::int64_t get_int(const Key& key, std::int64_t fallback, std::int64_t min = INT64_MIN,
                       std::int64_t max = INT64_MAX) const;
  double get_double(const Key& key, double fallback, double min = -1e300, double max = 1e300) const;
  bool get_bool(const Key& key, bool fallback) const;
  std::string get_string(const Key& key, const std::string& fallback) const;
  /// A string that must be one of `choices` (error lists them, with "did you mean").
  std::string get_choice(const Key& key, const std::string& fallback, const std::vector<std::string>& choices) const;
  /// An array of strings; a single string is accepted as a one-element list.
  std::vector<std::string> get_string_list(const Key& key, const std::vector<std::string>& fallback) const;
  std::vector<double> get_double_list(const Key& key, const std::vector<double>& fallback) const;

  /// Declare a key as known without reading it (e.g. "plugin", read by the host).
  void mark_used(const std::string& key) const;
  /// Throws for the first key that no getter read, suggesting the closest used/known key.
  void check_all_used(const std::vector<std::string>& extra_known = {}) const;

  /// "file.toml:12: [strategy] key" — for messages about a key's value.
  std::string locate(const std::string& key) const;

  /// Reports a key read, with the value it takes when absent (the getters do, with their
  /// fallback): a factory that parses a key itself (a string or an integer, say) calls it, so
  /// that `tessera config` lists the key with its default and doc.
  void note_key(const Key& key, const Value& fallback, const std::vector<std::string>* choices = nullptr) const;
  /// While set, receives every key read by any Options (tessera config's listing and the
  /// configuration reference); returns the observer it replaces.
  using KeyObserver = std::function<void(const Options& options, const KeyRecord& record)>;
  static KeyObserver observe_keys(KeyObserver observer);

 private:
  struct Table;                 ///< the parsed TOML table, which the host builds (toml_options.hpp)
  friend struct OptionsAccess;  ///< the host's side, outside the contract
  Options(std::string section, std::string source, std::shared_ptr<const Table> table);

  /// The key's value (empty when absent), marking it used and reporting it with its fallback.
  Value read(const Key& key, const Value& fallback, const std::vector<std::string>* choices = nullptr) const;
  std::string string_value(const Key& key, const std::string& fallback, const std::vector<std::string>* choices) const;
  /// "... key must be <expected>, found string \"x\"<hint>"
  [[noreturn]] void wrong_type(const std::string& key, const char* expected, const std::string& hint = "") const;

  std::string section_;
  std::string source_;
  std::shared_ptr<const Table> table_;  ///< immutable, shared by copies
  mutable std::set<std::string> used_;
};

}  // namespace tessera::sdk
