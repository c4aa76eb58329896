#include "python_pickle.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <optional>
#include <stdexcept>
#include <vector>

namespace tessera::core::detail {

namespace {

constexpr std::string_view kOrderedDict = "ccollections\nOrderedDict\n";

/// Reads a little-endian unsigned of `n` bytes at `at`.
std::uint64_t little_endian(std::string_view p, std::size_t at, std::size_t n) {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < n; ++i) v |= static_cast<std::uint64_t>(static_cast<unsigned char>(p[at + i])) << (8 * i);
  return v;
}

/// `length` bytes at `at` become `text` (length 0: `text` is inserted before the byte at `at`).
struct Edit {
  std::size_t at, length;
  std::string text;
};
using Rewrite = std::vector<Edit>;

/// Where the rewrite goes, from one scan that tracks where each value on the unpickler's stack
/// began; nullopt on an opcode it does not know or a malformed stream, with `*stopped` the
/// byte where the scan stopped.
std::optional<Rewrite> scan(std::string_view p, std::vector<std::string>* globals, std::size_t* stopped) {
  enum class Kind { other, ordered_dict_class, empty_tuple, ordered_dict };
  struct Slot {
    std::size_t start;
    bool mark;
    Kind kind = Kind::other;
  };
  std::vector<Slot> stack;
  std::map<std::uint64_t, Kind> memo;  // what BINPUT stored, for BINGET
  // Python's pickler numbers memo entries 0, 1, 2, ...; LibTorch's unpickler grows its memo table
  // to whatever index a BINPUT names (libFuzzer: LONG_BINPUT 0x74024b07, a 31 GB table filled
  // before the next opcode). A put past the next number, or a get of none, is not followed.
  std::uint64_t memo_size = 0;
  Rewrite rewrite;
  auto pop = [&](std::size_t n) -> std::optional<std::size_t> {  // start of the deepest popped
    if (stack.size() < n || n == 0) return std::nullopt;
    const std::size_t start = stack[stack.size() - n].start;
    stack.resize(stack.size() - n);
    return start;
  };
  auto pop_to_mark = [&]() -> std::optional<std::size_t> {  // the mark's start
    while (!stack.empty() && !stack.back().mark) stack.pop_back();
    if (stack.empty()) return std::nullopt;
    const std::size_t start = stack.back().start;
    stack.pop_back();
    return start;
  };
  std::size_t at = 0;
  while (at < p.size()) {
    const std::size_t op_at = at;
    *stopped = op_at;
    const auto op = static_cast<unsigned char>(p[at++]);
    auto skip = [&](std::size_t n) { at += n; return at <= p.size(); };
    auto sized = [&](std::size_t width) {  // a length of `width` bytes, then that many bytes
      if (at + width > p.size()) return false;
      const std::uint64_t n = little_endian(p, at, width);
      at += width;
      if (n > p.size() - at) return false;
      at += n;
      return true;
    };
    auto push = [&](std::size_t start, Kind kind = Kind::other) { stack.push_back({start, false, kind}); };
    auto memo_kind = [&](std::uint64_t index) { return memo.count(index) ? memo.at(index) : Kind::other; };
    std::optional<std::size_t> start;
    switch (op) {
      case 0x80: if (!skip(1)) return std::nullopt; break;                       // PROTO
      case '.': return rewrite;                                                   // STOP
      case 'q': case 'h': case 'r': case 'j': {                                   // (LONG_)BINPUT, BINGET
        const std::size_t width = op == 'q' || op == 'h' ? 1 : 4;
        if (!skip(width)) return std::nullopt;
        const std::uint64_t index = little_endian(p, op_at + 1, width);
        if (index > memo_size || ((op == 'h' || op == 'j') && index == memo_size)) return std::nullopt;
        if (op == 'h' || op == 'j') {
          push(op_at, memo_kind(index));
        } else {
          memo_size = std::max(memo_size, index + 1);
          if (!stack.empty()) memo[index] = stack.back().kind;
        }
        break;
      }
      case 0x94: ++memo_size; break;                                              // MEMOIZE
      case 'K': if (!skip(1)) return std::nullopt; push(op_at); break;            // BININT1
      case 'M': if (!skip(2)) return std::nullopt; push(op_at); break;            // BININT2
      case 'J': if (!skip(4)) return std::nullopt; push(op_at); break;            // BININT
      case 'G': if (!skip(8)) return std::nullopt; push(op_at); break;            // BINFLOAT
      case 0x8a: case 'U': case 'C': case 0x8c:                                   // LONG1, SHORT_BIN*
        if (!sized(1)) return std::nullopt;
        push(op_at);
        break;
      case 0x8b: case 'X': case 'T': case 'B':                                    // LONG4, BIN*
        if (!sized(4)) return std::nullopt;
        push(op_at);
        break;
      case 0x8d: case 0x8e:                                                       // BINUNICODE8, BINBYTES8
        if (!sized(8)) return std::nullopt;
        push(op_at);
        break;
      case 'c': {                                                                 // GLOBAL module\nname\n
        for (int line = 0; line < 2; ++line) {
          const std::size_t end = p.find('\n', at);
          if (end == std::string_view::npos) return std::nullopt;
          at = end + 1;
        }
        if (globals) {
          std::string name(p.substr(op_at + 1, at - op_at - 2));
          std::replace(name.begin(), name.end(), '\n', '.');
          globals->push_back(name);
        }
        push(op_at, p.substr(op_at, at - op_at) == kOrderedDict ? Kind::ordered_dict_class : Kind::other);
        break;
      }
      case 'N': case 0x88: case 0x89: case '}': case ']':                        // constants, empties
        push(op_at);
        break;
      case ')': push(op_at, Kind::empty_tuple); break;                            // EMPTY_TUPLE
      case '(': stack.push_back({op_at, true}); break;                           // MARK
      case 't': case 'd': case 'l':                                               // TUPLE, DICT, LIST
        if (!(start = pop_to_mark())) return std::nullopt;
        push(*start);
        break;
      case 0x85: case 0x86: case 0x87:                                            // TUPLE1..3
        if (!(start = pop(op - 0x84))) return std::nullopt;
        push(*start);
        break;
      case 'R': case 0x81: {                                                      // REDUCE, NEWOBJ
        if (stack.size() < 2) return std::nullopt;
        const Slot cls = stack[stack.size() - 2], args = stack.back();
        if (!(start = pop(2))) return std::nullopt;
        if (op == 'R' && cls.kind == Kind::ordered_dict_class && args.kind == Kind::empty_tuple) {
          // OrderedDict() -> {}: an empty dict in the class's place (a BINPUT after a GLOBAL
          // memoizes the dict, read by no one: each later OrderedDict() is rewritten too).
          const std::size_t class_bytes = p[cls.start] == 'c' ? kOrderedDict.size() : p[cls.start] == 'h' ? 2 : 5;
          rewrite.push_back({cls.start, class_bytes, "}"});
          rewrite.push_back({args.start, 1, ""});
          rewrite.push_back({op_at, 1, ""});
          push(*start, Kind::ordered_dict);
        } else {
          push(*start);
        }
        break;
      }
      case 'Q':                                                                   // BINPERSID
        if (stack.empty()) return std::nullopt;
        break;
      case 'b': case '0':                                                         // BUILD, POP
        // An OrderedDict's attributes (a state dict's _metadata) go under kOrderedDictAttributes:
        // LibTorch's BUILD calls a class and it has no POP, so MARK <key> <state> SETITEMS.
        if (op == 'b' && stack.size() >= 2 && stack[stack.size() - 2].kind == Kind::ordered_dict) {
          std::string key = "(X";
          for (int i = 0; i < 4; ++i) key.push_back(static_cast<char>((kOrderedDictAttributes.size() >> (8 * i)) & 0xff));
          key.append(kOrderedDictAttributes);
          rewrite.push_back({stack.back().start, 0, key});
          rewrite.push_back({op_at, 1, "u"});
        }
        if (!pop(1)) return std::nullopt;
        break;
      case '2':                                                                   // DUP
        if (stack.empty()) return std::nullopt;
        push(op_at);
        break;
      case 's': case 'a': {                                                       // SETITEM, APPEND
        // Key and value, or one item, above their container: a MARK before them and the
        // batched opcode (SETITEMS, APPENDS) in this one's place.
        const std::size_t items = op == 's' ? 2 : 1;
        if (stack.size() < items + 1 || !(start = pop(items))) return std::nullopt;
        rewrite.push_back({*start, 0, "("});
        rewrite.push_back({op_at, 1, op == 's' ? "u" : "e"});
        break;
      }
      case 'u': case 'e': case '1':                                               // SETITEMS, APPENDS, POP_MARK
        if (!pop_to_mark()) return std::nullopt;
        break;
      default: return std::nullopt;
    }
  }
  *stopped = p.size();
  return std::nullopt;  // no STOP
}

}  // namespace

