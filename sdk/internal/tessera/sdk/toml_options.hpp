#pragma once
/// The host's side of sdk::Options: built from a parsed TOML table, and read back as one. Not
/// installed and not seen by plugins (their contract holds no TOML++ type); the host, the engine's
/// tests and the SDK itself include it (target tessera::sdk_toml).
#include <memory>
#include <string>

#include <toml++/toml.h>

#include "tessera/sdk/options.hpp"

namespace tessera::sdk {

struct Options::Table {
  toml::table table;
};

struct OptionsAccess {
  /// `section` is the dotted table name ("strategy"), `source` the file it came from.
  static Options make(std::string section, std::string source, toml::table table) {
    return Options(std::move(section), std::move(source),
                   std::make_shared<const Options::Table>(Options::Table{std::move(table)}));
  }
  static const toml::table& table(const Options& options) { return options.table_->table; }
};

inline Options make_options(std::string section, std::string source, toml::table table) {
  return OptionsAccess::make(std::move(section), std::move(source), std::move(table));
}
inline const toml::table& toml_table(const Options& options) { return OptionsAccess::table(options); }

/// A TOML node as a Value (a table as a name-ordered map).
TESSERA_SDK_API Value to_value(const toml::node& node);

}  // namespace tessera::sdk
