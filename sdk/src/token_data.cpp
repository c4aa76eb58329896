// Anchors TokenVocabulary's and LargeDataset's vtables and type info in the SDK library (see
// checkpoint_io_features.cpp).
#include "tessera/sdk/token_data.hpp"

namespace tessera::sdk {

TokenVocabulary::~TokenVocabulary() = default;
LargeDataset::~LargeDataset() = default;

}  // namespace tessera::sdk
