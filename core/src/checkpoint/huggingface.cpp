#include "checkpoint/huggingface.hpp"
#include "durable.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tessera/core/checkpoint.hpp"
#include "tessera/core/checkpoint_folder.hpp"
#include "tessera/core/sharded_checkpoint.hpp"
#include "tessera/sdk/error.hpp"

namespace tessera::core {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

json read_json(const std::string& path, const std::string& what) {
  std::ifstream in(path);
  TESSERA_CHECK(in.good(), what, " ", path, " does not exist or cannot be read");
  json value = json::parse(in, nullptr, /*allow_exceptions=*/false);
  TESSERA_CHECK(!value.is_discarded() && value.is_object(), what, " ", path, " is not a JSON object");
  return value;
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::ostringstream out;
  out << at::IntArrayRef(shape);
  return out.str();
}

/// Keys of `a` and `b` (both objects) whose values differ, recursively into objects both have.
void differing(const json& a, const json& b, const std::string& prefix, std::vector<std::string>& out) {
  for (const auto& [key, value] : a.items()) {
    if (!b.contains(key) || value.is_null() || b.at(key).is_null()) continue;
    if (prefix.empty() &&
        std::find(kHfConfigKeysNotCompared.begin(), kHfConfigKeysNotCompared.end(), key) != kHfConfigKeysNotCompared.end())
      continue;
    const json& other = b.at(key);
    if (value.is_object() && other.is_object()) differing(value, other, prefix + key + ".", out);
    else if (value != other) out.push_back(prefix + key + ": the model's " + value.dump() + ", the file's " + other.dump());
  }
}

}  // namespace

bool is_hf_directory(const std::string& path) {
  std::error_code ec;
  const fs::path folder(path);
  return fs::is_directory(folder, ec) && fs::exists(folder / kHfConfigName, ec) &&
         (fs::exists(folder / kHfWeightsName, ec) || fs::exists(folder / kHfIndexName, ec));
}

std::map<std::string, std::string> read_safetensors_index(const std::string& index_path) {
  const json index = read_json(index_path, "safetensors index");
  TESSERA_CHECK(index.contains("weight_map") && index.at("weight_map").is_object(), "safetensors index ", index_path,
                " has no \"weight_map\": {tensor name: file}");
  const fs::path folder = fs::path(index_path).parent_path();
  std::map<std::string, std::string> weight_map;
  std::map<std::string, bool> exists;  // per file, looked up once
  for (const auto& [name, file] : index.at("weight_map").items()) {
    TESSERA_CHECK(file.is_string(), index_path, ": weight_map[\"", name, "\"] is not a file name");
    const std::string f = file.get<std::string>();
    // Only files beside the index: a name with a folder part would reach outside it.
    TESSERA_CHECK(!f.empty() && f.find('/') == std::string::npos && f != "." && f != "..", index_path,
                  ": weight_map[\"", name, "\"] = \"", f, "\" is not a file name in the index's folder");
    auto it = exists.find(f);
    if (it == exists.end()) {
      std::error_code ec;
      it = exists.emplace(f, fs::is_regular_file(folder / f, ec)).first;
    }
    TESSERA_CHECK(it->second, index_path, " puts tensor '", name, "' in ", f, ", which is missing from ",
                  folder.string(), " (an incomplete download?)");
    weight_map.emplace(name, f);
  }
  return weight_map;
}

