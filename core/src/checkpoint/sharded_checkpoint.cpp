#include "tessera/core/sharded_checkpoint.hpp"
#include "dcp.hpp"
#include "durable.hpp"

#include <fcntl.h>
#include <stdio.h>  // renameat2
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <sstream>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "checkpoint_json.hpp"
#include "tessera/core/checkpoint.hpp"
#include "tessera/core/checkpoint_folder.hpp"  // remove_tree, WriterLock
#include "tessera/sdk/build_config.hpp"  // TESSERA_VERSION
#include "tessera/sdk/error.hpp"

namespace tessera::core {

namespace fs = std::filesystem;
using c10::IValue;
using checkpoint_json::json;
using checkpoint_json::decode;
using checkpoint_json::encode;
using checkpoint_json::read_json;
using checkpoint_json::TensorNamer;
using checkpoint_json::TensorResolver;
using checkpoint_json::write_json;

namespace {

constexpr std::string_view kModelTensorPrefix = "state_dict/";

std::string file_name(std::int64_t rank, std::int64_t world) {
  return "rank-" + std::to_string(rank) + "-of-" + std::to_string(world) + ".safetensors";
}
std::string record_name(std::int64_t rank, std::int64_t world) {
  return "rank-" + std::to_string(rank) + "-of-" + std::to_string(world) + ".json";
}

json piece_json(const TensorPiece& piece) {
  return {{"kind", piece.kind == TensorPiece::Kind::flat ? "flat" : "box"},
          {"offsets", piece.offsets},
          {"lengths", piece.lengths}};
}

TensorPiece piece_from_json(const json& j, const std::vector<std::int64_t>& shape) {
  const std::string kind = j.at("kind").get<std::string>();
  auto offsets = j.at("offsets").get<std::vector<std::int64_t>>();
  auto lengths = j.at("lengths").get<std::vector<std::int64_t>>();
  if (kind == "flat") {
    TESSERA_CHECK(offsets.size() == 1 && lengths.size() == 1, "a flat piece has one offset and one length");
    return TensorPiece::flat_range(shape, offsets[0], lengths[0]);
  }
  TESSERA_CHECK(kind == "box", "piece kind \"", kind, "\" is neither \"flat\" nor \"box\"");
  return TensorPiece::box(shape, offsets, lengths);
}

json digest_json(const FileDigest& d) { return {{"size", d.size}, {"xxh64", d.xxh64}, {"blocks", d.blocks}}; }
FileDigest digest_from_json(const json& j) {
  return FileDigest{j.at("size").get<std::int64_t>(), j.at("xxh64").get<std::string>(),
                    j.at("blocks").get<std::vector<std::string>>()};
}

/// The pieces of global tensors this rank's checkpoint says it holds; none: its state_dict
/// is rank-local (fsdp's LOCAL flat shards), loadable only by the same rank of the same layout.
std::optional<std::map<std::string, StackedPieces>> pieces_of(const sdk::Checkpoint& checkpoint,
                                                              const sdk::StateDict& state) {
  if (checkpoint.contains(kTensorPiecesKey))
    return stacked_pieces_from_ivalue(checkpoint.at(kTensorPiecesKey), kTensorPiecesKey);
  if (checkpoint.contains(kLegacyShardMetadataKey))
    return stacked_pieces_from_ivalue(checkpoint.at(kLegacyShardMetadataKey), kLegacyShardMetadataKey, &state);
  return std::nullopt;
}

void check_save_id(const SafetensorsReader& reader, const Manifest& m) {
  auto id = reader.metadata().find("save_id");
  TESSERA_CHECK(id != reader.metadata().end() && id->second == m.save_id, reader.path(), " belongs to another save (",
                id == reader.metadata().end() ? std::string("none") : id->second, "; the manifest says ", m.save_id,
                "): a file was copied in from another checkpoint");
  reader.verify_header();
}

}  // namespace

namespace detail {
void fsync_path(const fs::path& path, bool directory) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (directory ? O_DIRECTORY : 0));
  TESSERA_CHECK(fd >= 0, "cannot open ", path.string(), " to fsync it: ", std::strerror(errno));
  const bool ok = ::fsync(fd) == 0;
  const int error = errno;
  ::close(fd);
  TESSERA_CHECK(ok, "cannot fsync ", path.string(), ": ", std::strerror(error));
}

