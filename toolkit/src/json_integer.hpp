#pragma once
// Integers of JSON files read from outside (tokenizer.json, token manifests): nlohmann's
// get<std::int64_t> converts a float or an out-of-range number with undefined behaviour.
#include <cstdint>
#include <optional>

#include <nlohmann/json.hpp>

namespace tessera::toolkit::detail {

/// `value` when it is a JSON integer (not a float) that fits an int64; nullopt otherwise.
inline std::optional<std::int64_t> json_integer(const nlohmann::json& value) {
  if (!value.is_number_integer()) return std::nullopt;
  if (value.is_number_unsigned() && value.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX))
    return std::nullopt;
  return value.get<std::int64_t>();
}

}  // namespace tessera::toolkit::detail