HfDirectory read_hf_directory(const std::string& path) {
  HfDirectory dir;
  dir.path = path;
  const fs::path folder(path);
  const json config = read_json((folder / kHfConfigName).string(), "Hugging Face config");
  dir.config_json = config.dump();
  std::error_code ec;
  std::map<std::string, std::string> weight_map;  // tensor -> file; empty: every tensor of model.safetensors
  if (fs::exists(folder / kHfWeightsName, ec)) {
    dir.weights = (folder / kHfWeightsName).string();
  } else {
    dir.weights = (folder / kHfIndexName).string();
    weight_map = read_safetensors_index(dir.weights);
    TESSERA_CHECK(!weight_map.empty(), dir.weights, " lists no tensors");
  }
  std::map<std::string, std::map<std::string, SafetensorsEntry>> headers;  // file -> its tensors
  auto header_of = [&](const std::string& file) -> const std::map<std::string, SafetensorsEntry>& {
    auto it = headers.find(file);
    if (it == headers.end()) it = headers.emplace(file, SafetensorsReader((folder / file).string()).tensors()).first;
    return it->second;
  };
  if (weight_map.empty()) {
    for (const auto& [name, entry] : header_of(kHfWeightsName)) dir.tensors.emplace(name, HfTensor{kHfWeightsName, entry});
    return dir;
  }
  for (const auto& [name, file] : weight_map) {
    const auto& tensors = header_of(file);
    auto it = tensors.find(name);
    TESSERA_CHECK(it != tensors.end(), dir.weights, " puts tensor '", name, "' in ", file,
                  ", which has no tensor of that name");
    dir.tensors.emplace(name, HfTensor{file, it->second});
  }
  return dir;
}

void check_hf_against_model(const HfDirectory& dir, const std::map<std::string, std::vector<std::int64_t>>& model,
                            bool strict) {
  std::vector<std::string> shapes, missing, unexpected;
  for (const auto& [name, t] : dir.tensors) {
    auto it = model.find(name);
    if (it == model.end()) unexpected.push_back(name + " (" + t.file + ")");
    else if (it->second != t.entry.shape)
      shapes.push_back("'" + name + "' in " + (fs::path(dir.path) / t.file).string() + " has shape " +
                       shape_text(t.entry.shape) + ", the model's is " + shape_text(it->second));
  }
  for (const auto& [name, shape] : model)
    if (!dir.tensors.count(name)) missing.push_back(name);
  TESSERA_CHECK(shapes.empty(), "Hugging Face folder ", dir.path, " does not fit the model: ", sdk::join(shapes, "; "));
  TESSERA_CHECK(!strict || (missing.empty() && unexpected.empty()), "Hugging Face folder ", dir.path,
                " does not match the model's tensor names: ", missing.size(), " of the model's missing [",
                sdk::join(missing), "], ", unexpected.size(), " not in the model [", sdk::join(unexpected), "]");
}

void check_hf_config(const std::string& file_config, const std::string& model_config, const std::string& where,
                     bool model_type_only) {
  const json file = json::parse(file_config);
  json model;
  try {
    model = json::parse(model_config);
  } catch (const std::exception& e) {
    TESSERA_FAIL("the model's hf_config_json() is not JSON: ", e.what());
  }
  TESSERA_CHECK(model.is_object(), "the model's hf_config_json() is not a JSON object");
  if (model.contains("model_type")) {
    TESSERA_CHECK(file.contains("model_type"), where, " has no model_type; the model is ", model.at("model_type").dump());
    TESSERA_CHECK(file.at("model_type") == model.at("model_type"), where, " is a model of model_type ",
                  file.at("model_type").dump(), "; this model is ", model.at("model_type").dump());
  }
  if (model_type_only) return;
  std::vector<std::string> keys;
  differing(model, file, "", keys);
  TESSERA_CHECK(keys.empty(), where, " describes another configuration than the model's: ", sdk::join(keys, "; "),
                " (configure the model from it: [model] config = \"", where, "\")");
}

std::string hf_dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kDouble: return "float64";
    default: TESSERA_FAIL("config.json's torch_dtype has no name for ", type);
  }
}

