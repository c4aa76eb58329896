#include "pickle_tree.hpp"

#include <cstring>

#include "tessera/sdk/error.hpp"

namespace tessera::core::detail {

std::string PickleNode::describe() const {
  switch (kind) {
    case Kind::none: return "None";
    case Kind::boolean: return "bool";
    case Kind::integer: return "int";
    case Kind::floating: return "float";
    case Kind::string: return "str";
    case Kind::bytes: return "bytes";
    case Kind::tuple: return "tuple";
    case Kind::list: return "list";
    case Kind::dict: return "dict";
    case Kind::set: return "set";
    case Kind::global: return "the class " + text;
    case Kind::object: return "an object of " + type;
  }
  return "?";
}

const PickleNode* PickleNode::get(std::string_view key) const {
  if (kind != Kind::dict) return nullptr;
  for (std::size_t i = 0; i + 1 < items.size(); i += 2)
    if (items[i]->kind == Kind::string && items[i]->text == key) return items[i + 1];
  return nullptr;
}

namespace {

/// One pass of pickle's virtual machine that builds nodes instead of calling anything.
class Reader {
 public:
  Reader(std::string_view p, const std::function<bool(const std::string&)>& allowed, const std::string& what,
         PickleTree& tree)
      : p_(p), allowed_(allowed), what_(what), tree_(tree) {}

