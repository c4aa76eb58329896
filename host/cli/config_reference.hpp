#pragma once
// docs/configuration-reference.md: every key, its default and its doc, from the code.
#include <string>
#include <vector>

namespace tessera::host {

/// Every key of the host's sections and of every plugin found on the search path (the
/// `plugin_dirs` given, $TESSERA_PLUGIN_PATH, the install and build directories), with its
/// default and the doc its getter was given (sdk::Key), as Markdown: `tessera config --reference`.
/// Each plugin is created from an empty table (as `tessera config` creates the selected ones),
/// the host's sections from probes that also reach its keys that apply only beside another.
std::string configuration_reference(const std::vector<std::string>& plugin_dirs);

}  // namespace tessera::host
