#include "python_pickle.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace tessera::core::detail {

namespace {

/// Reads a little-endian unsigned of `n` bytes at `at`.
std::uint64_t little_endian(std::string_view p, std::size_t at, std::size_t n) {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < n; ++i) v |= static_cast<std::uint64_t>(static_cast<unsigned char>(p[at + i])) << (8 * i);
  return v;
}

struct Rewrite {
  std::vector<std::size_t> marks_at;                        // a MARK goes before each
  std::vector<std::pair<std::size_t, char>> opcodes_at;     // APPEND -> APPENDS, SETITEM -> SETITEMS
};

/// Where the rewrite goes, from one scan that tracks where each value on the unpickler's stack
/// began; nullopt on an opcode it does not know or a malformed stream.
std::optional<Rewrite> scan(std::string_view p) {
  struct Slot {
    std::size_t start;
    bool mark;
  };
  std::vector<Slot> stack;
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
    auto push = [&](std::size_t start) { stack.push_back({start, false}); };
    std::optional<std::size_t> start;
    switch (op) {
      case 0x80: if (!skip(1)) return std::nullopt; break;                       // PROTO
      case '.': return rewrite;                                                   // STOP
      case 'q': case 'h': if (!skip(1)) return std::nullopt;                     // BINPUT, BINGET
        if (op == 'h') push(op_at);
        break;
      case 'r': case 'j': if (!skip(4)) return std::nullopt;                     // LONG_BINPUT, LONG_BINGET
        if (op == 'j') push(op_at);
        break;
      case 0x94: break;                                                           // MEMOIZE
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
        push(op_at);
        break;
      }
      case 'N': case 0x88: case 0x89: case '}': case ']': case ')':              // constants, empties
        push(op_at);
        break;
      case '(': stack.push_back({op_at, true}); break;                           // MARK
      case 't': case 'd': case 'l':                                               // TUPLE, DICT, LIST
        if (!(start = pop_to_mark())) return std::nullopt;
        push(*start);
        break;
      case 0x85: case 0x86: case 0x87:                                            // TUPLE1..3
        if (!(start = pop(op - 0x84))) return std::nullopt;
        push(*start);
        break;
      case 'R': case 0x81:                                                        // REDUCE, NEWOBJ
        if (!(start = pop(2))) return std::nullopt;
        push(*start);
        break;
      case 'Q':                                                                   // BINPERSID
        if (stack.empty()) return std::nullopt;
        break;
      case 'b': case '0':                                                         // BUILD, POP
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
        rewrite.marks_at.push_back(*start);
        rewrite.opcodes_at.emplace_back(op_at, op == 's' ? 'u' : 'e');
        break;
      }
      case 'u': case 'e': case '1':                                               // SETITEMS, APPENDS, POP_MARK
        if (!pop_to_mark()) return std::nullopt;
        break;
      default: return std::nullopt;
    }
  }
  return std::nullopt;  // no STOP
}

}  // namespace

std::string batched_items_only(std::string_view pickle) {
  auto found = scan(pickle);
  if (!found || found->opcodes_at.empty()) return std::string(pickle);
  auto& [marks_at, opcodes_at] = *found;
  std::sort(marks_at.begin(), marks_at.end());
  std::string out;
  out.reserve(pickle.size() + marks_at.size());
  std::size_t next_mark = 0, next_opcode = 0;  // opcodes_at is in stream order already
  for (std::size_t i = 0; i < pickle.size(); ++i) {
    for (; next_mark < marks_at.size() && marks_at[next_mark] == i; ++next_mark) out.push_back('(');
    if (next_opcode < opcodes_at.size() && opcodes_at[next_opcode].first == i) {
      out.push_back(opcodes_at[next_opcode++].second);
    } else {
      out.push_back(pickle[i]);
    }
  }
  return out;
}

}  // namespace tessera::core::detail
