// Python's operators on template values, as jinja2 evaluates them (it compiles to Python).
#include <cmath>
#include <limits>

#include "chat_template/builtins.hpp"
#include "chat_template/errors.hpp"
#include "chat_template/text.hpp"

namespace tessera::toolkit::jinja {
namespace {

[[noreturn]] void type_error(const std::string& op, const Value& a, const Value& b) {
  if (a.is_undefined()) fail("UndefinedError: ", a.undefined_hint());
  if (b.is_undefined()) fail("UndefinedError: ", b.undefined_hint());
  fail("TypeError: unsupported operand type(s) for ", op, ": '", a.type_name(), "' and '", b.type_name(), "'");
}

void check_overflow(bool overflow) {
  if (overflow) unsupported("an integer beyond 64 bits");
}

// CPython's float floor division and modulo (float_divmod).
std::pair<double, double> float_divmod(double x, double y) {
  if (y == 0) fail("ZeroDivisionError: float division by zero");
  double mod = std::fmod(x, y);
  double div = (x - mod) / y;
  if (mod != 0) {
    if ((y < 0) != (mod < 0)) {
      mod += y;
      div -= 1.0;
    }
  } else {
    mod = std::copysign(0.0, y);
  }
  double floordiv;
  if (div != 0) {
    floordiv = std::floor(div);
    if (div - floordiv > 0.5) floordiv += 1.0;
  } else {
    floordiv = std::copysign(0.0, x / y);
  }
  return {floordiv, mod};
}

Value repeat(Env& env, const Value& seq, std::int64_t n) {
  if (n <= 0) {
    if (seq.is_string()) return Value(std::string());
    return seq.seq().kind == Sequence::Kind::tuple ? Value::tuple({}) : Value::list({});
  }
  if (seq.is_string()) {
    env.check_size(seq.str().size() * static_cast<std::size_t>(std::min<std::int64_t>(n, INT32_MAX)));
    std::string out;
    for (std::int64_t i = 0; i < n; ++i) out += seq.str();
    return Value(std::move(out));
  }
  env.check_size(seq.seq().items.size() * 16 * static_cast<std::size_t>(std::min<std::int64_t>(n, INT32_MAX)));
  std::vector<Value> items;
  for (std::int64_t i = 0; i < n; ++i) items.insert(items.end(), seq.seq().items.begin(), seq.seq().items.end());
  return seq.seq().kind == Sequence::Kind::tuple ? Value::tuple(std::move(items)) : Value::list(std::move(items));
}

bool plain_sequence(const Value& v) {
  return v.is_sequence() && (v.seq().kind == Sequence::Kind::list || v.seq().kind == Sequence::Kind::tuple);
}

// -1, 0, 1 for a < b, a == b, a > b; raises where Python's < would.
int order(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (!a.is_float() && !b.is_float()) return a.as_int() < b.as_int() ? -1 : a.as_int() > b.as_int() ? 1 : 0;
    const double x = a.as_double(), y = b.as_double();
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) return a.str() < b.str() ? -1 : a.str() > b.str() ? 1 : 0;
  if (plain_sequence(a) && plain_sequence(b) && a.seq().kind == b.seq().kind) {
    const auto& x = a.seq().items;
    const auto& y = b.seq().items;
    for (std::size_t i = 0; i < x.size() && i < y.size(); ++i)
      if (!equal(x[i], y[i])) return order(x[i], y[i]);
    return x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0;
  }
  if (a.is_undefined()) fail("UndefinedError: ", a.undefined_hint());
  if (b.is_undefined()) fail("UndefinedError: ", b.undefined_hint());
  fail("TypeError: '<' not supported between instances of '", a.type_name(), "' and '", b.type_name(), "'");
}

bool contains(const Value& item, const Value& container) {
  if (container.is_string()) {
    if (!item.is_string()) fail("TypeError: 'in <string>' requires string as left operand, not ", item.type_name());
    return container.str().find(item.str()) != std::string::npos;
  }
  if (container.is_dict()) {
    if (key_identity(item).empty()) fail("TypeError: unhashable type: '", item.type_name(), "'");
    return container.dict().find(item) != nullptr;
  }
  if (container.is_sequence()) {
    for (const auto& v : container.seq().items)
      if (equal(v, item)) return true;
    return false;
  }
  if (container.is_iterator()) {
    auto& it = container.iter();
    while (it.position < it.items.size())
      if (equal(it.items[it.position++], item)) return true;
    it.exhausted();
    return false;
  }
  if (container.is_undefined()) return false;
  fail("TypeError: argument of type '", container.type_name(), "' is not iterable");
}

}  // namespace

Value make_string(Env& env, std::string s, bool markup) {
  env.check_size(s.size());
  return Value(std::move(s), markup);
}

