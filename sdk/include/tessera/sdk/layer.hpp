#pragma once
/// Optional interfaces a layer (a torch::nn::Module of the toolkit or of a plugin) may also
/// implement, for what the engine must know of a layer whose class it cannot name: it links
/// neither the toolkit nor any plugin. Queried with dynamic_cast, like HuggingFaceModel.

#include "tessera/sdk/export.hpp"

namespace tessera::sdk {

/// A layer that draws its parameters and resets its buffers again as its constructor did.
/// Deferred init materialises a module's tensors where they train, then calls this on the
/// layer's full shapes (a tensor-parallel layer's whole weight, cut to its piece afterwards).
class TESSERA_SDK_API ResettableLayer {
 public:
  virtual ~ResettableLayer();
  virtual void reset_parameters() = 0;
};

/// A batch norm of the layer's own class (torch::nn's are known already): its statistics and
/// affine parameters stay in fp32 under FSDP's mixed precision, as PyTorch keeps _BatchNorm's.
class TESSERA_SDK_API BatchNormLayer {
 public:
  virtual ~BatchNormLayer();
};

}  // namespace tessera::sdk
