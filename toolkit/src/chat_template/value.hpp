#pragma once
// The values a chat template computes with, modelled on the Python objects jinja2 hands a
// template: None, bool, int, float, str, list, tuple, dict (insertion-ordered), the views and
// iterators some filters return, namespace(), callables, and Undefined. Containers are
// immutable once built (transformers renders in an ImmutableSandboxedEnvironment) and
// shared, so copying a Value is cheap; a namespace is the one mutable object.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "chat_template/errors.hpp"

namespace tessera::toolkit::jinja {

class Value;
struct Dict;
struct Sequence;
struct Iterator;
struct Namespace;
struct Callable;

/// jinja2's Undefined: a missing variable, key or attribute. It prints as "" and is falsy;
/// most other uses raise an error whose text is `hint`.
struct Undefined {
  std::shared_ptr<const std::string> hint;
};
struct None {};

/// A Python str. `markup` marks the result of |safe (markupsafe.Markup), which escapes the
/// other operand of `+`.
struct Str {
  std::shared_ptr<const std::string> text;
  bool markup = false;
};

class Value {
 public:
  using Data = std::variant<Undefined, None, bool, std::int64_t, double, Str, std::shared_ptr<const Sequence>,
                            std::shared_ptr<const Dict>, std::shared_ptr<Iterator>, std::shared_ptr<Namespace>,
                            std::shared_ptr<const Callable>>;

  Value() : data_(Undefined{}) {}
  Value(None) : data_(None{}) {}
  Value(bool b) : data_(b) {}
  Value(std::int64_t i) : data_(i) {}
  Value(int i) : data_(static_cast<std::int64_t>(i)) {}
  Value(double f) : data_(f) {}
  Value(std::string s, bool markup = false) : data_(Str{std::make_shared<const std::string>(std::move(s)), markup}) {}
  Value(const char* s) : Value(std::string(s)) {}
  Value(std::shared_ptr<const Sequence> s) : data_(std::move(s)) {}
  Value(std::shared_ptr<const Dict> d) : data_(std::move(d)) {}
  Value(std::shared_ptr<Iterator> i) : data_(std::move(i)) {}
  Value(std::shared_ptr<Namespace> n) : data_(std::move(n)) {}
  Value(std::shared_ptr<const Callable> c) : data_(std::move(c)) {}

  static Value undefined(std::string hint) { return Value(Undefined{std::make_shared<const std::string>(std::move(hint))}); }
  static Value list(std::vector<Value> items);
  static Value tuple(std::vector<Value> items);

  bool is_undefined() const { return std::holds_alternative<Undefined>(data_); }
  bool is_none() const { return std::holds_alternative<None>(data_); }
  bool is_bool() const { return std::holds_alternative<bool>(data_); }
  bool is_int() const { return std::holds_alternative<std::int64_t>(data_); }
  bool is_float() const { return std::holds_alternative<double>(data_); }
  /// int or bool (Python's bool is an int).
  bool is_integral() const { return is_int() || is_bool(); }
  bool is_number() const { return is_integral() || is_float(); }
  bool is_string() const { return std::holds_alternative<Str>(data_); }
  bool is_sequence() const { return std::holds_alternative<std::shared_ptr<const Sequence>>(data_); }
  bool is_dict() const { return std::holds_alternative<std::shared_ptr<const Dict>>(data_); }
  bool is_iterator() const { return std::holds_alternative<std::shared_ptr<Iterator>>(data_); }
  bool is_namespace() const { return std::holds_alternative<std::shared_ptr<Namespace>>(data_); }
  bool is_callable() const { return std::holds_alternative<std::shared_ptr<const Callable>>(data_); }

  bool as_bool() const { return std::get<bool>(data_); }
  /// The integer of an int or a bool.
  std::int64_t as_int() const { return is_bool() ? (as_bool() ? 1 : 0) : std::get<std::int64_t>(data_); }
  /// Any number as a double.
  double as_double() const { return is_float() ? std::get<double>(data_) : static_cast<double>(as_int()); }
  const std::string& str() const { return *std::get<Str>(data_).text; }
  bool is_markup() const { return is_string() && std::get<Str>(data_).markup; }
  const Sequence& seq() const { return *std::get<std::shared_ptr<const Sequence>>(data_); }
  const Dict& dict() const { return *std::get<std::shared_ptr<const Dict>>(data_); }
  Iterator& iter() const { return *std::get<std::shared_ptr<Iterator>>(data_); }
  Namespace& ns() const { return *std::get<std::shared_ptr<Namespace>>(data_); }
  const Callable& callable() const { return *std::get<std::shared_ptr<const Callable>>(data_); }
  const std::string& undefined_hint() const { return *std::get<Undefined>(data_).hint; }

