// tessera config's listing: every key read, as a config, with its default and doc.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <functional>
#include <map>
#include <sstream>

#include "config/config.hpp"
#include "tessera/sdk/error.hpp"

namespace tessera::host {

std::string toml_value(const sdk::Value& value) {
  if (value.is<double>()) {
    const double v = value.as<double>();
    if (std::isnan(v)) return "nan";
    if (std::isinf(v)) return v < 0 ? "-inf" : "inf";
    char text[32];
    const auto end = std::to_chars(text, text + sizeof(text), v).ptr;
    std::string out(text, end);
    return out.find_first_of(".e") == std::string::npos ? out + ".0" : out;
  }
  if (value.is<std::vector<sdk::Value>>()) {
    std::vector<std::string> out;
    for (const sdk::Value& item : value.as<std::vector<sdk::Value>>()) out.push_back(toml_value(item));
    return "[" + sdk::join(out) + "]";
  }
  if (value.is<std::map<std::string, sdk::Value>>()) {
    std::vector<std::string> out;
    for (const auto& [key, item] : value.as<std::map<std::string, sdk::Value>>()) {
      const std::string line = toml_line(key, item);
      out.push_back(line.substr(0, line.size() - 1));  // without its newline
    }
    return out.empty() ? "{}" : "{ " + sdk::join(out) + " }";
  }
  toml::table one;  // a bool, an integer or a string, as TOML++ writes it
  if (value.is<bool>()) one.insert("k", value.as<bool>());
  if (value.is<std::int64_t>()) one.insert("k", value.as<std::int64_t>());
  if (value.is<std::string>()) one.insert("k", value.as<std::string>());
  std::ostringstream out;
  out << toml::toml_formatter(one, toml::format_flags::none);
  return out.str().empty() ? "" : out.str().substr(4);  // after "k = "
}

std::string toml_line(const std::string& key, const sdk::Value& value, const std::string& doc) {
  toml::table one;
  one.insert(key, 0);
  std::ostringstream name;
  name << toml::toml_formatter(one, toml::format_flags::none);  // the key, quoted where TOML needs it
  const std::string line = name.str();
  return line.substr(0, line.rfind(" = ")) + " = " + toml_value(value) + (doc.empty() ? "" : "  # " + doc) + "\n";
}

namespace {

std::map<std::string, std::map<std::string, sdk::Value>>& noted_defaults() {  // section -> key -> default
  static std::map<std::string, std::map<std::string, sdk::Value>> defaults;
  return defaults;
}
std::map<std::string, std::map<std::string, std::string>>& noted_docs() {  // section -> key -> doc
  static std::map<std::string, std::map<std::string, std::string>> docs;
  return docs;
}
}  // namespace

std::string key_doc(const sdk::KeyRecord& record) {
  std::string doc = record.key.doc;
  if (record.choices != nullptr) {
    std::vector<std::string> quoted;
    for (const std::string& choice : *record.choices) quoted.push_back(choice.empty() ? "\"\"" : choice);
    doc += (doc.empty() ? "" : " ") + std::string("[") + sdk::join(quoted, " | ") + "]";
  }
  return doc;
}

void note_defaults() {
  sdk::Options::observe_keys([](const sdk::Options& options, const sdk::KeyRecord& record) {
    noted_defaults()[options.section()].insert_or_assign(record.key.name, record.fallback);
    std::string& doc = noted_docs()[options.section()][record.key.name];
    if (doc.empty()) doc = key_doc(record);  // a second read without a doc (a check elsewhere) keeps it
  });
}

std::string list_config(const Config& config) {
  const auto& defaults = noted_defaults();
  // Sections in the order the README's table gives them, each followed by its sub-tables.
  std::vector<std::string> order = {"trainer", "optimizer", "lr_scheduler", "lr_find", "launch", "logger"};
  order.insert(order.end(), kPluginSections.begin(), kPluginSections.end());
  order.push_back("callbacks");
  std::vector<std::string> sections;
  std::function<void(const std::string&, const toml::table*)> add = [&](const std::string& name, const toml::table* t) {
    if (std::find(sections.begin(), sections.end(), name) == sections.end()) sections.push_back(name);
    if (t != nullptr)
      for (const auto& [key, node] : *t)
        if (node.is_table()) add(name + "." + std::string(key.str()), node.as_table());
    for (const auto& [section, table] : defaults)
      if (section.rfind(name + ".", 0) == 0 && section.find('.', name.size() + 1) == std::string::npos)
        add(section, nullptr);
  };
  for (const std::string& name : order) add(name, config.resolved[name].as_table());
  std::ostringstream out;
  out << "# " << config.path() << " as tessera reads it: every key of the host and of the selected plugins,\n"
      << "# the file's and --set's values as they are, each default commented out.\n";
  if (const toml::node* dirs = config.resolved.get("plugin_dirs"))
    out << toml_line("plugin_dirs", sdk::to_value(*dirs));
  for (const std::string& section : sections) {
    const toml::table* set = config.resolved.at_path(section).as_table();
    const auto noted = defaults.find(section);
    const auto docs = noted_docs().find(section);
    auto doc = [&](const std::string& key) {
      if (docs == noted_docs().end() || !docs->second.count(key)) return std::string();
      return docs->second.at(key);
    };
    std::string body;
    if (set != nullptr)
      for (const auto& [key, node] : *set)
        if (!node.is_table())
          body += toml_line(std::string(key.str()), sdk::to_value(node), doc(std::string(key.str())));
    if (noted != defaults.end())
      for (const auto& [key, value] : noted->second)
        if (set == nullptr || !set->contains(key)) body += "# " + toml_line(key, value, doc(key));
    const bool has_subsections = std::any_of(sections.begin(), sections.end(), [&](const std::string& other) {
      return other.rfind(section + ".", 0) == 0;
    });
    if (!body.empty() || (set != nullptr && !has_subsections)) out << "\n[" << section << "]\n" << body;
  }
  return out.str();
}

}  // namespace tessera::host
