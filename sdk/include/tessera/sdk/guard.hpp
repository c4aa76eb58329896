#pragma once
/// RAII scopes returned by the *_context() methods (Lightning's context managers):
/// the effect lasts until the returned guard is destroyed. A null guard means "no effect".
#include <memory>

#include "tessera/sdk/export.hpp"

namespace tessera::sdk {

class TESSERA_SDK_API Guard {
 public:
  virtual ~Guard();
};
using GuardPtr = std::unique_ptr<Guard>;

}  // namespace tessera::sdk