  const PickleNode* run() {
    while (true) {
      at_ = pos_;
      const auto op = static_cast<unsigned char>(take(1)[0]);
      switch (op) {
        case 0x80: take(1); break;  // PROTO
        case 0x95: take(8); break;  // FRAME: a length hint
        case '.':                   // STOP
          fail_unless(stack_.size() == 1 && marks_.empty(), "STOP with ", stack_.size(), " values on the stack");
          return stack_.back();
        case '(': marks_.push_back(stack_.size()); break;
        case '0': pop(); break;
        case '1': pop_mark(); break;
        case '2':
          fail_unless(stack_.size() > floor(), "DUP on an empty stack");
          push(stack_.back());
          break;
        case 'N': push(node(PickleNode::Kind::none)); break;
        case 0x88: case 0x89: {
          PickleNode* b = node(PickleNode::Kind::boolean);
          b->boolean = op == 0x88;
          push(b);
          break;
        }
        case 'J': push_int(static_cast<std::int32_t>(little(4))); break;
        case 'K': push_int(static_cast<std::int64_t>(little(1))); break;
        case 'M': push_int(static_cast<std::int64_t>(little(2))); break;
        case 0x8a: push_long(little(1)); break;  // LONG1
        case 0x8b: push_long(little(4)); break;  // LONG4
        case 'G': {                              // BINFLOAT: big-endian
          std::string_view b = take(8);
          std::uint64_t bits = 0;
          for (char c : b) bits = (bits << 8) | static_cast<unsigned char>(c);
          PickleNode* f = node(PickleNode::Kind::floating);
          std::memcpy(&f->floating, &bits, 8);
          push(f);
          break;
        }
        case 0x8c: push_text(PickleNode::Kind::string, little(1)); break;  // SHORT_BINUNICODE
        case 'X': push_text(PickleNode::Kind::string, little(4)); break;   // BINUNICODE
        case 0x8d: push_text(PickleNode::Kind::string, little(8)); break;  // BINUNICODE8
        case 'C': push_text(PickleNode::Kind::bytes, little(1)); break;    // SHORT_BINBYTES
        case 'B': push_text(PickleNode::Kind::bytes, little(4)); break;    // BINBYTES
        case 0x8e: push_text(PickleNode::Kind::bytes, little(8)); break;   // BINBYTES8
        case ')': push(node(PickleNode::Kind::tuple)); break;
        case 't': push(container(PickleNode::Kind::tuple, pop_mark())); break;
        case 0x85: case 0x86: case 0x87: {  // TUPLE1..3
          const std::size_t n = op - 0x84;
          fail_unless(stack_.size() >= n + floor(), "TUPLE", n, " with fewer values on the stack");
          std::vector<PickleNode*> items(stack_.end() - static_cast<std::ptrdiff_t>(n), stack_.end());
          stack_.resize(stack_.size() - n);
          push(container(PickleNode::Kind::tuple, std::move(items)));
          break;
        }
        case ']': push(node(PickleNode::Kind::list)); break;
        case 'l': push(container(PickleNode::Kind::list, pop_mark())); break;
        case '}': push(node(PickleNode::Kind::dict)); break;
        case 'd': push(dict(pop_mark())); break;
        case 0x8f: push(node(PickleNode::Kind::set)); break;  // EMPTY_SET
        case 0x91: push(container(PickleNode::Kind::set, pop_mark())); break;  // FROZENSET
        case 'a': {
          PickleNode* item = pop();
          extend(top(PickleNode::Kind::list, "APPEND"), {item});
          break;
        }
        case 'e': {
          std::vector<PickleNode*> items = pop_mark();
          extend(top(PickleNode::Kind::list, "APPENDS"), items);
          break;
        }
        case 0x90: {  // ADDITEMS
          std::vector<PickleNode*> items = pop_mark();
          extend(top(PickleNode::Kind::set, "ADDITEMS"), items);
          break;
        }
        case 's': {
          PickleNode* value = pop();
          PickleNode* key = pop();
          extend(top(PickleNode::Kind::dict, "SETITEM"), {key, value});
          break;
        }
        case 'u': {
          std::vector<PickleNode*> items = pop_mark();
          fail_unless(items.size() % 2 == 0, "SETITEMS with an odd number of values");
          extend(top(PickleNode::Kind::dict, "SETITEMS"), items);
          break;
        }
        case 'c': {  // GLOBAL: "module\nname\n"
          std::string module = line(), name = line();
          push(global(module + "." + name));
          break;
        }
        case 0x93: {  // STACK_GLOBAL
          PickleNode* name = pop();
          PickleNode* module = pop();
          fail_unless(module->kind == PickleNode::Kind::string && name->kind == PickleNode::Kind::string,
                      "STACK_GLOBAL of a ", module->describe(), " and a ", name->describe());
          push(global(module->text + "." + name->text));
          break;
        }
        case 'R': case 0x81: {  // REDUCE, NEWOBJ: both describe "type(*args)"
          PickleNode* args = pop();
          PickleNode* type = pop();
          fail_unless(type->kind == PickleNode::Kind::global, op == 'R' ? "REDUCE" : "NEWOBJ", " calls ",
                      type->describe(), ", not a class");
          fail_unless(args->kind == PickleNode::Kind::tuple, "arguments of ", type->text, " are a ", args->describe());
          PickleNode* o = node(PickleNode::Kind::object);
          o->type = type->text;
          o->args = args;
          push(o);
          break;
        }
        case 'b': {  // BUILD
          PickleNode* state = pop();
          PickleNode* o = top(PickleNode::Kind::object, "BUILD");
          fail_unless(o->state == nullptr, "a second BUILD of one ", o->type);
          o->state = state;
          break;
        }
        case 'q': memo(little(1)); break;   // BINPUT
        case 'r': memo(little(4)); break;   // LONG_BINPUT
        case 0x94: memo(memo_.size()); break;  // MEMOIZE
        case 'h': push(recall(little(1))); break;  // BINGET
        case 'j': push(recall(little(4))); break;  // LONG_BINGET
        default:
          fail("opcode 0x", hex(op), " (", printable(op), "), which a DCP metadata pickle does not use");
      }
    }
  }

 private:
  template <typename... Args>
  [[noreturn]] void fail(const Args&... args) const {
    TESSERA_FAIL(what_, ": byte ", at_, ": ", args...);
  }
  template <typename... Args>
  void fail_unless(bool ok, const Args&... args) const {
    if (!ok) fail(args...);
  }
  static std::string hex(unsigned op) {
    const char* digits = "0123456789abcdef";
    return {digits[op >> 4], digits[op & 15]};
  }
  static std::string printable(unsigned char op) { return op >= 32 && op < 127 ? std::string("'") + char(op) + "'" : "binary"; }

  std::string_view take(std::uint64_t n) {
    fail_unless(n <= p_.size() - pos_, "needs ", n, " bytes but the pickle ends ", p_.size() - pos_,
                " bytes later (truncated or damaged)");
    std::string_view out = p_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  std::uint64_t little(std::size_t n) {
    std::string_view b = take(n);
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < n; ++i) v |= static_cast<std::uint64_t>(static_cast<unsigned char>(b[i])) << (8 * i);
    return v;
  }
  std::string line() {
    const std::size_t end = p_.find('\n', pos_);
    fail_unless(end != std::string_view::npos, "GLOBAL without its newline");
    std::string out(p_.substr(pos_, end - pos_));
    pos_ = end + 1;
    return out;
  }

