#pragma once
// A pickle read as a tree of descriptions, never executed: what DCP's `.metadata` (pickled
// Python dataclasses) is read with. Classes are only named, never called, and only the names
// the caller allows may appear; anything else is refused naming the byte where it was found.
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace tessera::core::detail {

/// One Python value: a scalar, a container, a global ("module.name"), or an object made from a
/// global (REDUCE / NEWOBJ: `type` with `args`) and given `state` by BUILD.
struct PickleNode {
  enum class Kind { none, boolean, integer, floating, string, bytes, tuple, list, dict, set, global, object };
  Kind kind = Kind::none;
  bool boolean = false;
  std::int64_t integer = 0;
  double floating = 0;
  std::string text;             ///< string, bytes; global: its name
  std::vector<PickleNode*> items;  ///< tuple, list, set; dict: key, value, key, value, ...
  std::string type;                ///< object: its class ("module.name")
  PickleNode* args = nullptr;      ///< object: constructor arguments (a tuple)
  PickleNode* state = nullptr;     ///< object: BUILD's state (null without one)

  /// "int", "str", "dict", "object torch.Size", ...: for error messages.
  std::string describe() const;
  /// The value of key `key` in a dict (string keys), or null.
  const PickleNode* get(std::string_view key) const;
};

/// The nodes of one pickle (they may refer to each other in cycles, as a pickle's memo allows)
/// and its top value.
struct PickleTree {
  std::deque<PickleNode> nodes;
  const PickleNode* root = nullptr;
};

/// Reads `bytes` (pickle protocol 2-5, as Python 3's pickler writes) into a tree. `allowed`
/// decides which globals may appear. Throws sdk::Error naming `what` and the byte offset on an
/// unknown opcode, a global not allowed, a length past the end or a malformed stack; the tree
/// is bounded by `bytes` (at most one node per opcode).
PickleTree read_pickle_tree(std::string_view bytes, const std::function<bool(const std::string&)>& allowed,
                           const std::string& what);

}  // namespace tessera::core::detail
