#include "cli/checkpoint_tool.hpp"

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "cli/hf_export.hpp"
#include "tessera/core/checkpoint.hpp"
#include "tessera/core/checkpoint_folder.hpp"
#include "checkpoint/dcp.hpp"
#include "checkpoint/huggingface.hpp"
#include "tessera/core/safetensors.hpp"
#include "tessera/core/sharded_checkpoint.hpp"
#include "tessera/sdk/error.hpp"

namespace tessera::host {

namespace {

namespace fs = std::filesystem;

constexpr const char* kCheckpointUsage = R"(usage:
  tessera checkpoint inspect PATH                    summary: step, world size, tensors, sizes
  tessera checkpoint verify PATH                     every checksum (exit 1 naming the damaged file)
  tessera checkpoint export PATH --to FILE.safetensors|FILE.ckpt
                                                     the weights as safetensors (streamed: one tensor
                                                     in memory at a time), or a full checkpoint
  tessera checkpoint export RUN_OR_CKPT --to DIR --format hf [--max-shard-size 5GB] [--dtype bf16|fp32|fp16]
                           [--config RUN/config.toml]
                                                     a Hugging Face model folder (config.json from the
                                                     model, generation_config.json, safetensors shards
                                                     of at most --max-shard-size with their index),
                                                     streamed, and the run's tokenizer files; the model
                                                     must speak Hugging Face's names; a LoRA run's
                                                     adapters are merged in (W + alpha / r B A)
  tessera checkpoint export RUN_OR_CKPT --to DIR --format peft [--dtype bf16|fp32|fp16]
                                                     a LoRA run's adapters as PEFT writes them
                                                     (adapter_model.safetensors, adapter_config.json)
  tessera checkpoint export RUN_OR_CKPT --to DIR --format dcp
                                                     a PyTorch Distributed Checkpoint folder that
                                                     torch.distributed.checkpoint.load reads: the
                                                     weights by name, the optimizer state and step as
                                                     torchtitan names them; streamed
  tessera checkpoint gc ROOT [--dry-run]             lists and removes what interrupted saves left
                                                     anywhere under ROOT (a default_root_dir): only
                                                     those whose writer is gone (clean: the same)
PATH is a full .ckpt file, a sharded checkpoint folder (or a `last` link to either), a torch.save'd
state dict or a safetensors file; inspect and verify also read PyTorch DCP folders. RUN_OR_CKPT is
also a run folder (its checkpoints/last) or a default_root_dir (its newest run's last checkpoint,
as --ckpt-path last finds it).
)";


std::string shape_of(const std::vector<std::int64_t>& dims) {
  std::ostringstream out;
  out << at::IntArrayRef(dims);
  return out.str();
}

std::string megabytes(double bytes) {
  std::ostringstream out;
  out.precision(3);
  out << bytes / 1e6 << " MB";
  return out.str();
}

/// `checkpoint gc ROOT`: every leftover of an interrupted save under ROOT, removed unless its
/// writer still runs (or `dry_run`).
void collect_garbage(const std::string& root, bool dry_run) {
  const std::vector<core::Leftover> found = core::find_leftovers(root);
  std::uintmax_t freed = 0;
  std::size_t removed = 0;
  for (const core::Leftover& leftover : found) {
    const std::string size = megabytes(static_cast<double>(leftover.bytes));
    if (leftover.in_use) {
      std::cout << "kept     " << leftover.path << " (" << size << "): a running save still writes it\n";
      continue;
    }
    if (!dry_run) {
      std::error_code ec;
      core::remove_tree(leftover.path, ec);
      TESSERA_CHECK(!ec, "cannot remove ", leftover.path, ": ", ec.message());
    }
    std::cout << (dry_run ? "would remove " : "removed  ") << leftover.path << " (" << size << ")\n";
    freed += leftover.bytes, ++removed;
  }
  if (found.empty()) std::cout << "no leftovers of interrupted saves under " << root << "\n";
  else std::cout << (dry_run ? "would free " : "freed ") << megabytes(static_cast<double>(freed)) << " in " << removed
                 << " leftover(s)\n";
}

void inspect(const std::string& path) {
  if (core::is_dcp_checkpoint(path)) {
    const core::DcpMetadata m = core::read_dcp_metadata(path);
    std::set<std::string> files;
    for (const auto& [name, t] : m.tensors)
      for (const auto& c : t.chunks) files.insert(c.storage.file);
    std::uintmax_t bytes = 0;
    for (const auto& file : files) bytes += fs::file_size(fs::path(path) / file);
    const sdk::Checkpoint state = core::read_trainer_state(path);
    std::cout << "PyTorch DCP checkpoint " << path << "\n  " << files.size() << " data files, " << megabytes(static_cast<double>(bytes))
              << (state.contains("global_step") ? ", saved by tessera at step " + std::to_string(state.at("global_step").toInt()) : "")
              << "\n  tensors (" << m.tensors.size() << "):\n";
    for (const auto& [name, t] : m.tensors)
      std::cout << "    " << name << "  " << t.dtype << " " << shape_of(t.size) << "  " << t.chunks.size()
                << " chunk(s)\n";
    if (!m.bytes.empty()) {
      std::cout << "  other items (" << m.bytes.size() << ", torch.save'd objects: tessera's trainer state is read, "
                << "others are not):\n";
      for (const auto& [name, b] : m.bytes) std::cout << "    " << name << "  " << b.length << " bytes\n";
    }
    return;
  }
  if (core::is_sharded_checkpoint(path)) {
    const core::Manifest m = core::read_manifest(path);
    std::int64_t bytes = 0;
    for (const auto& [name, digest] : m.files) bytes += digest.size;
    std::cout << "sharded checkpoint " << path << "\n  format " << core::kShardedFormatName << " v"
              << m.format_version << ", written by tessera " << m.tessera_version << ", save " << m.save_id
              << "\n  world size " << m.world_size << ", " << m.files.size() << " files, " << megabytes(bytes)
              << "\n  trainer state " << m.trainer_state.substr(0, 400) << (m.trainer_state.size() > 400 ? "..." : "")
              << "\n  tensors (" << m.tensors.size() << "):\n";
    for (const auto& [name, t] : m.tensors)
      std::cout << "    " << name << "  " << t.dtype << " " << shape_of(t.global_shape) << "  " << t.pieces.size()
                << " piece(s)\n";
    return;
  }
  sdk::Checkpoint c = core::load_checkpoint_file(path);
  const bool bare = c.contains(core::kWeightsOnlyKey) && !c.contains("global_step");  // a state dict or safetensors
  std::cout << (bare ? "weights " : "full checkpoint ") << path << " ("
            << megabytes(static_cast<double>(fs::file_size(path))) << ")\n";
  for (const char* key : {"global_step", "epoch", "tessera_version"})
    if (c.contains(key)) std::cout << "  " << key << " " << c.at(key) << "\n";
  if (c.contains("state_dict")) {
    sdk::StateDict state = core::state_dict_from(c.at("state_dict"), path + " [state_dict]");
    std::cout << "  state_dict (" << state.size() << " tensors):\n";
    for (const auto& item : state)
      std::cout << "    " << item.key() << "  " << core::safetensors_dtype(item.value().scalar_type()) << " "
                << shape_of(item.value().sizes().vec()) << "\n";
  }
}

void verify(const std::string& path) { std::cout << "ok: " << path << ": " << core::verify_checkpoint(path) << "\n"; }

void export_to(const std::string& path, const std::string& to) {
  const bool safetensors = to.size() > 12 && to.compare(to.size() - 12, 12, ".safetensors") == 0;
  const bool ckpt = to.size() > 5 && to.compare(to.size() - 5, 5, ".ckpt") == 0;
  TESSERA_CHECK(safetensors || ckpt, "--to ", to, ": export writes FILE.safetensors or FILE.ckpt");
  if (core::is_sharded_checkpoint(path)) {
    core::ShardedReader reader(core::read_manifest(path));
    TESSERA_CHECK(!core::holds_rank_local_state(reader.manifest()), "checkpoint ", path,
                  " holds rank-local state (fsdp state_dict_type = \"local\": flat shards that only the same world ",
                  "size, strategy and model read), not the model's tensors; resume it so and save with [strategy] ",
                  "state_dict_type = \"sharded\" or \"full\" to export it");
    if (safetensors) {
      // Streamed: each weight is assembled from its pieces just before it is written.
      std::vector<core::TensorSpec> specs;
      for (const auto& [name, t] : core::model_tensors(reader.manifest()))
        specs.push_back({name, core::scalar_type_of(t->dtype, name), t->global_shape});
      core::atomic_write_file(to, [&](const std::string& temp) {
        core::write_safetensors(
            temp, specs,
            [&](std::size_t i) {
              return reader.read(core::model_tensor_key(specs[i].name), core::TensorPiece::whole(specs[i].shape));
            },
            {{"format", "pt"}, {"source", path}});
      });
    } else {
      std::map<std::string, core::TensorPiece> whole;
      for (const auto& [name, t] : core::model_tensors(reader.manifest()))
        whole.emplace(name, core::TensorPiece::whole(t->global_shape));
      core::save_pickle(
          core::with_tensor_checksums(core::optimizer_states_in_model_order(core::load_sharded(path, whole, 0))), to);
    }
  } else {
    sdk::Checkpoint c = core::load_checkpoint_file(path);
    core::check_tensor_checksums(c, path);
    if (ckpt) {
      core::save_pickle(c, to);
    } else {
      // Streamed from the mapped file: each tensor's pages are dropped once it is written.
      sdk::StateDict state = core::state_dict_from(core::checkpoint_get(c, "state_dict"), path + " [state_dict]");
      std::vector<core::TensorSpec> specs;
      std::vector<at::Tensor> tensors;
      for (const auto& item : state) {
        specs.push_back({item.key(), item.value().scalar_type(), item.value().sizes().vec()});
        tensors.push_back(item.value());
      }
      core::atomic_write_file(to, [&](const std::string& temp) {
        core::write_safetensors(
            temp, specs,
            [&](std::size_t i) {
              if (i > 0) core::release_loaded_pages(tensors[i - 1]);
              return tensors[i];
            },
            {{"format", "pt"}, {"source", path}});
      });
    }
  }
  std::cout << "exported " << path << " to " << to << "\n";
}

void export_dcp(const std::string& source, const std::string& to) {
  const std::string checkpoint = locate_checkpoint(source).first;
  const std::size_t tensors = core::export_dcp(checkpoint, to);
  std::cout << "exported " << checkpoint << " to " << to << " (a PyTorch DCP folder, " << tensors << " tensors)\n";
}

HfExportRequest hf_request(const std::string& path, const std::string& to,
                           const std::map<std::string, std::string>& options) {
  HfExportRequest request{path, to};
  if (auto it = options.find("--config"); it != options.end()) request.config = it->second;
  if (auto it = options.find("--max-shard-size"); it != options.end())
    request.max_shard_bytes = core::parse_byte_size(it->second, "--max-shard-size");
  if (auto it = options.find("--dtype"); it != options.end()) {
    const std::map<std::string, at::ScalarType> dtypes{{"fp32", at::kFloat}, {"bf16", at::kBFloat16}, {"fp16", at::kHalf}};
    auto d = dtypes.find(it->second);
    TESSERA_CHECK(d != dtypes.end(), "--dtype ", it->second, " is not one of fp32, bf16, fp16");
    request.dtype = d->second;
  }
  return request;
}

}  // namespace