  PickleNode* node(PickleNode::Kind kind) {
    PickleNode& n = tree_.nodes.emplace_back();
    n.kind = kind;
    return &n;
  }
  PickleNode* container(PickleNode::Kind kind, std::vector<PickleNode*> items) {
    PickleNode* n = node(kind);
    n->items = std::move(items);
    return n;
  }
  PickleNode* dict(std::vector<PickleNode*> items) {
    fail_unless(items.size() % 2 == 0, "DICT with an odd number of values");
    return container(PickleNode::Kind::dict, std::move(items));
  }
  PickleNode* global(const std::string& name) {
    fail_unless(allowed_(name), "the pickle names the Python global ", name,
                ", which DCP metadata does not hold: refused (Python's pickle would import and may run it)");
    PickleNode* g = node(PickleNode::Kind::global);
    g->text = name;
    return g;
  }
  void push_int(std::int64_t v) {
    PickleNode* n = node(PickleNode::Kind::integer);
    n->integer = v;
    push(n);
  }
  void push_long(std::uint64_t length) {
    fail_unless(length <= 8, "an integer of ", length, " bytes (past 64 bits)");
    std::string_view b = take(length);
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < length; ++i) v |= static_cast<std::uint64_t>(static_cast<unsigned char>(b[i])) << (8 * i);
    if (length > 0 && length < 8 && (static_cast<unsigned char>(b[length - 1]) & 0x80)) v |= ~std::uint64_t{0} << (8 * length);
    push_int(static_cast<std::int64_t>(v));
  }
  void push_text(PickleNode::Kind kind, std::uint64_t length) {
    PickleNode* n = node(kind);
    n->text = std::string(take(length));
    push(n);
  }

  std::size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  void push(PickleNode* n) { stack_.push_back(n); }
  PickleNode* pop() {
    fail_unless(stack_.size() > floor(), "a value is taken from an empty stack");
    PickleNode* n = stack_.back();
    stack_.pop_back();
    return n;
  }
  std::vector<PickleNode*> pop_mark() {
    fail_unless(!marks_.empty(), "no MARK to take values up to");
    std::vector<PickleNode*> items(stack_.begin() + static_cast<std::ptrdiff_t>(marks_.back()), stack_.end());
    stack_.resize(marks_.back());
    marks_.pop_back();
    return items;
  }
  PickleNode* top(PickleNode::Kind kind, const char* op) {
    fail_unless(stack_.size() > floor() && stack_.back()->kind == kind, op, " on ",
                stack_.size() > floor() ? stack_.back()->describe() : std::string("an empty stack"));
    return stack_.back();
  }
  void extend(PickleNode* n, const std::vector<PickleNode*>& items) {
    n->items.insert(n->items.end(), items.begin(), items.end());
  }
  void memo(std::uint64_t index) {
    // Python's pickler numbers its memo 0, 1, 2, ...: an index past the next is not followed
    // (it would make the table as large as a damaged file says).
    fail_unless(index <= memo_.size(), "memo index ", index, " past the next one (", memo_.size(), ")");
    fail_unless(stack_.size() > floor(), "a memo entry of an empty stack");
    if (index == memo_.size()) memo_.push_back(stack_.back());
    else memo_[index] = stack_.back();
  }
  PickleNode* recall(std::uint64_t index) {
    fail_unless(index < memo_.size(), "memo entry ", index, ", which was never stored");
    return memo_[index];
  }

  std::string_view p_;
  const std::function<bool(const std::string&)>& allowed_;
  const std::string& what_;
  PickleTree& tree_;
  std::size_t pos_ = 0, at_ = 0;
  std::vector<PickleNode*> stack_, memo_;
  std::vector<std::size_t> marks_;
};

}  // namespace

PickleTree read_pickle_tree(std::string_view bytes, const std::function<bool(const std::string&)>& allowed,
                            const std::string& what) {
  PickleTree tree;
  tree.root = Reader(bytes, allowed, what, tree).run();
  return tree;
}

}  // namespace tessera::core::detail