bool allowed_global(const std::string& name) {
  // What torch.save writes for tensors, storages and containers: the allowlist of PyTorch's
  // weights-only unpickler (torch/_weights_only_unpickler.py) for these.
  // LibTorch's own pickle_save (older Tessera checkpoints, C++ torch::save) also writes typed
  // lists and type tags through torch.jit._pickle: constructors of containers, nothing more.
  static const char* const kExact[] = {"collections.OrderedDict", "torch.device", "torch.Size", "builtins.set",
                                       "builtins.complex", "_codecs.encode", "torch.jit._pickle.build_intlist",
                                       "torch.jit._pickle.build_doublelist", "torch.jit._pickle.build_boollist",
                                       "torch.jit._pickle.build_tensorlist", "torch.jit._pickle.restore_type_tag"};
  for (const char* allowed : kExact)
    if (name == allowed) return true;
  auto starts = [&](std::string_view prefix) { return name.rfind(prefix, 0) == 0; };
  auto ends = [&](std::string_view suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  static const char* const kDtypes[] = {"float32", "float", "float64", "double", "float16", "half", "bfloat16",
                                        "int8", "int16", "short", "int32", "int", "int64", "long", "uint8", "bool",
                                        "complex64", "cfloat", "complex128", "cdouble"};
  for (const char* dtype : kDtypes)  // a torch.dtype value, as the weights-only unpickler allows
    if (name == std::string("torch.") + dtype) return true;
  const bool storage = starts("torch.") && ends("Storage") && name.find('.', 6) == std::string::npos;
  const bool rebuild = starts("torch._utils._rebuild_") && name.find('.', 13) == std::string::npos;
  return storage || rebuild;
}

std::string readable_by_libtorch(std::string_view pickle, std::vector<std::string>* globals) {
  std::size_t stopped = 0;
  auto found = scan(pickle, globals, &stopped);
  // LibTorch's unpickler trusts what a pickle says: a string's length is allocated before its
  // bytes are read (a 1 KB file asked for 4 GB), and a global it reads after an opcode the scan
  // could not follow would escape the allowlist. What the scan cannot follow is refused.
  if (!found)
    throw std::runtime_error(
        stopped >= pickle.size()
            ? "its pickle ends without STOP (" + std::to_string(pickle.size()) + " bytes)"
            : "its pickle cannot be followed at byte " + std::to_string(stopped) + " of " +
                  std::to_string(pickle.size()) + " (opcode 0x" +
                  [&] {
                    char hex[3];
                    std::snprintf(hex, sizeof hex, "%02x", static_cast<unsigned char>(pickle[stopped]));
                    return std::string(hex);
                  }() +
                  "): an opcode torch.save does not write, an argument or length past the end, or a memo index out of its order");
  if (found->empty()) return std::string(pickle);
  Rewrite& edits = *found;
  // In stream order; at one position the insertions (MARKs) go before the replaced opcode.
  std::stable_sort(edits.begin(), edits.end(),
                   [](const Edit& a, const Edit& b) { return a.at != b.at ? a.at < b.at : a.length < b.length; });
  std::string out;
  out.reserve(pickle.size() + edits.size());
  std::size_t copied = 0;
  for (const Edit& edit : edits) {
    out.append(pickle.substr(copied, edit.at - copied));
    out.append(edit.text);
    copied = edit.at + edit.length;
  }
  out.append(pickle.substr(copied));
  return out;
}

}  // namespace tessera::core::detail
