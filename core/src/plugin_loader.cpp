#include "plugin_loader.hpp"

#include <cxxabi.h>
#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>

#include <boost/dll/library_info.hpp>
#include <boost/dll/shared_library.hpp>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

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

/// The ELF machine this tessera runs on, and its name.
#if defined(__x86_64__)
constexpr int kHostMachine = EM_X86_64;
constexpr const char* kHostMachineName = "x86-64";
#elif defined(__aarch64__)
constexpr int kHostMachine = EM_AARCH64;
constexpr const char* kHostMachineName = "aarch64";
#else
constexpr int kHostMachine = -1;
constexpr const char* kHostMachineName = "this machine";
#endif

std::string machine_name(int machine) {
  switch (machine) {
    case EM_X86_64: return "x86-64";
    case EM_AARCH64: return "aarch64";
    case EM_386: return "i386";
    case EM_ARM: return "32-bit ARM";
    case EM_PPC64: return "ppc64";
    case EM_RISCV: return "riscv";
    case EM_S390: return "s390x";
    default: return "ELF machine " + std::to_string(machine);
  }
}

void write_all(int fd, const std::string& text) {
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<std::size_t>(n);
  }
}

std::string describe_wait_status(int status) {
  if (WIFSIGNALED(status))
    return "killed by signal " + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  return "exit status " + std::to_string(WEXITSTATUS(status));
}

std::string last_lines(const std::string& text, std::size_t lines) {
  std::vector<std::string> all;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) all.push_back(line);
  std::string out;
  for (std::size_t i = all.size() > lines ? all.size() - lines : 0; i < all.size(); ++i)
    out += (out.empty() ? "" : " | ") + all[i];
  return out;
}

}  // namespace

std::string describe_current_exception() {
  try {
    throw;
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
  }
  const std::type_info* type = abi::__cxa_current_exception_type();
  if (type == nullptr) return "an unknown exception";
  int status = 0;
  char* demangled = abi::__cxa_demangle(type->name(), nullptr, nullptr, &status);
  std::string name = status == 0 && demangled ? demangled : type->name();
  std::free(demangled);
  return "an exception of type '" + name + "' (not derived from std::exception: it carries no message)";
}

sdk::BuildFingerprint host_fingerprint() { return TESSERA_BUILD_FINGERPRINT; }

std::string describe(const sdk::BuildFingerprint& f) {
  std::ostringstream out;
  out << "compiler " << (f.compiler ? f.compiler : "?") << ", C++11 ABI " << f.cxx11_abi << ", LibTorch "
      << (f.torch_version ? f.torch_version : "?") << ", CUDA " << (f.cuda ? "on" : "off");
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
    unsigned char header[20] = {};
    in.read(reinterpret_cast<char*>(header), sizeof header);
    TESSERA_CHECK(in.good() && std::memcmp(header, "\x7f" "ELF", 4) == 0, file.string(),
                  in.good() ? " is not an ELF shared library (wrong magic bytes)" : " cannot be read");
    // dlopen says "No such file or directory" for another machine's library: say what it is.
    const bool little = header[EI_DATA] == ELFDATA2LSB;
    const int machine = little ? header[18] | header[19] << 8 : header[19] | header[18] << 8;
    TESSERA_CHECK(kHostMachine < 0 || (machine == kHostMachine && header[EI_CLASS] == ELFCLASS64), file.string(),
                  " is a shared library for ", machine_name(machine), header[EI_CLASS] == ELFCLASS32 ? " (32-bit)" : "",
                  ", but this tessera runs on ", kHostMachineName, ": build the plugin for this machine (or remove it ",
                  "from the plugin directory)");
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
  // dlopen first, for the dynamic linker's own reason (an undefined symbol, a missing
  // dependency): Boost.DLL reports only errno ("Bad file descriptor").
  void* probe = ::dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL | (never_unload_ ? RTLD_NODELETE : 0));
  if (probe == nullptr) {
    const char* error = ::dlerror();
    const std::string reason = error ? error : "unknown dynamic-linker error";
    TESSERA_FAIL("cannot load plugin ", file.string(), ": ", reason,
                 reason.find("undefined symbol") != std::string::npos
                     ? " (the plugin was built against other versions of the libraries it uses, or needs a "
                       "library it does not link: rebuild it against this tessera's SDK)"
                     : "");
  }
  try {
    library->handle.load(file, mode);
  } catch (const std::exception& e) {
    ::dlclose(probe);
    TESSERA_FAIL("cannot load plugin ", file.string(), ": ", e.what());
  }
  ::dlclose(probe);  // the handle holds its own reference
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
              same_string(f.torch_version, host.torch_version) && f.cuda == host.cuda;
  TESSERA_CHECK(same, "plugin ", file.string(), " was built", built_against, " with ", describe(f),
                "; this tessera was built with ", describe(host),
                ". Plugins and host must use the same compiler, standard library and LibTorch.");
  TESSERA_CHECK(std::string(sdk::to_string(d->kind)) != "unknown", "plugin ", file.string(), " declares kind ",
                static_cast<std::uint32_t>(d->kind), ", which this tessera does not know (it knows strategy, precision, ",
                "checkpoint_io, model, data and callback): rebuild the plugin against this tessera's SDK");
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

