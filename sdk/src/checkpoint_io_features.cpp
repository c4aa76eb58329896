// Anchors CheckpointIOFeatures' and AsyncCheckpointIO's vtables and type info in the SDK library, so that a
// dynamic_cast from any plugin's IO finds the one the host and strategies see.
#include "tessera/sdk/checkpoint_io_features.hpp"

namespace tessera::sdk {

CheckpointIOFeatures::~CheckpointIOFeatures() = default;
AsyncCheckpointIO::~AsyncCheckpointIO() = default;

}  // namespace tessera::sdk