void publish_folder(const fs::path& folder, const fs::path& target) {
  // A plain rename, or an atomic exchange with the checkpoint already at `target`.
  if (::renameat2(AT_FDCWD, folder.c_str(), AT_FDCWD, target.c_str(), RENAME_NOREPLACE) != 0) {
    TESSERA_CHECK(errno == EEXIST, "cannot rename ", folder.string(), " to ", target.string(), ": ", std::strerror(errno));
    TESSERA_CHECK(::renameat2(AT_FDCWD, folder.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0,
                  "cannot exchange ", folder.string(), " with ", target.string(), ": ", std::strerror(errno));
    std::error_code ec;
    remove_tree(folder.string(), ec);  // now the replaced checkpoint
  }
  fsync_path(target.has_parent_path() ? target.parent_path() : fs::path("."), true);
}
}  // namespace detail

std::string new_save_id() {
  std::random_device device;
  char text[17];
  std::snprintf(text, sizeof text, "%016llx",
                static_cast<unsigned long long>(static_cast<std::uint64_t>(device()) << 32 | device()));
  return text;
}

std::string temporary_folder(const std::string& path, const std::string& save_id) {
  fs::path target(path);
  fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  return (dir / ("." + target.filename().string() + ".tmp-" + save_id)).string();
}

void write_shard(const sdk::Checkpoint& checkpoint, const std::string& path, std::int64_t rank, std::int64_t world,
                 const std::string& save_id) {
  TESSERA_CHECK(world >= 1 && rank >= 0 && rank < world, "sharded checkpoint ", path, ": rank ", rank, " of ", world,
                " is out of range");
  const sdk::StateDict state = state_dict_from(checkpoint_get(checkpoint, "state_dict"), "checkpoint [state_dict]");
  const auto pieces = pieces_of(checkpoint, state);
  std::vector<std::string> param_names;
  if (checkpoint.contains("optimizer_states") && !checkpoint.at("optimizer_states").toListRef().empty()) {
    sdk::Checkpoint opt = checkpoint_dict(checkpoint.at("optimizer_states").toListRef()[0], "optimizer_states[0]");
    if (opt.contains("param_names"))
      for (const IValue& n : opt.at("param_names").toListRef()) param_names.push_back(n.toStringRef());
  }

  std::vector<std::pair<std::string, at::Tensor>> tensors;
  json piece_records = json::object();
  // state_dict/<name> and optimizer/<name>/<moment> are pieces of global tensors; other tensors
  // (RNG state, the optimizer's step, ...) are this rank's own, named by their path.
  TensorNamer name_of = [&](const std::vector<std::string>& p, const at::Tensor& t) {
    std::string name = sdk::join(p, "/");
    std::string param;
    if (!pieces) {  // rank-local tensors: stored as they are
    } else if (p.size() == 2 && is_model_shaped_key(p[0])) {
      param = p[1];
      name = model_tensor_key(param, p[0]);
    } else if (p.size() == 5 && p[0] == "optimizer_states" && p[1] == "0" && p[2] == "state" && p[4] != "step") {
      const std::size_t index = std::stoul(p[3]);
      TESSERA_CHECK(index < param_names.size(), "optimizer state of parameter index ", index, " but 'param_names' has ",
                    param_names.size(), " entries");
      param = param_names[index];
      name = "optimizer/" + param + "/" + p[4];
    }
    if (param.empty()) {
      tensors.emplace_back(name, t);
      return name;
    }
    auto it = pieces->find(param);
    TESSERA_CHECK(it != pieces->end(), "checkpoint tensor ", name, ": '", param, "' has no piece description");
    const StackedPieces& stack = it->second;
    TESSERA_CHECK(t.numel() == numel(stack), "checkpoint tensor ", name, " holds ", t.numel(),
                  " elements but the piece of '", param, "' it stands for, ", stack[0].to_string(),
                  stack.size() > 1 ? " and " + std::to_string(stack.size() - 1) + " more" : std::string(), ", has ",
                  numel(stack));
    const std::vector<at::Tensor> parts = stack.size() == 1 ? std::vector<at::Tensor>{t} : split_stacked(t, stack);
    for (std::size_t k = 0; k < stack.size(); ++k) {
      const std::string key = k == 0 ? name : name + "#" + std::to_string(k);
      json record = piece_json(stack[k]);
      record["global_shape"] = stack[k].global_shape;
      record["dtype"] = safetensors_dtype(t.scalar_type());
      if (k > 0) record["tensor"] = name;
      piece_records[key] = record;
      tensors.emplace_back(key, parts[k]);
    }
    return name;
  };
  json tree = json::object();
  std::vector<std::string> key_path;
  for (const auto& item : checkpoint) {
    const std::string key = item.key().toStringRef();
    if (key == kTensorPiecesKey || key == kLegacyShardMetadataKey) continue;  // the manifest says it
    key_path.push_back(key);
    tree[key] = encode(item.value(), key_path, name_of);
    key_path.pop_back();
  }

  const fs::path folder = temporary_folder(path, save_id);
  std::error_code ec;
  fs::create_directories(folder, ec);
  TESSERA_CHECK(!ec, "cannot create ", folder.string(), ": ", ec.message());
  // While a rank writes its part (and rank 0 until it commits) no sweep takes the folder.
  const WriterLock lock(folder.string());
  if (rank == 0) hold_writer_lock(folder.string());
  const std::map<std::string, std::string> metadata{{"format", kShardedFormatName},
                                                    {"format_version", std::to_string(kShardedFormatVersion)},
                                                    {"save_id", save_id},
                                                    {"rank", std::to_string(rank)},
                                                    {"world_size", std::to_string(world)},
                                                    {"tessera.tree", tree.dump()}};
  try {
    const FileDigest digest = write_safetensors((folder / file_name(rank, world)).string(), tensors, metadata);
    json record = {{"save_id", save_id}, {"file", file_name(rank, world)}, {"digest", digest_json(digest)},
                   {"pieces", piece_records}};
    if (rank == 0) record["tree"] = tree;
    write_json(folder / record_name(rank, world), record);  // last: its presence means this rank is done
  } catch (...) {
    if (rank == 0) {  // this save cannot commit; (others' leftovers: the sweep)
      release_writer_lock(folder.string());
      remove_tree(folder.string(), ec);
    }
    throw;
  }
}

