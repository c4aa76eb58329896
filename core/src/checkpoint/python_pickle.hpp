#pragma once
// Python's pickles as LibTorch's unpickler reads them.
#include <string>
#include <string_view>

namespace tessera::core::detail {

/// `pickle` (protocol 2, as torch.save writes) with each APPEND written as MARK <item>
/// APPENDS and each SETITEM as MARK <key> <value> SETITEMS, which mean the same. Python's
/// pickler adds a lone item (a one-element list or dict, or the last of a batch of 1000) with
/// the former, which LibTorch 1.13's unpickler does not know: every checkpoint Python saved
/// was unreadable (Lightning's optimizer_states is a one-element list). Returned unchanged where
/// it holds an opcode this scan does not know (LibTorch then reads or refuses it as before).
std::string batched_items_only(std::string_view pickle);

}  // namespace tessera::core::detail
