#pragma once
// A checkpoint's values (sdk::Checkpoint's IValues) as JSON, for the sharded format's manifest
// and each rank's file metadata: tensors become {"__tensor__": name} (stored beside it), tuples
// {"__tuple__": [...]}, int-keyed dicts {"__int_dict__": [[k, v], ...]}, non-finite floats
// {"__float__": "inf"}. Private to core (sharded_checkpoint.cpp).
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>
#include <nlohmann/json.hpp>

namespace tessera::core::checkpoint_json {

using json = nlohmann::ordered_json;

/// Names the tensor found at `path` (the keys and indices leading to it).
using TensorNamer = std::function<std::string(const std::vector<std::string>& path, const at::Tensor&)>;
json encode(const c10::IValue& v, std::vector<std::string>& path, const TensorNamer& name_of);

/// The tensor stored under `name`.
using TensorResolver = std::function<at::Tensor(const std::string& name)>;
c10::IValue decode(const json& j, const TensorResolver& tensor_of);

/// `file` parsed; a missing or damaged file is an error naming it as `what`.
json read_json(const std::filesystem::path& file, const std::string& what);
/// `j` written to `file` (no fsync: the caller flushes the folder).
void write_json(const std::filesystem::path& file, const json& j);

}  // namespace tessera::core::checkpoint_json