  /// Python's type name (for messages): "str", "list", "dict", "NoneType", ...
  std::string type_name() const;

 private:
  explicit Value(Undefined u) : data_(std::move(u)) {}
  Data data_;
};

/// What a container holds, kept as it is built: how deeply it nests (bounded, so that no
/// recursive walk or destructor chain can exhaust the stack) and whether it holds a namespace
/// or a callable (refused inside a namespace: a cycle of shared pointers would never be freed).
struct Shape {
  int depth = 1;
  bool holds_reference = false;
  /// Adds `v` as a child; raises when the nesting passes kMaxDepth.
  void add(const Value& v);
};
constexpr int kMaxDepth = 500;
/// The Shape of a value (depth 0 for a scalar).
Shape shape_of(const Value& v);

/// A list, a tuple, a dict view (keys(), values(), items()) or a range: they differ in how
/// they print and whether they can be subscripted.
struct Sequence {
  enum class Kind { list, tuple, keys, values, items, range };
  Kind kind = Kind::list;
  std::vector<Value> items;
  std::int64_t range_start = 0, range_stop = 0, range_step = 1;  // for printing a range
  Shape shape;
};

/// What select/map/unique/|items/|reverse return in jinja2: a one-pass iterator. It is always
/// truthy, has no length, and is consumed by iterating it. jinja2's generator filters run only
/// as far as they are consumed: `pending` is the failure met after `items`, raised by whatever
/// reads past them (and never, if nothing does).
struct Iterator {
  std::string type;  // "generator", "dict_itemiterator", "list_reverseiterator"
  std::vector<Value> items;
  std::size_t position = 0;
  Shape shape;
  std::optional<Failure> pending;
  /// Raises the pending failure (the reader has read past the items).
  void exhausted() const {
    if (pending) throw *pending;
  }
};

/// An insertion-ordered mapping, as a Python dict. Keys are None, bool, int, float or str,
/// compared as Python compares them (1, 1.0 and True are one key).
struct Dict {
  std::vector<std::pair<Value, Value>> items;
  std::unordered_map<std::string, std::size_t> index;
  Shape shape;

  /// nullptr when absent.
  const Value* find(const Value& key) const;
  const Value* find(const std::string& key) const;
  /// Inserts or replaces (keeping the first insertion's position, as Python does).
  void set(const Value& key, Value value);
};

struct Namespace {
  Dict attributes;
};

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

/// A function a template can call: a global, a bound method, a macro, loop.cycle.
struct Callable {
  std::string name;
  std::function<Value(CallArgs&)> call;
};

/// The dict key identity of a scalar ("" when `key` cannot be a key).
std::string key_identity(const Value& key);

/// Python truthiness.
bool truthy(const Value& v);
/// Python ==. Undefined equals only Undefined.
bool equal(const Value& a, const Value& b);

/// str(v) as Python prints it (repr for containers); raises for what jinja2 cannot print here.
std::string to_str(const Value& v);
/// repr(v).
std::string repr(const Value& v);
/// repr(float) as Python writes it: the shortest round-trip digits, "1.0", "1e+16", "inf".
std::string float_repr(double f);

/// transformers' tojson: json.dumps(v, ensure_ascii=False, indent=indent, separators=..., sort_keys=...).
/// `indent` is null for none, an int (spaces) or a str.
struct JsonFormat {
  std::optional<std::string> indent;  // nullopt: one line
  std::string item_separator, key_separator;
  bool sort_keys = false;
};
std::string to_json(const Value& v, const JsonFormat& format);

/// A JSON document (ordered as written) as the Python value json.loads would give.
Value from_json(const nlohmann::ordered_json& j);

}  // namespace tessera::toolkit::jinja
