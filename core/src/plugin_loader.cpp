#include "tessera/core/plugin_loader.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include <boost/dll/library_info.hpp>
#include <boost/dll/shared_library.hpp>

namespace tessera::core {

namespace fs = std::filesystem;
using sdk::PluginDescriptor;
using sdk::PluginKind;

struct PluginLoader::Library {
  boost::dll::shared_library handle;
  const PluginDescriptor* descriptor = nullptr;
  fs::path path;
  std::string sdk_version;  ///< "" when the descriptor predates the field
};

namespace {

/// Whether the plugin's descriptor is long enough to hold the (appended) field at `offset`.
bool covers(const PluginDescriptor& d, std::size_t offset, std::size_t size) { return d.struct_size >= offset + size; }
std::string describe_type(const fs::path& path) {
  std::error_code ec;
  switch (fs::status(path, ec).type()) {
    case fs::file_type::fifo: return "a FIFO";
    case fs::file_type::directory: return "a directory";
    case fs::file_type::character: return "a character device";
    case fs::file_type::block: return "a block device";
    case fs::file_type::socket: return "a socket";
    case fs::file_type::not_found: return "missing, or a broken symbolic link";
    case fs::file_type::regular: return "a regular file";
    default: return "not a regular file";
  }
}

}  // namespace

sdk::BuildFingerprint host_fingerprint() { return TESSERA_BUILD_FINGERPRINT; }

std::string describe(const sdk::BuildFingerprint& f) {
  std::ostringstream out;
  out << "compiler " << (f.compiler ? f.compiler : "?") << ", C++11 ABI " << f.cxx11_abi << ", LibTorch "
      << (f.torch_version ? f.torch_version : "?") << ", CUDA " << (f.cuda ? "on" : "off") << ", TOML++ "
      << (f.toml_version ? f.toml_version : "?");
  return out.str();
}

std::vector<fs::path> PluginLoader::search_path(const std::vector<std::string>& config_dirs) {
  std::vector<fs::path> dirs(config_dirs.begin(), config_dirs.end());
  if (const char* env = std::getenv("TESSERA_PLUGIN_PATH")) {
    std::stringstream list(env);
    for (std::string dir; std::getline(list, dir, ':');)
      if (!dir.empty()) dirs.emplace_back(dir);
  }
  // Beside the executable first (an installed, possibly relocated prefix), then the build tree
  // this binary came from, then the configured install prefix.
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) dirs.push_back(exe.parent_path().parent_path() / TESSERA_PLUGIN_INSTALL_SUBDIR);
  dirs.emplace_back(TESSERA_BUILD_PLUGIN_DIR);
  dirs.emplace_back(TESSERA_INSTALL_PLUGIN_DIR);
  return dirs;
}

PluginLoader::PluginLoader(std::vector<fs::path> dirs, bool never_unload)
    : dirs_(std::move(dirs)), never_unload_(never_unload) {}
PluginLoader::~PluginLoader() = default;