void commit_shards(const std::string& path, std::int64_t world, const std::string& save_id, std::int64_t wait_s) {
  const fs::path folder = temporary_folder(path, save_id);
  struct Release {  // rank 0's lock on the folder, taken in write_shard
    std::string folder;
    ~Release() { release_writer_lock(folder); }
  } release{folder.string()};
  std::error_code ec;
  try {
    // An asynchronous save: the other ranks may still be writing; their records come last.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(wait_s);
    for (std::int64_t r = 0; r < world; ++r)
      while (!fs::exists(folder / record_name(r, world), ec) && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    json manifest = {{"format", kShardedFormatName},
                     {"format_version", kShardedFormatVersion},
                     {"tessera_version", TESSERA_VERSION},
                     {"save_id", save_id},
                     {"world_size", world}};
    json files = json::object(), tensors = json::object(), trainer_state;
    for (std::int64_t r = 0; r < world; ++r) {
      const fs::path record_file = folder / record_name(r, world);
      TESSERA_CHECK(fs::exists(record_file, ec), "sharded checkpoint ", path, ": rank ", r, " of ", world,
                    " did not finish writing its part; the previous checkpoint is kept");
      const json record = read_json(record_file, "the save record");
      TESSERA_CHECK(record.at("save_id").get<std::string>() == save_id, record_file.string(),
                    " belongs to another save (", record.at("save_id").get<std::string>(), ", not ", save_id, ")");
      const std::string file = record.at("file").get<std::string>();
      files[file] = record.at("digest");
      if (r == 0) trainer_state = record.at("tree");
      for (const auto& [key, piece] : record.at("pieces").items()) {
        const std::string name = piece.value("tensor", key);  // a stacked piece's later parts: "<name>#k"
        json& entry = tensors[name];
        if (entry.is_null()) entry = {{"dtype", piece.at("dtype")}, {"global_shape", piece.at("global_shape")},
                                      {"pieces", json::array()}};
        TESSERA_CHECK(entry.at("global_shape") == piece.at("global_shape") && entry.at("dtype") == piece.at("dtype"),
                      "sharded checkpoint ", path, ": rank ", r, " saved ", name, " as ", piece.at("dtype").dump(), " ",
                      piece.at("global_shape").dump(), " but rank 0 as ", entry.at("dtype").dump(), " ",
                      entry.at("global_shape").dump());
        json stored = {{"file", file}, {"kind", piece.at("kind")}, {"offsets", piece.at("offsets")},
                       {"lengths", piece.at("lengths")}};
        if (key != name) stored["key"] = key;
        entry["pieces"].push_back(stored);
      }
    }
    for (const char* key : {"state_dict", "optimizer_states"}) trainer_state.erase(key);  // the tensors say those
    manifest["trainer_state"] = trainer_state;
    manifest["tensors"] = tensors;
    manifest["files"] = files;
    for (std::int64_t r = 0; r < world; ++r) fs::remove(folder / record_name(r, world), ec);
    write_json(folder / kManifestName, manifest);
    detail::fsync_path(folder, true);
    detail::publish_folder(folder, path);
  } catch (...) {
    remove_tree(folder.string(), ec);
    throw;
  }
}

bool is_sharded_checkpoint(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::exists(fs::path(path) / kManifestName, ec);
}

bool is_dcp_checkpoint(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::is_regular_file(fs::path(path) / kDcpMetadataName, ec) &&
         !fs::exists(fs::path(path) / kManifestName, ec);
}

std::string model_tensor_key(const std::string& name, const std::string& dict) { return dict + "/" + name; }

std::map<std::string, const ManifestTensor*> model_tensors(const Manifest& manifest) {
  std::map<std::string, const ManifestTensor*> out;
  for (const auto& [key, tensor] : manifest.tensors)
    if (key.rfind(kModelTensorPrefix, 0) == 0) out.emplace(key.substr(kModelTensorPrefix.size()), &tensor);
  return out;
}

bool holds_rank_local_state(const Manifest& manifest) { return model_tensors(manifest).empty(); }

Manifest read_manifest(const std::string& path) {
  const fs::path file = fs::path(path) / kManifestName;
  std::error_code ec;
  TESSERA_CHECK(fs::exists(file, ec), "sharded checkpoint ", path, " has no ", kManifestName,
                ": it is not a committed checkpoint (an interrupted save?)");
  const json j = read_json(file, "checkpoint manifest");
  Manifest m;
  m.path = path;
  try {
    TESSERA_CHECK(j.value("format", "") == kShardedFormatName, file.string(), " has format \"", j.value("format", ""),
                  "\"; expected \"", kShardedFormatName, "\"");
    m.format_version = j.at("format_version").get<std::int64_t>();
    m.tessera_version = j.at("tessera_version").get<std::string>();
    TESSERA_CHECK(m.format_version <= kShardedFormatVersion, file.string(), " is format version ", m.format_version,
                  ", written by tessera ", m.tessera_version, "; this tessera (", TESSERA_VERSION,
                  ") reads versions up to ", kShardedFormatVersion, ": load it with a newer tessera");
    m.save_id = j.at("save_id").get<std::string>();
    m.world_size = j.at("world_size").get<std::int64_t>();
    for (const auto& [name, digest] : j.at("files").items()) m.files.emplace(name, digest_from_json(digest));
    for (const auto& [name, t] : j.at("tensors").items()) {
      ManifestTensor tensor{t.at("dtype").get<std::string>(), t.at("global_shape").get<std::vector<std::int64_t>>()};
      for (const auto& p : t.at("pieces")) {
        const std::string piece_file = p.at("file").get<std::string>();
        TESSERA_CHECK(m.files.count(piece_file), file.string(), ": ", name, " has a piece in ", piece_file,
                      ", which is not among its files");
        tensor.pieces.push_back({piece_file, piece_from_json(p, tensor.global_shape), p.value("key", name)});
      }
      m.tensors.emplace(name, std::move(tensor));
    }
    m.trainer_state = j.at("trainer_state").dump();
  } catch (const nlohmann::json::exception& e) {
    TESSERA_FAIL(file.string(), " is not a valid manifest: ", e.what());
  }
  return m;
}

void check_against_wanted(const std::map<std::string, std::vector<std::int64_t>>& saved,
                          const std::map<std::string, TensorPiece>& wanted, const std::string& where) {
  std::vector<std::string> missing, unexpected, mismatched;
  auto dims = [](const std::vector<std::int64_t>& d) {
    std::ostringstream out;
    out << at::IntArrayRef(d);
    return out.str();
  };
  for (const auto& [name, shape] : saved) {
    auto want = wanted.find(name);
    if (want == wanted.end()) unexpected.push_back(name);
    else if (want->second.global_shape != shape)
      mismatched.push_back("'" + name + "' is " + dims(shape) + " in the checkpoint but " +
                           dims(want->second.global_shape) + " in the model");
  }
  for (const auto& [name, piece] : wanted)
    if (!saved.count(name)) missing.push_back(name);
  if (missing.empty() && unexpected.empty() && mismatched.empty()) return;
  auto first = [](const std::vector<std::string>& names) {
    std::vector<std::string> shown(names.begin(), names.begin() + std::min<std::size_t>(names.size(), 8));
    return sdk::join(shown) + (names.size() > shown.size() ? ", ..." : "");
  };
  TESSERA_FAIL(where, " does not match the model (it was written for a different model configuration): ",
               mismatched.empty() ? "" : first(mismatched) + "; ", missing.size(), " missing tensor(s) [",
               first(missing), "], ", unexpected.size(), " unexpected tensor(s) [", first(unexpected), "]");
}

ShardedReader::ShardedReader(Manifest manifest) : manifest_(std::move(manifest)) {}
ShardedReader::~ShardedReader() = default;

SafetensorsReader& ShardedReader::file(const std::string& name) {
  auto& r = readers_[name];
  if (!r) {
    TESSERA_CHECK(manifest_.files.count(name), "checkpoint ", manifest_.path, " has no file ", name);
    const std::string full = (fs::path(manifest_.path) / name).string();
    std::error_code ec;
    TESSERA_CHECK(fs::exists(full, ec), "checkpoint ", manifest_.path, " is missing its file ", name);
    auto reader = std::make_unique<SafetensorsReader>(full, &manifest_.files.at(name));
    check_save_id(*reader, manifest_);
    r = std::move(reader);
  }
  return *r;
}

at::Tensor ShardedReader::read(const std::string& name, const TensorPiece& want) {
  auto it = manifest_.tensors.find(name);
  TESSERA_CHECK(it != manifest_.tensors.end(), "checkpoint ", manifest_.path, " has no tensor ", name);
  const ManifestTensor& t = it->second;
  at::Tensor out = at::empty(want.local_shape(), at::TensorOptions(scalar_type_of(t.dtype, name)));
  at::Tensor covered = at::zeros(want.local_shape(), at::kBool);
  for (const ManifestPiece& p : t.pieces) {
    auto [extent, start] = needed_extent(p.piece, want);
    if (extent.numel() == 0) continue;
    at::Tensor data = file(p.file).read_elements(p.key, start, extent.numel());
    if (copy_overlap(extent, data, want, out) > 0)
      copy_overlap(extent, at::ones(extent.local_shape(), at::kBool), want, covered);
  }
  const std::int64_t have = covered.sum().item<std::int64_t>();
  TESSERA_CHECK(have == out.numel(), "checkpoint ", manifest_.path, ": its files cover ", have, " of ", out.numel(),
                " wanted elements of ", name, " (", want.to_string(), ")");
  return out;
}

sdk::Checkpoint load_sharded(const std::string& path, const std::map<std::string, TensorPiece>& wanted,
                             std::int64_t rank) {
  std::map<std::string, StackedPieces> stacks;
  for (const auto& [name, piece] : wanted) stacks.emplace(name, StackedPieces{piece});
  return load_sharded(path, stacks, rank);
}

sdk::Checkpoint load_sharded(const std::string& path, const std::map<std::string, StackedPieces>& wanted,
                             std::int64_t rank) {
  const Manifest m = read_manifest(path);
  const auto weights = model_tensors(m);
  std::map<std::string, std::vector<std::int64_t>> saved;
  for (const auto& [name, t] : weights) saved.emplace(name, t->global_shape);
  TESSERA_CHECK(!holds_rank_local_state(m) || wanted.empty(), "checkpoint ", path, " holds rank-local state (fsdp state_dict_type = ",
                "\"local\"): it loads only into the same world size, strategy and model");
  std::map<std::string, TensorPiece> first_pieces;  // for the names and global shapes
  for (const auto& [name, stack] : wanted) {
    TESSERA_CHECK(!stack.empty(), "no piece of '", name, "' is wanted");
    first_pieces.emplace(name, stack[0]);
  }
  check_against_wanted(saved, first_pieces, "checkpoint " + path);

  ShardedReader files(m);
  auto assemble = [&](const std::string& name, const StackedPieces& want) {
    if (want.size() == 1) return files.read(name, want[0]);
    std::vector<at::Tensor> parts;
    for (const auto& piece : want) parts.push_back(files.read(name, piece));
    return at::cat(parts, 0);
  };

  // This rank's own entries where the checkpoint has a file for it, rank 0's otherwise.
  const std::string own = file_name(rank < m.world_size ? rank : 0, m.world_size);
  TESSERA_CHECK(m.files.count(own), "checkpoint ", path, " has no file ", own);
  SafetensorsReader& mine = files.file(own);
  json tree;
  try {
    tree = json::parse(mine.metadata().at("tessera.tree"));
  } catch (const std::exception& e) {
    TESSERA_FAIL(mine.path(), " has no readable tessera.tree metadata (", e.what(), ")");
  }
  std::vector<std::string> param_names;
  json optimizer;
  if (tree.contains("optimizer_states") && !tree["optimizer_states"].empty()) {
    optimizer = tree["optimizer_states"][0];
    for (const auto& n : optimizer.at("param_names")) param_names.push_back(n.get<std::string>());
    tree["optimizer_states"] = json::array();
  }
  std::map<std::string, std::vector<std::string>> orders;  // each model-shaped dict's names in the model's order, as saved
  for (const char* dict : kModelShapedKeys) {
    if (!tree.contains(dict)) continue;
    for (const auto& [name, ref] : tree[dict].items()) orders[dict].push_back(name);
    tree.erase(dict);
  }
  sdk::Checkpoint out = checkpoint_dict(decode(tree, [&](const std::string& n) { return mine.read(n); }), path);

  sdk::StateDict state;
  for (const auto& name : orders["state_dict"]) state.insert(name, assemble(model_tensor_key(name), wanted.at(name)));
  for (const auto& [name, t] : weights)  // (none in a checkpoint tessera wrote: every rank saves every name)
    if (!state.contains(name)) state.insert(name, assemble(model_tensor_key(name), wanted.at(name)));
  out.insert_or_assign("state_dict", to_ivalue(state));
  for (const auto& [dict, names] : orders) {  // the others, cut as the weights are
    if (dict == "state_dict") continue;
    sdk::StateDict other;
    for (const auto& name : names) {
      TESSERA_CHECK(wanted.count(name), "checkpoint ", path, " [", dict, "] holds '", name, "', which the model does not have");
      other.insert(name, assemble(model_tensor_key(name, dict), wanted.at(name)));
    }
    out.insert_or_assign(dict, to_ivalue(other));
  }

  if (!optimizer.is_null()) {
    // Moments from the manifest (every piece of every wanted parameter), scalars ("step") from
    // this rank's own entries.
    std::map<std::string, json> own_entries;
    if (optimizer.at("state").contains("__int_dict__"))  // ({} before the first step)
      for (const auto& kv : optimizer.at("state").at("__int_dict__"))
        own_entries[param_names.at(kv.at(0).get<std::size_t>())] = kv.at(1);
    // Every moment the manifest names belongs to a parameter this optimizer state lists.
    std::set<std::string> listed(param_names.begin(), param_names.end());
    for (const auto& [name, t] : m.tensors)
      if (name.rfind("optimizer/", 0) == 0)
        TESSERA_CHECK(listed.count(name.substr(10, name.rfind('/') - 10)), "checkpoint ", path, " has ", name,
                      " but its optimizer state lists no such parameter: it would be dropped");
    optimizer["state"] = json{{"__int_dict__", json::array()}};
    sdk::Checkpoint opt = checkpoint_dict(decode(optimizer, [&](const std::string& n) { return mine.read(n); }), path);
    c10::impl::GenericDict opt_state(c10::IntType::get(), c10::AnyType::get());
    for (std::size_t i = 0; i < param_names.size(); ++i) {
      const std::string& param = param_names[i];
      sdk::Checkpoint entry = sdk::make_checkpoint();
      const std::string prefix = "optimizer/" + param + "/";
      for (auto it = m.tensors.lower_bound(prefix); it != m.tensors.end() && it->first.rfind(prefix, 0) == 0; ++it) {
        TESSERA_CHECK(wanted.count(param), "checkpoint ", path, " has optimizer state for '", param,
                      "', which the model does not have");
        entry.insert(it->first.substr(prefix.size()), assemble(it->first, wanted.at(param)));
      }
      if (auto e = own_entries.find(param); e != own_entries.end())
        for (const auto& [key, value] : e->second.items())
          if (!value.contains("__tensor__") || key == "step")
            entry.insert(key, decode(value, [&](const std::string& n) { return mine.read(n); }));
      if (entry.size() > 0) opt_state.insert(static_cast<std::int64_t>(i), entry);
    }
    opt.insert_or_assign("state", opt_state);
    c10::impl::GenericList states(c10::AnyType::get());
    states.push_back(opt);
    out.insert_or_assign("optimizer_states", states);
  }
  return out;
}

sdk::Checkpoint load_shard(const std::string& path, std::int64_t rank) {
  const Manifest m = read_manifest(path);
  TESSERA_CHECK(rank >= 0 && rank < m.world_size, "checkpoint ", path, " was written by ", m.world_size,
                " ranks; it has no rank ", rank);
  const std::string file = file_name(rank, m.world_size), full = (fs::path(path) / file).string();
  TESSERA_CHECK(m.files.count(file), "checkpoint ", path, " has no file ", file);
  std::error_code ec;
  TESSERA_CHECK(fs::exists(full, ec), "checkpoint ", path, " is missing its file ", file);
  SafetensorsReader reader(full, &m.files.at(file));
  check_save_id(reader, m);
  json tree;
  try {
    tree = json::parse(reader.metadata().at("tessera.tree"));
  } catch (const std::exception& e) {
    TESSERA_FAIL(full, " has no readable tessera.tree metadata (", e.what(), ")");
  }
  sdk::Checkpoint out = checkpoint_dict(decode(tree, [&](const std::string& n) { return reader.read(n); }), full);
  std::map<std::string, TensorPiece> pieces;
  for (const auto& [name, t] : model_tensors(m))
    for (const ManifestPiece& p : t->pieces) {
      if (p.file != file) continue;
      TESSERA_CHECK(p.key == model_tensor_key(name), "checkpoint ", path, " holds ", p.key,
                    " as stacked pieces (tensor parallelism): it loads re-cut (state_dict_type = \"sharded\"), ",
                    "not as a rank's own state");
      pieces.emplace(name, p.piece);
    }
  if (!pieces.empty()) out.insert(kTensorPiecesKey, pieces_to_ivalue(pieces));
  return out;
}

sdk::Checkpoint read_trainer_state(const std::string& path) {
  if (is_dcp_checkpoint(path)) return dcp_trainer_state(path);
  sdk::Checkpoint state =
      is_sharded_checkpoint(path)
          ? checkpoint_dict(decode(json::parse(read_manifest(path).trainer_state),
                                   [](const std::string&) { return at::Tensor(); }),
                            "the trainer state of " + path)
          : load_checkpoint_file(path);
  for (const char* key : {"state_dict", "optimizer_states"}) (void)state.erase(key);  // absent is fine
  return state;
}

void verify_sharded(const std::string& path) {
  const Manifest m = read_manifest(path);
  for (const auto& [file, expected] : m.files) {
    const std::string full = (fs::path(path) / file).string();
    std::error_code ec;
    TESSERA_CHECK(fs::exists(full, ec), "checkpoint ", path, " is missing its file ", file);
    check_save_id(SafetensorsReader(full), m);
    const FileDigest actual = digest_file(full);
    TESSERA_CHECK(actual.size == expected.size, full, " has ", actual.size, " bytes but the manifest says ",
                  expected.size, " (truncated or replaced)");
    for (std::size_t b = 0; b < expected.blocks.size() && b < actual.blocks.size(); ++b)
      TESSERA_CHECK(actual.blocks[b] == expected.blocks[b], full, ": checksum mismatch in bytes [",
                    b * kChecksumBlock, ", ", std::min<std::int64_t>((b + 1) * kChecksumBlock, actual.size),
                    "): the file is damaged");
    TESSERA_CHECK(actual.xxh64 == expected.xxh64, full, ": checksum mismatch: the file is damaged");
  }
}

}  // namespace tessera::core
