#pragma once
/// An optional interface a Module may also implement when its parameter names and its
/// configuration are Hugging Face's own (e.g. `model.layers.3.self_attn.q_proj.weight`), so
/// that `init_from` a Hugging Face directory and `tessera checkpoint export --format hf` need
/// no mapping table. Queried with dynamic_cast, like MemoryLayout: adding it changed no
/// existing vtable.
#include <string>

#include "tessera/sdk/export.hpp"

namespace tessera::sdk {

class TESSERA_SDK_API HuggingFaceModel {
 public:
  virtual ~HuggingFaceModel();
  /// The model's `config.json` as Hugging Face writes it (model_type, architectures, sizes,
  /// torch_dtype left to the exporter), as JSON text.
  virtual std::string hf_config_json() const = 0;
};

}  // namespace tessera::sdk