double PluginLoader::scan_timeout_s() {
  const char* text = std::getenv("TESSERA_PLUGIN_SCAN_TIMEOUT_S");
  const double value = text ? std::strtod(text, nullptr) : 0.0;
  return value > 0 ? value : 30.0;
}

namespace {

/// What identifies one version of a library file: a scan's verdict holds while it is unchanged.
std::string file_identity(const fs::path& file) {
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0) return "";
  return std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino) + ":" + std::to_string(st.st_size) + ":" +
         std::to_string(st.st_mtim.tv_sec) + "." + std::to_string(st.st_mtim.tv_nsec);
}

/// The scans' verdicts, shared by every loader of this process and inherited by the processes it
/// starts (its ranks) through TESSERA_PLUGIN_SCAN: each library is loaded in a child process once
/// per job, not once per loader and rank. A verdict is used only for the same file, unchanged.
class ScanCache {
 public:
  static ScanCache& instance() {
    static ScanCache cache;
    return cache;
  }
  std::optional<nlohmann::json> find(const fs::path& file, const std::string& identity) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = verdicts_.find(file.string());
    if (identity.empty() || it == verdicts_.end() || it->at("identity") != identity) return std::nullopt;
    return it->at("report");
  }
  void store(const fs::path& file, const std::string& identity, const nlohmann::json& report) {
    if (identity.empty()) return;
    std::lock_guard<std::mutex> lock(mutex_);
    verdicts_[file.string()] = {{"identity", identity}, {"report", report}};
    ::setenv(kVariable, verdicts_.dump().c_str(), 1);
  }

 private:
  static constexpr const char* kVariable = "TESSERA_PLUGIN_SCAN";
  ScanCache() {
    if (const char* text = std::getenv(kVariable)) {
      verdicts_ = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
      if (!verdicts_.is_object()) verdicts_ = nlohmann::json::object();
    }
  }
  std::mutex mutex_;
  nlohmann::json verdicts_ = nlohmann::json::object();
};

}  // namespace

std::vector<PluginInfo> PluginLoader::probe(const fs::path& file) {
  const std::string identity = file_identity(file);
  std::optional<nlohmann::json> report = ScanCache::instance().find(file, identity);
  if (!report) {
    report = nlohmann::json::parse(probe_in_child(file));
    ScanCache::instance().store(file, identity, *report);
  }
  TESSERA_CHECK(!report->contains("error"), report->value("error", std::string()));
  std::vector<PluginInfo> infos;
  for (const auto& e : report->at("entries"))
    infos.push_back(PluginInfo{file, static_cast<sdk::PluginKind>(e.at("kind").get<int>()),
                               e.at("name").get<std::string>(), e.at("description").get<std::string>(),
                               e.at("version").get<std::string>(), e.at("abi_major").get<std::uint32_t>(),
                               e.at("abi_minor").get<std::uint32_t>(), e.at("sdk_version").get<std::string>()});
  return infos;
}

