#include "loggers/logger.hpp"

#include <sstream>

namespace tessera::host {

void flatten_hyperparameters(const sdk::Checkpoint& dict, const std::string& prefix, HyperParameters& out) {
  for (const auto& item : dict) {
    std::string key = prefix + item.key().toStringRef();
    const c10::IValue& v = item.value();
    if (v.isGenericDict()) flatten_hyperparameters(v.toGenericDict(), key + ".", out);
    else if (v.isBool()) out[key] = v.toBool();
    else if (v.isInt()) out[key] = v.toInt();
    else if (v.isDouble()) out[key] = v.toDouble();
    else if (v.isString()) out[key] = v.toStringRef();
    else {
      std::ostringstream text;
      text << v;
      out[key] = text.str();
    }
  }
}

}  // namespace tessera::host
