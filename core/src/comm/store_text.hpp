#pragma once
/// Text values in a c10d store, whose 1.13 interface moves bytes only (ledgers, failure
/// records, the shared-memory rendezvous).
#include <cstdint>
#include <string>
#include <vector>

namespace tessera::core::detail {

inline std::string to_string(const std::vector<std::uint8_t>& bytes) { return {bytes.begin(), bytes.end()}; }
inline std::vector<std::uint8_t> to_bytes(const std::string& s) { return {s.begin(), s.end()}; }

}  // namespace tessera::core::detail