int checkpoint_tool(int argc, char** argv) {
  std::vector<std::string> words(argv + 1, argv + argc);
  std::string command, path, to;
  bool dry_run = false;
  std::map<std::string, std::string> hf_options;  // --format, --max-shard-size, --dtype, --config
  std::optional<HfExportRequest> hf;
  bool dcp = false;   // --format dcp
  bool peft = false;  // --format peft
  try {
    for (std::size_t i = 0; i < words.size(); ++i) {
      const std::string& w = words[i];
      if (w == "--help" || w == "-h") return std::cout << kCheckpointUsage, 0;
      if (w == "--dry-run") {
        dry_run = true;
        continue;
      }
      const std::string option = w.substr(0, w.find('='));
      if (option == "--to" || option == "--format" || option == "--max-shard-size" || option == "--dtype" ||
          option == "--config") {
        std::string value;
        if (option.size() < w.size()) value = w.substr(option.size() + 1);
        else {
          TESSERA_CHECK(i + 1 < words.size(), option, " needs a value");
          value = words[++i];
        }
        (option == "--to" ? to : hf_options[option]) = value;
      } else if (command.empty()) {
        const std::vector<std::string> commands{"inspect", "verify", "export", "gc", "clean"};
        TESSERA_CHECK(std::find(commands.begin(), commands.end(), w) != commands.end(), "unknown checkpoint command '",
                      w, "'", sdk::did_you_mean(w, commands), "; valid: ", sdk::join(commands));
        command = w;
      } else if (path.empty()) {
        path = w;
      } else {
        TESSERA_FAIL("unexpected argument '", w, "'");
      }
    }
    TESSERA_CHECK(!command.empty() && !path.empty(), "checkpoint needs a command and a PATH");
    TESSERA_CHECK(command == "export" || to.empty(), "--to is for export only");
    TESSERA_CHECK(command == "gc" || command == "clean" || !dry_run, "--dry-run is for gc only");
    TESSERA_CHECK(command != "export" || !to.empty(), "export needs --to FILE.safetensors, --to FILE.ckpt or ",
                  "--to DIR --format hf");
    if (!hf_options.empty()) {
      TESSERA_CHECK(command == "export", hf_options.begin()->first, " is for export only");
      const std::string format = hf_options.count("--format") ? hf_options.at("--format") : "";
      TESSERA_CHECK(format == "hf" || format == "dcp" || format == "peft",
                    format.empty() ? hf_options.begin()->first + " applies to --format hf only"
                                   : "--format " + format + " is not a format export writes (hf, peft, dcp)");
      if (format == "peft") {
        for (const auto& [option, value] : hf_options)
          TESSERA_CHECK(option == "--format" || option == "--dtype", option, " applies to --format hf only");
        hf = hf_request(path, to, hf_options);
        peft = true;
      } else if (format == "dcp") {
        for (const auto& [option, value] : hf_options)
          TESSERA_CHECK(option == "--format", option, " applies to --format hf only");
        dcp = true;
      } else {
        hf = hf_request(path, to, hf_options);
      }
    }
  } catch (const sdk::Error& e) {
    std::cerr << "tessera checkpoint: " << e.what() << "\n\n" << kCheckpointUsage;
    return 2;
  }
  try {
    std::error_code ec;
    if (command == "gc" || command == "clean") {
      TESSERA_CHECK(fs::is_directory(path, ec), path, " is not a folder: pass a run root (a [trainer] default_root_dir)");
      collect_garbage(path, dry_run);
      return 0;
    }
    TESSERA_CHECK(fs::exists(path, ec), "checkpoint ", path, " does not exist");
    if (command == "inspect") inspect(path);
    else if (command == "verify") verify(path);
    else if (dcp) export_dcp(path, to);
    else if (!hf) export_to(path, to);
    else if (peft) export_peft(*hf);
    else export_hf(*hf);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "tessera checkpoint " << command << ": error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace tessera::host