std::shared_ptr<PluginLoader::Library> PluginLoader::load(const fs::path& file) {
  // Only a regular file is opened: a FIFO named *.so would block the reader forever.
  std::error_code ec;
  TESSERA_CHECK(fs::is_regular_file(file, ec), file.string(), " is not a regular file (", describe_type(file),
                "): not opened");
  const auto size = fs::file_size(file, ec);
  TESSERA_CHECK(!ec && size > 0, file.string(), " is empty (0 bytes), not a shared library");
  {
    std::ifstream in(file, std::ios::binary);
    char magic[4] = {};
    in.read(magic, 4);
    TESSERA_CHECK(in.good() && std::memcmp(magic, "\x7f" "ELF", 4) == 0, file.string(),
                  in.good() ? " is not an ELF shared library (wrong magic bytes)" : " cannot be read");
  }
  // Look for the entry point in the file itself before dlopen runs any of its code.
  std::vector<std::string> aliases;
  try {
    aliases = boost::dll::library_info(file).symbols("boostdll");
  } catch (const std::exception& e) {
    TESSERA_FAIL(file.string(), " is a truncated or damaged shared library (", size,
                 " bytes; its section headers cannot be read)");
  }
  TESSERA_CHECK(std::find(aliases.begin(), aliases.end(), "tessera_plugin") != aliases.end(), file.string(),
                " is not a Tessera plugin: it exports no 'tessera_plugin' entry point. A plugin declares one with "
                "TESSERA_PLUGIN(kind, version, entries...) from <tessera/sdk/plugin.hpp>.");

  auto library = std::make_shared<Library>();
  library->path = file;
  auto mode = boost::dll::load_mode::rtld_local | boost::dll::load_mode::rtld_now;
  if (never_unload_) mode = static_cast<boost::dll::load_mode::type>(mode | RTLD_NODELETE);
  try {
    library->handle.load(file, mode);
  } catch (const std::exception& e) {
    TESSERA_FAIL("cannot load plugin ", file.string(), ": ", dlerror() ? dlerror() : e.what());
  }
  auto& get_descriptor = library->handle.get_alias<const PluginDescriptor*()>("tessera_plugin");
  const PluginDescriptor* d = get_descriptor();
  TESSERA_CHECK(d != nullptr, "plugin ", file.string(), " returned no descriptor");
  TESSERA_CHECK(d->abi_major == sdk::kAbiMajor, "plugin ", file.string(), " was built for SDK ABI ", d->abi_major, ".",
                d->abi_minor, ", this tessera speaks ", sdk::kAbiMajor, ".", sdk::kAbiMinor,
                ": rebuild the plugin against this SDK (find_package(TesseraSDK ", sdk::kAbiMajor, "))");
  TESSERA_CHECK(d->struct_size >= sdk::kDescriptorBaseSize, "plugin ", file.string(), " has a descriptor of ",
                d->struct_size, " bytes, but every SDK ABI ", sdk::kAbiMajor, " descriptor has at least ",
                sdk::kDescriptorBaseSize);
  library->sdk_version = covers(*d, offsetof(PluginDescriptor, sdk_version), sizeof(d->sdk_version)) && d->sdk_version
                             ? d->sdk_version
                             : "";
  const std::string built_against =
      library->sdk_version.empty() ? "" : " (against Tessera SDK " + library->sdk_version + ")";
  const sdk::BuildFingerprint host = host_fingerprint();
  const sdk::BuildFingerprint& f = d->fingerprint;
  auto same_string = [](const char* a, const char* b) { return a && b && std::strcmp(a, b) == 0; };
  bool same = same_string(f.compiler, host.compiler) && f.cxx11_abi == host.cxx11_abi &&
              same_string(f.torch_version, host.torch_version) && f.cuda == host.cuda &&
              same_string(f.toml_version, host.toml_version);
  TESSERA_CHECK(same, "plugin ", file.string(), " was built", built_against, " with ", describe(f),
                "; this tessera was built with ", describe(host),
                ". Plugins and host must use the same compiler, standard library, LibTorch and TOML++.");
  TESSERA_CHECK(d->entries != nullptr && d->num_entries > 0, "plugin ", file.string(), " declares no entries");
  for (std::uint32_t i = 0; i < d->num_entries; ++i) {
    const sdk::PluginEntry& e = d->entries[i];
    TESSERA_CHECK(e.name && e.create && e.destroy, "plugin ", file.string(), " entry ", i,
                  " has a null name, create or destroy function");
  }
  library->descriptor = d;
  return library;
}

std::vector<PluginInfo> PluginLoader::inspect(const fs::path& file) {
  auto library = load(file);
  libraries_.push_back(library);
  const PluginDescriptor* d = library->descriptor;
  std::vector<PluginInfo> infos;
  for (std::uint32_t i = 0; i < d->num_entries; ++i)
    infos.push_back(PluginInfo{file, d->kind, d->entries[i].name,
                               d->entries[i].description ? d->entries[i].description : "", d->version ? d->version : "",
                               d->abi_major, d->abi_minor, library->sdk_version});
  return infos;
}

