#include "checkpoint_json.hpp"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>

#include <ATen/ATen.h>

#include "tessera/core/checkpoint.hpp"
#include "tessera/sdk/types.hpp"
#include "tessera/sdk/error.hpp"

namespace tessera::core::checkpoint_json {

namespace fs = std::filesystem;
using c10::IValue;


json encode(const IValue& v, std::vector<std::string>& path, const TensorNamer& name_of) {
  if (v.isNone()) return nullptr;
  if (v.isBool()) return v.toBool();
  if (v.isInt()) return v.toInt();
  if (v.isDouble()) {
    const double d = v.toDouble();
    if (std::isfinite(d)) return d;
    return {{"__float__", std::isnan(d) ? "nan" : (d > 0 ? "inf" : "-inf")}};
  }
  if (v.isString()) return v.toStringRef();
  if (v.isTensor()) return {{"__tensor__", name_of(path, v.toTensor())}};
  auto items = [&](c10::ArrayRef<IValue> values) {
    json out = json::array();
    for (std::size_t i = 0; i < values.size(); ++i) {
      path.push_back(std::to_string(i));
      out.push_back(encode(values[i], path, name_of));
      path.pop_back();
    }
    return out;
  };
  if (v.isTuple()) return {{"__tuple__", items(v.toTupleRef().elements())}};
  if (v.isList()) return items(v.toListRef());
  if (v.isGenericDict()) {
    auto dict = v.toGenericDict();
    const bool int_keys = dict.size() > 0 && dict.begin()->key().isInt();
    json out = int_keys ? json::array() : json::object();
    for (const auto& item : dict) {
      TESSERA_CHECK(item.key().isString() || (int_keys && item.key().isInt()), "checkpoint entry ",
                    sdk::join(path, "/"), " has a key of type ", item.key().tagKind(), " (str or int keys only)");
      const std::string key = int_keys ? std::to_string(item.key().toInt()) : item.key().toStringRef();
      path.push_back(key);
      if (int_keys) out.push_back({item.key().toInt(), encode(item.value(), path, name_of)});
      else out[key] = encode(item.value(), path, name_of);
      path.pop_back();
    }
    return int_keys ? json{{"__int_dict__", out}} : out;
  }
  TESSERA_FAIL("checkpoint entry ", sdk::join(path, "/"), " holds a ", v.tagKind(),
               ", which a sharded checkpoint cannot store");
}


IValue decode(const json& j, const TensorResolver& tensor_of) {
  if (j.is_null()) return IValue();
  if (j.is_boolean()) return j.get<bool>();
  if (j.is_number_integer()) return j.get<std::int64_t>();
  if (j.is_number_float()) return j.get<double>();
  if (j.is_string()) return j.get<std::string>();
  if (j.is_array()) {
    std::vector<IValue> values;
    for (const auto& item : j) values.push_back(decode(item, tensor_of));
    auto all = [&](auto is) { return !values.empty() && std::all_of(values.begin(), values.end(), is); };
    // Typed lists where every element agrees (what LibTorch's own lists are).
    if (all([](const IValue& x) { return x.isInt(); })) {
      c10::List<std::int64_t> out;
      for (const auto& x : values) out.push_back(x.toInt());
      return out;
    }
    if (all([](const IValue& x) { return x.isDouble(); })) {
      c10::List<double> out;
      for (const auto& x : values) out.push_back(x.toDouble());
      return out;
    }
    if (all([](const IValue& x) { return x.isString(); })) {
      c10::List<std::string> out;
      for (const auto& x : values) out.push_back(x.toStringRef());
      return out;
    }
    c10::impl::GenericList out(c10::AnyType::get());
    for (auto& x : values) out.push_back(std::move(x));
    return out;
  }
  if (j.contains("__tensor__")) return tensor_of(j.at("__tensor__").get<std::string>());
  if (j.contains("__float__")) {
    const std::string s = j.at("__float__").get<std::string>();
    return s == "nan" ? std::nan("") : (s == "inf" ? INFINITY : -INFINITY);
  }
  if (j.contains("__tuple__")) {
    std::vector<IValue> values;
    for (const auto& item : j.at("__tuple__")) values.push_back(decode(item, tensor_of));
    return c10::ivalue::Tuple::create(std::move(values));
  }
  if (j.contains("__int_dict__")) {
    c10::impl::GenericDict out(c10::IntType::get(), c10::AnyType::get());
    for (const auto& kv : j.at("__int_dict__")) out.insert(kv.at(0).get<std::int64_t>(), decode(kv.at(1), tensor_of));
    return out;
  }
  sdk::Checkpoint out = sdk::make_checkpoint();
  for (const auto& [key, value] : j.items()) out.insert(key, decode(value, tensor_of));
  return out;
}

json read_json(const fs::path& file, const std::string& what) {
  std::ifstream in(file);
  TESSERA_CHECK(in.good(), what, " ", file.string(), " cannot be read: ", std::strerror(errno));
  try {
    return json::parse(in);
  } catch (const std::exception& e) {
    TESSERA_FAIL(what, " ", file.string(), " is not valid JSON (", e.what(), ")");
  }
}

void write_json(const fs::path& file, const json& j) {
  const std::string text = j.dump(1);
  atomic_write(file.string(), [&](std::ostream& out) { out << text << "\n"; });
}

}  // namespace tessera::core::checkpoint_json