std::string PluginLoader::probe_in_child(const fs::path& file) {
  // A library runs code when it is loaded (static constructors): a crashing or hanging one would
  // take the host down. A child process loads it and reports its descriptor (or why it is not a
  // plugin); the host loads only what it creates, vetted here.
  int result[2], output[2];
  TESSERA_CHECK(::pipe2(result, O_CLOEXEC) == 0 && ::pipe2(output, O_CLOEXEC) == 0,
                "cannot create a pipe to scan plugin ", file.string(), ": ", std::strerror(errno));
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int error = errno;
    for (int fd : {result[0], result[1], output[0], output[1]}) ::close(fd);
    TESSERA_FAIL("cannot start a process to scan plugin ", file.string(), ": ", std::strerror(error));
  }
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);
    const rlimit no_core{0, 0};
    ::setrlimit(RLIMIT_CORE, &no_core);  // a crashing constructor: no core file per scan
    ::dup2(output[1], STDOUT_FILENO);
    ::dup2(output[1], STDERR_FILENO);
    nlohmann::json report;
    try {
      nlohmann::json entries = nlohmann::json::array();
      for (const PluginInfo& info : inspect(file))
        entries.push_back({{"kind", static_cast<int>(info.kind)}, {"name", info.name},
                           {"description", info.description}, {"version", info.version},
                           {"abi_major", info.abi_major}, {"abi_minor", info.abi_minor},
                           {"sdk_version", info.sdk_version}});
      report = {{"entries", entries}};
    } catch (...) {
      report = {{"error", describe_current_exception()}};
    }
    write_all(result[1], report.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    ::_exit(0);  // no static destructors: the library's, or LibTorch's, have no business here
  }
  ::close(result[1]);
  ::close(output[1]);
  std::string reply, printed;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(scan_timeout_s());
  bool timed_out = false;
  for (int open = 2; open > 0;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    pollfd fds[2] = {{result[0], POLLIN, 0}, {output[0], POLLIN, 0}};
    if (::poll(fds, 2, static_cast<int>(std::min<std::int64_t>(left.count(), 1000))) < 0 && errno != EINTR) break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buffer[4096];
      const ssize_t n = ::read(fds[i].fd, buffer, sizeof buffer);
      if (n > 0) {
        (i == 0 ? reply : printed).append(buffer, static_cast<std::size_t>(n));
        if (printed.size() > 65536) printed.erase(0, printed.size() - 65536);
      } else if (n == 0 || errno != EINTR) {
        ::close(fds[i].fd);
        (i == 0 ? result[0] : output[0]) = -1;
        --open;
      }
    }
    if (result[0] < 0 && output[0] < 0) break;
  }
  if (timed_out) ::kill(pid, SIGKILL);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  for (int fd : {result[0], output[0]})
    if (fd >= 0) ::close(fd);
  const std::string said = last_lines(printed, 3);
  const std::string output_note = said.empty() ? "" : "; it printed: " + said;
  TESSERA_CHECK(!timed_out, file.string(), " did not finish loading within ", scan_timeout_s(),
                " s (a static constructor that hangs?): not used", output_note,
                " (TESSERA_PLUGIN_SCAN_TIMEOUT_S sets the limit)");
  TESSERA_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0 && !reply.empty(), file.string(),
                " crashed while being loaded (", describe_wait_status(status),
                ": its static constructors, or a library it needs, failed): not used", output_note);
  return reply;
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
        for (PluginInfo& info : probe(file)) plugins_.push_back(std::move(info));
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
    // Loaded here only now, vetted by the scan's child process.
    auto loaded = std::find_if(libraries_.begin(), libraries_.end(),
                               [&](const auto& lib) { return lib->path == info.path; });
    if (loaded == libraries_.end()) {
      libraries_.push_back(load(info.path));
      loaded = libraries_.end() - 1;
    }
    auto library = *loaded;
    const sdk::PluginEntry* entry = nullptr;
    for (std::uint32_t i = 0; i < library->descriptor->num_entries; ++i)
      if (name == library->descriptor->entries[i].name) entry = &library->descriptor->entries[i];
    TESSERA_CHECK(entry != nullptr, "plugin ", info.path.string(), " no longer has the entry '", name,
                  "' it had when it was scanned (replaced while tessera runs?)");
    sdk::PluginObject* raw = nullptr;
    try {
      raw = entry->create(options);
    } catch (const sdk::Error&) {
      throw;  // the plugin's own message, already written for the user
    } catch (...) {  // any other type, even a non-std one: never std::terminate in the host
      TESSERA_FAIL(sdk::to_string(kind), " plugin '", name, "' (", info.path.string(), ") failed while creating its object: ",
                   describe_current_exception(), "; a plugin reports errors as tessera::sdk::Error (TESSERA_CHECK)");
    }
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