void PluginLoader::scan() {
  if (scanned_) return;
  scanned_ = true;
  for (const fs::path& dir : dirs_) {
    std::error_code ec;
    if (!fs::exists(dir, ec)) {
      skipped_dirs_.push_back({dir, "does not exist"});
      continue;
    }
    if (!fs::is_directory(dir, ec)) {
      skipped_dirs_.push_back({dir, "is not a directory (" + describe_type(dir) + ")"});
      continue;
    }
    std::vector<fs::path> files;
    fs::directory_iterator it(dir, ec);
    if (ec) {
      skipped_dirs_.push_back({dir, "cannot be read: " + ec.message()});
      continue;
    }
    for (const auto& entry : it)
      if (entry.path().extension() == ".so") files.push_back(entry.path());
    std::sort(files.begin(), files.end());
    for (const fs::path& file : files) {
      try {
        for (PluginInfo& info : inspect(file)) plugins_.push_back(std::move(info));
      } catch (const sdk::Error& e) {
        rejected_.push_back({file, e.what()});
      }
    }
  }
}

const std::vector<PluginInfo>& PluginLoader::plugins() {
  scan();
  return plugins_;
}

const std::vector<RejectedPlugin>& PluginLoader::rejected() {
  scan();
  return rejected_;
}

const std::vector<RejectedPlugin>& PluginLoader::skipped_dirs() {
  scan();
  return skipped_dirs_;
}

std::shared_ptr<sdk::PluginObject> PluginLoader::create(PluginKind kind, const std::string& name,
                                                        const sdk::Options& options) {
  scan();
  const PluginInfo* wrong_kind = nullptr;
  for (const PluginInfo& info : plugins_) {
    if (info.name != name) continue;
    if (info.kind != kind) {
      wrong_kind = &info;
      continue;
    }
    auto library = *std::find_if(libraries_.begin(), libraries_.end(),
                                 [&](const auto& lib) { return lib->path == info.path; });
    const sdk::PluginEntry* entry = nullptr;
    for (std::uint32_t i = 0; i < library->descriptor->num_entries; ++i)
      if (name == library->descriptor->entries[i].name) entry = &library->descriptor->entries[i];
    sdk::PluginObject* raw = entry->create(options);
    TESSERA_CHECK(raw != nullptr, "plugin ", info.path.string(), " entry '", name, "' returned null");
    auto destroy = entry->destroy;
    // The deleter owns a reference to the library: the code of ~T() stays mapped until here.
    return std::shared_ptr<sdk::PluginObject>(raw, [destroy, library](sdk::PluginObject* object) { destroy(object); });
  }

  std::vector<std::string> same_kind, dirs;
  for (const PluginInfo& info : plugins_)
    if (info.kind == kind) same_kind.push_back(info.name);
  for (const fs::path& dir : dirs_) dirs.push_back(dir.string());
  std::ostringstream message;
  if (wrong_kind != nullptr) {
    message << "plugin '" << name << "' in " << wrong_kind->path.string() << " is a " << sdk::to_string(wrong_kind->kind)
            << " plugin, but a " << sdk::to_string(kind) << " plugin was expected.";
  } else {
    message << "no " << sdk::to_string(kind) << " plugin named '" << name << "'" << sdk::did_you_mean(name, same_kind)
            << " in the plugin directories (" << sdk::join(dirs) << ").";
  }
  message << " Available " << sdk::to_string(kind) << " plugins: "
          << (same_kind.empty() ? std::string("none") : sdk::join(same_kind)) << ".";
  for (const RejectedPlugin& r : rejected_) message << "\n  refused " << r.path.string() << ": " << r.reason;
  for (const RejectedPlugin& r : skipped_dirs_)
    message << "\n  skipped directory " << r.path.string() << ": " << r.reason;
  TESSERA_FAIL(message.str());
}

}  // namespace tessera::core
