#pragma once
// Python's pickles as LibTorch's unpickler reads them.
#include <string>
#include <string_view>
#include <vector>

namespace tessera::core::detail {

/// `pickle` (protocol 2, as torch.save writes) rewritten into opcodes LibTorch 1.13's unpickler
/// reads, meaning the same:
/// - each APPEND as MARK <item> APPENDS and each SETITEM as MARK <key> <value> SETITEMS. Python's
///   pickler adds a lone item (a one-element list or dict, or the last of a batch of 1000) with
///   the former, which that unpickler does not know: every checkpoint Python saved was
///   unreadable (Lightning's optimizer_states is a one-element list).
/// - each `collections.OrderedDict()` as an empty dict (its items follow as SETITEMS), and the
///   BUILD that sets its attributes (a state dict's `_metadata`) as an item under
///   kOrderedDictAttributes (that unpickler has no POP to drop it with). It makes OrderedDict
///   None: `torch.save(model.state_dict(), f)`, the commonest file in PyTorch, and Lightning's
///   `state_dict` failed to load.
/// Throws std::runtime_error, saying at which byte, where the scan cannot follow the pickle (an
/// opcode it does not know, a length or argument past the end, no STOP): LibTorch's unpickler
/// would allocate whatever length a damaged file says, and a global read after such an opcode
/// would escape allowed_global().
/// `globals`, when given, receives the Python globals ("module.name") of the GLOBAL opcodes the
/// scan read.
std::string readable_by_libtorch(std::string_view pickle, std::vector<std::string>* globals = nullptr);

/// Whether a checkpoint's pickle may name the Python global `name` ("module.name"): the tensor,
/// storage and container types torch.save writes, PyTorch's weights-only allowlist for them.
/// Anything else (os.system, builtins.eval, ...) would run code in Python's torch.load.
bool allowed_global(const std::string& name);

/// The key an OrderedDict's attributes are kept under (the loader drops it).
constexpr std::string_view kOrderedDictAttributes = "tessera: OrderedDict attributes";

}  // namespace tessera::core::detail