std::int64_t parse_byte_size(const std::string& text, const std::string& what) {
  // transformers' convert_file_size_to_int: GB = 10^9, GiB = 2^30 (and so on).
  static const std::vector<std::pair<std::string, std::int64_t>> units{
      {"KiB", std::int64_t{1} << 10}, {"MiB", std::int64_t{1} << 20}, {"GiB", std::int64_t{1} << 30},
      {"KB", 1'000},                  {"MB", 1'000'000},              {"GB", 1'000'000'000},
      {"B", 1},                       {"", 1}};
  for (const auto& [unit, scale] : units) {
    if (text.size() <= unit.size() || text.compare(text.size() - unit.size(), unit.size(), unit) != 0) continue;
    const std::string number = text.substr(0, text.size() - unit.size());
    std::size_t used = 0;
    double value = 0;
    try {
      value = std::stod(number, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != number.size() || !(value > 0) || value * static_cast<double>(scale) > 9e18) break;
    return std::max<std::int64_t>(1, static_cast<std::int64_t>(value * static_cast<double>(scale)));
  }
  TESSERA_FAIL(what, " \"", text, "\" is not a size: write a positive number of bytes or one with a unit, as ",
               "\"5GB\", \"500MB\", \"2GiB\"");
}

HfExport write_hf_directory(const std::string& dir, const std::vector<TensorSpec>& specs,
                            const std::function<at::Tensor(std::size_t)>& produce, const std::string& config_json,
                            const std::string& generation_config_json, std::int64_t max_shard_bytes) {
  TESSERA_CHECK(max_shard_bytes > 0, "the largest shard must be at least one byte");
  std::error_code ec;
  TESSERA_CHECK(!fs::exists(dir, ec) || (fs::is_directory(dir, ec) && fs::is_empty(dir, ec)), dir,
                " exists and is not an empty folder: export writes a new one");
  // Largest elements first: every tensor's offset is then a multiple of its element size.
  std::vector<std::size_t> order(specs.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return c10::elementSize(specs[a].dtype) > c10::elementSize(specs[b].dtype);
  });
  auto bytes_of = [&](std::size_t i) {
    std::int64_t n = static_cast<std::int64_t>(c10::elementSize(specs[i].dtype));
    for (auto d : specs[i].shape) n *= d;
    return n;
  };
  std::vector<std::vector<std::size_t>> shards;
  std::int64_t in_shard = 0;
  HfExport result;
  for (std::size_t i : order) {
    const std::int64_t bytes = bytes_of(i);
    if (shards.empty() || (in_shard > 0 && in_shard + bytes > max_shard_bytes)) shards.emplace_back(), in_shard = 0;
    shards.back().push_back(i);
    in_shard += bytes;
    result.total_bytes += bytes;
  }
  if (shards.empty()) shards.emplace_back();

  const fs::path target = fs::absolute(dir).lexically_normal();
  const fs::path temp = temporary_folder(target.string(), new_save_id());
  fs::create_directories(temp, ec);
  TESSERA_CHECK(!ec, "cannot create ", temp.string(), ": ", ec.message());
  try {
    auto write_text = [&](const std::string& name, const std::string& text) {
      atomic_write_file((temp / name).string(), [&](const std::string& path) {
        std::ofstream out(path, std::ios::binary);
        out << text;
        out.close();
        TESSERA_CHECK(out.good(), "cannot write ", path);
        detail::fsync_path(path, false);
      });
    };
    write_text(kHfConfigName, config_json + "\n");
    write_text(kHfGenerationConfigName, generation_config_json + "\n");
    std::map<std::string, std::string> weight_map;
    char name[64];
    for (std::size_t s = 0; s < shards.size(); ++s) {
      if (shards.size() == 1) std::snprintf(name, sizeof name, "%s", kHfWeightsName);
      else std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
      std::vector<TensorSpec> shard_specs;
      for (std::size_t i : shards[s]) {
        shard_specs.push_back(specs[i]);
        weight_map[specs[i].name] = name;
      }
      write_safetensors((temp / name).string(), shard_specs, [&](std::size_t k) { return produce(shards[s][k]); },
                        {{"format", "pt"}});
      result.files.emplace_back(name);
    }
    if (shards.size() > 1) {
      // save_pretrained's index: total_size, then the weight map sorted by tensor name (nlohmann::json sorts keys).
      nlohmann::json index = {{"metadata", {{"total_size", result.total_bytes}}}, {"weight_map", weight_map}};
      write_text(kHfIndexName, index.dump(2));
    }
    detail::fsync_path(temp.string(), true);
    if (fs::exists(target, ec)) fs::remove(target, ec);  // empty, checked above
    fs::rename(temp, target, ec);
    TESSERA_CHECK(!ec, "cannot rename ", temp.string(), " to ", target.string(), ": ", ec.message());
    detail::fsync_path(target.parent_path().string(), true);
  } catch (...) {
    std::error_code ignored;
    remove_tree(temp.string(), ignored);
    throw;
  }
  return result;
}

}  // namespace tessera::core