Value binary_op(Env& env, const std::string& op, const Value& a, const Value& b) {
  const bool ints = a.is_integral() && b.is_integral();
  const bool numbers = a.is_number() && b.is_number();
  std::int64_t r = 0;
  if (op == "+") {
    if (ints) return check_overflow(__builtin_add_overflow(a.as_int(), b.as_int(), &r)), Value(r);
    if (numbers) return Value(a.as_double() + b.as_double());
    if (a.is_string() && b.is_string()) {
      // markupsafe: Markup + str escapes the str (|safe makes a Markup).
      const bool markup = a.is_markup() || b.is_markup();
      std::string left = a.is_markup() || !markup ? a.str() : text::html_escape(a.str());
      const std::string right = b.is_markup() || !markup ? b.str() : text::html_escape(b.str());
      env.check_size(left.size() + right.size());
      return Value(left + right, markup);
    }
    if (plain_sequence(a) && plain_sequence(b) && a.seq().kind == b.seq().kind) {
      env.check_size((a.seq().items.size() + b.seq().items.size()) * 16);
      std::vector<Value> items = a.seq().items;
      items.insert(items.end(), b.seq().items.begin(), b.seq().items.end());
      return a.seq().kind == Sequence::Kind::tuple ? Value::tuple(std::move(items)) : Value::list(std::move(items));
    }
    type_error(op, a, b);
  }
  if (op == "-") {
    if (a.is_sequence() && a.seq().kind != Sequence::Kind::list && a.seq().kind != Sequence::Kind::tuple &&
        a.seq().kind != Sequence::Kind::range)
      unsupported("set operations on dict views");
    if (ints) return check_overflow(__builtin_sub_overflow(a.as_int(), b.as_int(), &r)), Value(r);
    if (numbers) return Value(a.as_double() - b.as_double());
    type_error(op, a, b);
  }
  if (op == "*") {
    if (ints) return check_overflow(__builtin_mul_overflow(a.as_int(), b.as_int(), &r)), Value(r);
    if (numbers) return Value(a.as_double() * b.as_double());
    if ((a.is_string() || plain_sequence(a)) && b.is_integral()) return repeat(env, a, b.as_int());
    if ((b.is_string() || plain_sequence(b)) && a.is_integral()) return repeat(env, b, a.as_int());
    type_error(op, a, b);
  }
  if (op == "/") {
    if (!numbers) type_error(op, a, b);
    if (b.as_double() == 0) fail("ZeroDivisionError: division by zero");
    return Value(a.as_double() / b.as_double());
  }
  if (op == "//" || op == "%") {
    if (a.is_string() && op == "%") unsupported("string formatting with '%'");
    if (!numbers) type_error(op, a, b);
    if (ints) {
      const std::int64_t x = a.as_int(), y = b.as_int();
      if (y == 0) fail("ZeroDivisionError: integer division or modulo by zero");
      if (x == INT64_MIN && y == -1) unsupported("an integer beyond 64 bits");
      std::int64_t q = x / y, m = x % y;
      if (m != 0 && ((m < 0) != (y < 0))) {
        m += y;
        q -= 1;
      }
      return Value(op == "//" ? q : m);
    }
    const auto [q, m] = float_divmod(a.as_double(), b.as_double());
    return Value(op == "//" ? q : m);
  }
  if (op == "**") {
    if (ints && b.as_int() >= 0) {
      std::int64_t base = a.as_int(), result = 1;
      for (std::int64_t e = b.as_int(); e > 0; e >>= 1) {
        if (e & 1) check_overflow(__builtin_mul_overflow(result, base, &result));
        if (e > 1) check_overflow(__builtin_mul_overflow(base, base, &base));
      }
      return Value(result);
    }
    if (!numbers) type_error(op, a, b);
    if (a.as_double() == 0 && b.as_double() < 0) fail("ZeroDivisionError: 0.0 cannot be raised to a negative power");
    const double p = std::pow(a.as_double(), b.as_double());
    if (std::isnan(p) && !std::isnan(a.as_double()) && !std::isnan(b.as_double()))
      unsupported("a complex result of '**'");
    if (std::isinf(p) && std::isfinite(a.as_double()) && std::isfinite(b.as_double()))
      fail("OverflowError: (34, 'Numerical result out of range')");
    return Value(p);
  }
  fail("internal: unknown operator ", op);
}

bool compare_op(const std::string& op, const Value& a, const Value& b) {
  if (op == "==" || op == "eq" || op == "equalto") return equal(a, b);
  if (op == "!=" || op == "ne") return !equal(a, b);
  if (op == "in") return contains(a, b);
  if (op == "notin") return !contains(a, b);
  const int c = order(a, b);
  if (op == "<" || op == "lt" || op == "lessthan") return c < 0;
  if (op == "<=" || op == "le") return c <= 0;
  if (op == ">" || op == "gt" || op == "greaterthan") return c > 0;
  if (op == ">=" || op == "ge") return c >= 0;
  fail("internal: unknown comparison ", op);
}

std::vector<Value> iterate(const Value& v) {
  if (v.is_sequence()) return v.seq().items;
  if (v.is_dict()) {
    std::vector<Value> keys;
    for (const auto& [k, _] : v.dict().items) keys.push_back(k);
    return keys;
  }
  if (v.is_string()) {
    std::vector<Value> chars;
    for (char32_t c : text::decode(v.str())) {
      std::string s;
      text::append_utf8(s, c);
      chars.emplace_back(std::move(s));
    }
    return chars;
  }
  if (v.is_iterator()) {
    auto& it = v.iter();
    std::vector<Value> rest(it.items.begin() + static_cast<std::ptrdiff_t>(it.position), it.items.end());
    it.position = it.items.size();
    it.exhausted();
    return rest;
  }
  if (v.is_undefined()) return {};
  fail("TypeError: '", v.type_name(), "' object is not iterable");
}

std::int64_t length(const Value& v) {
  if (v.is_string()) return static_cast<std::int64_t>(text::length(v.str()));
  if (v.is_sequence()) return static_cast<std::int64_t>(v.seq().items.size());
  if (v.is_dict()) return static_cast<std::int64_t>(v.dict().items.size());
  if (v.is_undefined()) return 0;
  fail("TypeError: object of type '", v.type_name(), "' has no len()");
}

}  // namespace tessera::toolkit::jinja
