#pragma once
// Binds a call's positional and keyword arguments to a builtin's parameters as Python binds
// them, so that `tojson(indent=2)` and `tojson(false, 2)` mean the same.
#include <initializer_list>
#include <string>
#include <vector>

#include "chat_template/errors.hpp"
#include "chat_template/value.hpp"

namespace tessera::toolkit::jinja {

class Params {
 public:
  Params(const std::string& callee, CallArgs& args, std::initializer_list<const char*> names)
      : names_(names), values_(names.size()), given_(names.size(), false) {
    if (args.positional.size() > names_.size())
      fail("TypeError: ", callee, "() takes at most ", names_.size(), " argument(s) (", args.positional.size(), " given)");
    for (std::size_t i = 0; i < args.positional.size(); ++i) {
      values_[i] = args.positional[i];
      given_[i] = true;
    }
    for (auto& [key, value] : args.keyword) {
      std::size_t i = 0;
      while (i < names_.size() && key != names_[i]) ++i;
      if (i == names_.size()) fail("TypeError: ", callee, "() got an unexpected keyword argument '", key, "'");
      if (given_[i]) fail("TypeError: ", callee, "() got multiple values for argument '", key, "'");
      values_[i] = value;
      given_[i] = true;
    }
  }
  bool has(std::size_t i) const { return given_[i]; }
  const Value& operator[](std::size_t i) const { return values_[i]; }
  /// The argument, or `fallback` when it was not given.
  Value get(std::size_t i, Value fallback) const { return given_[i] ? values_[i] : fallback; }
  /// The argument, which must be given.
  const Value& need(std::size_t i, const std::string& callee) const {
    if (!given_[i]) fail("TypeError: ", callee, "() missing required argument '", names_[i], "'");
    return values_[i];
  }

 private:
  std::vector<const char*> names_;
  std::vector<Value> values_;
  std::vector<bool> given_;
};

}  // namespace tessera::toolkit::jinja
