// jinja2's filters and tests (jinja2/filters.py, jinja2/tests.py), with transformers' tojson.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <set>

#include "chat_template/builtins.hpp"
#include "chat_template/errors.hpp"
#include "chat_template/params.hpp"
#include "chat_template/text.hpp"

namespace tessera::toolkit::jinja {
namespace {

using Filter = Value (*)(Env&, const Value&, CallArgs&);
using Test = bool (*)(Env&, const Value&, CallArgs&);

Value generator(std::vector<Value> items, const char* type = "generator") {
  auto it = std::make_shared<Iterator>();
  it->type = type;
  for (const auto& v : items) it->shape.add(v);
  it->items = std::move(items);
  return Value(std::move(it));
}

// A generator filter's result: what `produce` made before it failed, and the failure, raised
// only when read (a budget failure is not deferred).
Value lazily(const std::function<void(std::vector<Value>&)>& produce, const char* type = "generator") {
  std::vector<Value> out;
  std::optional<Failure> pending;
  try {
    produce(out);
  } catch (const Failure& f) {
    if (f.kind == TemplateError::Kind::budget) throw;
    pending = f;
  }
  Value v = generator(std::move(out), type);
  v.iter().pending = std::move(pending);
  return v;
}

// make_attrgetter: "a.b.0" looked up part by part as item first (environment.getitem).
Value attribute_of(Env& env, const Value& item, const Value& attribute) {
  if (attribute.is_integral()) return get_item(env, item, attribute);
  if (!attribute.is_string()) fail("TypeError: attribute must be a str or an int");
  Value v = item;
  for (const auto& part : text::split(attribute.str(), std::string("."), -1)) {
    const bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
    v = get_item(env, v, digits ? Value(static_cast<std::int64_t>(std::stoll(part))) : Value(part));
  }
  return v;
}

Value ignore_case(const Value& v) { return v.is_string() ? Value(text::lower(v.str())) : v; }

int order_of(const Value& a, const Value& b) {
  if (compare_op("<", a, b)) return -1;
  return compare_op("<", b, a) ? 1 : 0;
}

std::int64_t as_int(const Value& v, const char* what) {
  if (!v.is_integral()) fail("TypeError: ", what, " must be an integer, not ", v.type_name());
  return v.as_int();
}

// Python's float(str): surrounding whitespace, underscores between digits, inf and nan.
std::optional<double> parse_float(const std::string& s) {
  std::string t = text::strip(s, std::nullopt, true, true);
  std::string clean;
  for (std::size_t i = 0; i < t.size(); ++i) {
    if (t[i] == '_') {
      if (i == 0 || i + 1 == t.size() || !std::isdigit(static_cast<unsigned char>(t[i - 1])) ||
          !std::isdigit(static_cast<unsigned char>(t[i + 1])))
        return std::nullopt;
      continue;
    }
    clean.push_back(t[i]);
  }
  if (clean.empty() || clean.find_first_of("xXpP") != std::string::npos) return std::nullopt;
  std::string lower = text::lower(clean);
  if (!lower.empty() && (lower[0] == '+' || lower[0] == '-')) lower.erase(0, 1);
  if (lower == "inf" || lower == "infinity" || lower == "nan") {
    const double v = lower == "nan" ? NAN : INFINITY;
    return clean[0] == '-' ? -v : v;
  }
  if (lower.find_first_not_of("0123456789.e+-") != std::string::npos) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(clean.c_str(), &end);
  if (end != clean.c_str() + clean.size()) return std::nullopt;
  return v;
}

// Python's int(str, base) for base 10 (and 0/2/8/16 with their prefixes).
std::optional<std::int64_t> parse_int(const std::string& s, std::int64_t base) {
  std::string t = text::strip(s, std::nullopt, true, true);
  std::string clean;
  bool negative = false;
  std::size_t i = 0;
  if (i < t.size() && (t[i] == '+' || t[i] == '-')) negative = t[i++] == '-';
  if ((base == 16 || base == 8 || base == 2 || base == 0) && i + 1 < t.size() && t[i] == '0') {
    const char p = static_cast<char>(t[i + 1] | 0x20);
    const std::int64_t prefixed = p == 'x' ? 16 : p == 'o' ? 8 : p == 'b' ? 2 : 0;
    if (prefixed && (base == 0 || base == prefixed)) {
      base = prefixed;
      i += 2;
      if (i < t.size() && t[i] == '_') ++i;
    }
  }
  if (base == 0) base = 10;
  for (; i < t.size(); ++i) {
    if (t[i] == '_' && !clean.empty() && i + 1 < t.size() && t[i + 1] != '_') continue;
    clean.push_back(t[i]);
  }
  if (clean.empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(clean.c_str(), &end, static_cast<int>(base));
  if (end != clean.c_str() + clean.size() || clean[0] == '+' || clean[0] == '-') return std::nullopt;
  if (errno == ERANGE) unsupported("an integer beyond 64 bits");
  return negative ? -v : v;
}

std::int64_t float_to_int(double f) {
  if (std::isnan(f)) fail("ValueError: cannot convert float NaN to integer");
  if (std::isinf(f)) fail("OverflowError: cannot convert float infinity to integer");
  if (std::fabs(f) >= 9.2e18) unsupported("an integer beyond 64 bits");
  return static_cast<std::int64_t>(f);
}

// --- filters --------------------------------------------------------------------------
Value f_abs(Env&, const Value& v, CallArgs& a) {
  Params p("abs", a, {});
  if (v.is_integral()) {
    if (v.as_int() == INT64_MIN) unsupported("an integer beyond 64 bits");
    return Value(static_cast<std::int64_t>(std::llabs(v.as_int())));
  }
  if (v.is_float()) return Value(std::fabs(v.as_double()));
  fail("TypeError: bad operand type for abs(): '", v.type_name(), "'");
}

Value f_batch(Env&, const Value& v, CallArgs& a) {
  return lazily([&](std::vector<Value>& batches) {
    Params p("batch", a, {"linecount", "fill_with"});
    const std::int64_t n = as_int(p.need(0, "batch"), "linecount");
    if (n <= 0) unsupported("batch() with a count below 1");
    std::vector<Value> current;
    for (auto& item : iterate(v)) {
      current.push_back(item);
      if (static_cast<std::int64_t>(current.size()) == n) batches.push_back(Value::list(std::move(current))), current.clear();
    }
    if (!current.empty()) {
      if (p.has(1) && !p[1].is_none())
        while (static_cast<std::int64_t>(current.size()) < n) current.push_back(p[1]);
      batches.push_back(Value::list(std::move(current)));
    }
  });
}

Value f_capitalize(Env& env, const Value& v, CallArgs& a) {
  Params p("capitalize", a, {});
  return make_string(env, text::capitalize(to_str(v)));
}

Value f_default(Env&, const Value& v, CallArgs& a) {
  Params p("default", a, {"default_value", "boolean"});
  const bool boolean = truthy(p.get(1, Value(false)));
  if (v.is_undefined() || (boolean && !truthy(v))) return p.get(0, Value(std::string()));
  return v;
}

Value f_dictsort(Env&, const Value& v, CallArgs& a) {
  Params p("dictsort", a, {"case_sensitive", "by", "reverse"});
  if (!v.is_dict()) fail("TypeError: dictsort needs a mapping");
  const bool case_sensitive = truthy(p.get(0, Value(false)));
  const Value by = p.get(1, Value("key"));
  const bool reverse = truthy(p.get(2, Value(false)));
  if (!by.is_string() || (by.str() != "key" && by.str() != "value")) fail("FilterArgumentError: You can only sort by either \"key\" or \"value\"");
  std::vector<std::pair<Value, Value>> items = v.dict().items;
  const bool by_key = by.str() == "key";
  std::stable_sort(items.begin(), items.end(), [&](const auto& x, const auto& y) {
    Value kx = by_key ? x.first : x.second, ky = by_key ? y.first : y.second;
    if (!case_sensitive) kx = ignore_case(kx), ky = ignore_case(ky);
    return reverse ? order_of(ky, kx) < 0 : order_of(kx, ky) < 0;
  });
  std::vector<Value> out;
  for (auto& [k, val] : items) out.push_back(Value::tuple({k, val}));
  return Value::list(std::move(out));
}

Value f_escape(Env& env, const Value& v, CallArgs& a) {
  Params p("escape", a, {});
  if (v.is_markup()) return v;
  std::string out = text::html_escape(to_str(v));
  return make_string(env, std::move(out), true);
}

Value f_first(Env&, const Value& v, CallArgs& a) {
  Params p("first", a, {});
  if (v.is_iterator()) {
    auto& it = v.iter();
    if (it.position < it.items.size()) return it.items[it.position++];
    it.exhausted();
  } else {
    auto items = iterate(v);
    if (!items.empty()) return items.front();
  }
  return Value::undefined("No first item, sequence was empty.");
}

Value f_last(Env&, const Value& v, CallArgs& a) {
  Params p("last", a, {});
  if (v.is_iterator()) fail("TypeError: '", v.type_name(), "' object is not reversible");
  auto items = iterate(v);
  if (!items.empty()) return items.back();
  return Value::undefined("No last item, sequence was empty.");
}

Value f_float(Env&, const Value& v, CallArgs& a) {
  Params p("float", a, {"default"});
  const Value fallback = p.get(0, Value(0.0));
  if (v.is_undefined()) fail("UndefinedError: ", v.undefined_hint());  // Undefined.__float__
  if (v.is_number()) return Value(v.as_double());
  if (v.is_string()) {
    const auto f = parse_float(v.str());
    return f ? Value(*f) : fallback;
  }
  return fallback;
}

Value f_indent(Env& env, const Value& v, CallArgs& a) {
  Params p("indent", a, {"width", "first", "blank"});
  const Value width = p.get(0, Value(4));
  std::string indention;
  if (width.is_string()) {
    indention = width.str();
  } else {
    const std::int64_t w = as_int(width, "width");
    env.check_size(static_cast<std::size_t>(std::max<std::int64_t>(w, 0)));
    indention = std::string(static_cast<std::size_t>(std::max<std::int64_t>(w, 0)), ' ');
  }
  const bool first = truthy(p.get(1, Value(false))), blank = truthy(p.get(2, Value(false)));
  // do_indent starts with `s += "\n"`: only a string takes it.
  if (v.is_undefined()) fail("UndefinedError: ", v.undefined_hint());
  if (!v.is_string()) fail("TypeError: unsupported operand type(s) for +=: '", v.type_name(), "' and 'str'");
  const auto lines = text::splitlines(v.str() + "\n");
  std::string rv;
  if (blank) {
    for (std::size_t i = 0; i < lines.size(); ++i) rv += (i ? "\n" + indention : "") + lines[i];
  } else {
    rv = lines.empty() ? "" : lines[0];
    for (std::size_t i = 1; i < lines.size(); ++i) rv += "\n" + (lines[i].empty() ? "" : indention + lines[i]);
  }
  if (first) rv = indention + rv;
  return make_string(env, std::move(rv));
}

Value f_int(Env&, const Value& v, CallArgs& a) {
  Params p("int", a, {"default", "base"});
  const Value fallback = p.get(0, Value(0));
  const std::int64_t base = as_int(p.get(1, Value(10)), "base");
  if (v.is_undefined()) fail("UndefinedError: ", v.undefined_hint());  // Undefined.__int__
  if (v.is_string()) {
    if (auto i = parse_int(v.str(), base)) return Value(*i);
    if (auto f = parse_float(v.str())) {
      if (std::isnan(*f)) return fallback;
      return Value(float_to_int(*f));
    }
    return fallback;
  }
  if (v.is_integral()) return Value(v.as_int());
  if (v.is_float()) {
    if (std::isnan(v.as_double())) return fallback;
    return Value(float_to_int(v.as_double()));
  }
  return fallback;
}

Value f_items(Env&, const Value& v, CallArgs& a) {
  Params p("items", a, {});
  return lazily(
      [&](std::vector<Value>& items) {
        if (v.is_undefined()) return;
        if (!v.is_dict()) fail("TypeError: Can only get item pairs from a mapping.");
        for (const auto& [k, val] : v.dict().items) items.push_back(Value::tuple({k, val}));
      },
      "generator");
}

Value f_join(Env& env, const Value& v, CallArgs& a) {
  Params p("join", a, {"d", "attribute"});
  const std::string d = to_str(p.get(0, Value(std::string())));
  std::string out;
  bool first = true;
  for (auto& item : iterate(v)) {
    const Value x = p.has(1) && !p[1].is_none() ? attribute_of(env, item, p[1]) : item;
    out += (first ? "" : d) + to_str(x);
    first = false;
    env.check_size(out.size());
  }
  return Value(std::move(out));
}

Value f_length(Env&, const Value& v, CallArgs& a) {
  Params p("length", a, {});
  return Value(length(v));
}

Value f_list(Env&, const Value& v, CallArgs& a) {
  Params p("list", a, {});
  return Value::list(iterate(v));
}

Value f_lower(Env& env, const Value& v, CallArgs& a) {
  Params p("lower", a, {});
  return make_string(env, text::lower(to_str(v)));
}

Value f_upper(Env& env, const Value& v, CallArgs& a) {
  Params p("upper", a, {});
  return make_string(env, text::upper(to_str(v)));
}

Value f_map(Env& env, const Value& v, CallArgs& a) {
  return lazily([&](std::vector<Value>& out) {
    if (!truthy(v)) return;  // `if value:`, as do_map
    bool by_attribute = a.positional.empty();
    for (const auto& [k, _] : a.keyword) by_attribute = by_attribute || k == "attribute";
    if (by_attribute) {
      Params p("map", a, {"attribute", "default"});
      const Value& attribute = p.need(0, "map");
      for (const auto& item : iterate(v)) {
        env.count_steps(1);
        Value x = attribute_of(env, item, attribute);
        if (x.is_undefined() && p.has(1) && !p[1].is_none()) x = p[1];
        out.push_back(std::move(x));
      }
      return;
    }
    if (!a.positional[0].is_string()) fail("TypeError: map needs a filter name");
    const std::string name = a.positional[0].str();
    if (!has_filter(name)) {
      if (is_jinja_filter(name)) unsupported("the filter '", name, "'");
      fail("TemplateRuntimeError: No filter named '", name, "'.");
    }
    CallArgs rest{std::vector<Value>(a.positional.begin() + 1, a.positional.end()), a.keyword};
    for (const auto& item : iterate(v)) {
      env.count_steps(1);
      CallArgs copy = rest;
      out.push_back(apply_filter(env, name, item, copy));
    }
  });
}

Value min_max(Env& env, const Value& v, CallArgs& a, bool max) {
  Params p(max ? "max" : "min", a, {"case_sensitive", "attribute"});
  const bool case_sensitive = truthy(p.get(0, Value(false)));
  const auto items = iterate(v);
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  const auto key = [&](const Value& item) {
    Value k = p.has(1) && !p[1].is_none() ? attribute_of(env, item, p[1]) : item;
    return case_sensitive ? k : ignore_case(k);
  };
  std::size_t best = 0;
  for (std::size_t i = 1; i < items.size(); ++i) {
    const int c = order_of(key(items[i]), key(items[best]));
    if (max ? c > 0 : c < 0) best = i;
  }
  return items[best];
}
Value f_max(Env& env, const Value& v, CallArgs& a) { return min_max(env, v, a, true); }
Value f_min(Env& env, const Value& v, CallArgs& a) { return min_max(env, v, a, false); }

// select / reject / selectattr / rejectattr.
Value select(Env& env, const Value& v, CallArgs& a, bool by_attribute, bool keep, const char* callee) {
  return lazily([&](std::vector<Value>& out) {
    if (!truthy(v)) return;  // `if value:`, as select_or_reject
    std::size_t next = 0;
    Value attribute;
    if (by_attribute) {
      if (a.positional.empty()) fail("FilterArgumentError: Missing parameter for attribute name");
      attribute = a.positional[next++];
    }
    std::string test;
    if (next < a.positional.size()) {
      if (!a.positional[next].is_string()) fail("TypeError: ", callee, "() needs a test name");
      test = a.positional[next++].str();
      if (!has_test(test)) {
        if (is_jinja_test(test)) unsupported("the test '", test, "'");
        fail("TemplateRuntimeError: No test named '", test, "'.");
      }
    }
    CallArgs rest{std::vector<Value>(a.positional.begin() + static_cast<std::ptrdiff_t>(next), a.positional.end()),
                  a.keyword};
    for (const auto& item : iterate(v)) {
      env.count_steps(1);
      const Value x = by_attribute ? attribute_of(env, item, attribute) : item;
      CallArgs copy = rest;
      const bool passed = test.empty() ? truthy(x) : apply_test(env, test, x, copy);
      if (passed == keep) out.push_back(item);
    }
  });
}
Value f_select(Env& env, const Value& v, CallArgs& a) { return select(env, v, a, false, true, "select"); }
Value f_reject(Env& env, const Value& v, CallArgs& a) { return select(env, v, a, false, false, "reject"); }
Value f_selectattr(Env& env, const Value& v, CallArgs& a) { return select(env, v, a, true, true, "selectattr"); }
Value f_rejectattr(Env& env, const Value& v, CallArgs& a) { return select(env, v, a, true, false, "rejectattr"); }

Value f_replace(Env& env, const Value& v, CallArgs& a) {
  Params p("replace", a, {"old", "new", "count"});
  const Value count = p.get(2, Value(None{}));
  return make_string(env, text::replace(to_str(v), to_str(p.need(0, "replace")), to_str(p.need(1, "replace")),
                                        count.is_none() ? -1 : as_int(count, "count")));
}

Value f_reverse(Env& env, const Value& v, CallArgs& a) {
  Params p("reverse", a, {});
  if (v.is_string()) {
    auto cps = text::decode(v.str());
    std::reverse(cps.begin(), cps.end());
    return make_string(env, text::encode(cps));
  }
  auto items = iterate(v);
  std::reverse(items.begin(), items.end());
  if (v.is_iterator()) return Value::list(std::move(items));  // list(value); rv.reverse()
  return generator(std::move(items), v.is_dict() ? "dict_reversekeyiterator" : "list_reverseiterator");
}

Value f_round(Env&, const Value& v, CallArgs& a) {
  Params p("round", a, {"precision", "method"});
  const std::int64_t precision = as_int(p.get(0, Value(0)), "precision");
  const Value method = p.get(1, Value("common"));
  if (!method.is_string() || (method.str() != "common" && method.str() != "ceil" && method.str() != "floor"))
    fail("FilterArgumentError: method must be common, ceil or floor");
  if (precision < 0 || precision > 30) unsupported("round() with precision ", precision);
  if (!v.is_number()) fail("TypeError: type ", v.type_name(), " doesn't define __round__ method");
  if (method.str() == "common") {
    if (v.is_integral()) return Value(v.as_int());
    // Python rounds the exact binary value half to even, as printf does.
    char buf[512];
    std::snprintf(buf, sizeof buf, "%.*f", static_cast<int>(precision), v.as_double());
    return Value(std::strtod(buf, nullptr));
  }
  const double scale = std::pow(10.0, static_cast<double>(precision));
  const double x = v.as_double() * scale;
  return Value((method.str() == "ceil" ? std::ceil(x) : std::floor(x)) / scale);
}

Value f_safe(Env& env, const Value& v, CallArgs& a) {
  Params p("safe", a, {});
  return make_string(env, to_str(v), true);
}

Value f_sort(Env& env, const Value& v, CallArgs& a) {
  Params p("sort", a, {"reverse", "case_sensitive", "attribute"});
  const bool reverse = truthy(p.get(0, Value(false))), case_sensitive = truthy(p.get(1, Value(false)));
  auto items = iterate(v);
  env.count_steps(static_cast<std::int64_t>(items.size()));
  std::vector<std::vector<Value>> keys;
  for (const auto& item : items) {
    std::vector<Value> k;
    if (p.has(2) && !p[2].is_none() && p[2].is_string()) {
      for (const auto& part : text::split(p[2].str(), std::string(","), -1)) k.push_back(attribute_of(env, item, Value(part)));
    } else {
      k.push_back(p.has(2) && !p[2].is_none() ? attribute_of(env, item, p[2]) : item);
    }
    for (auto& x : k) x = case_sensitive ? x : ignore_case(x);
    keys.push_back(std::move(k));
  }
  std::vector<std::size_t> order(items.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) {
    for (std::size_t i = 0; i < keys[x].size(); ++i) {
      const int c = order_of(keys[x][i], keys[y][i]);
      if (c != 0) return reverse ? c > 0 : c < 0;
    }
    return false;
  });
  std::vector<Value> out;
  for (auto i : order) out.push_back(items[i]);
  return Value::list(std::move(out));
}

Value f_string(Env& env, const Value& v, CallArgs& a) {
  Params p("string", a, {});
  if (v.is_string()) return v;
  return make_string(env, to_str(v));
}

Value f_sum(Env& env, const Value& v, CallArgs& a) {
  Params p("sum", a, {"attribute", "start"});
  Value total = p.get(1, Value(0));
  for (const auto& item : iterate(v))
    total = binary_op(env, "+", total, p.has(0) && !p[0].is_none() ? attribute_of(env, item, p[0]) : item);
  return total;
}

Value f_title(Env& env, const Value& v, CallArgs& a) {
  Params p("title", a, {});
  // jinja2 splits on runs of -, whitespace and ( { [ <, and upper-cases each piece's first letter.
  const auto cps = text::decode(to_str(v));
  const auto separator = [](char32_t c) {
    return c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || text::is_space(c);
  };
  std::string out;
  for (std::size_t i = 0; i < cps.size();) {
    std::size_t j = i;
    const bool sep = separator(cps[i]);
    while (j < cps.size() && separator(cps[j]) == sep) ++j;
    const std::vector<char32_t> piece(cps.begin() + static_cast<std::ptrdiff_t>(i), cps.begin() + static_cast<std::ptrdiff_t>(j));
    if (sep) {
      out += text::encode(piece);
    } else {
      out += text::upper(text::encode({piece[0]})) + text::lower(text::encode(std::vector<char32_t>(piece.begin() + 1, piece.end())));
    }
    i = j;
  }
  return make_string(env, std::move(out));
}

std::string ascii_escaped(const std::string& json) {
  std::string out;
  char buf[16];
  for (char32_t c : text::decode(json)) {
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
    } else if (c < 0x10000) {
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
      out += buf;
    } else {
      const char32_t v = c - 0x10000;
      std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", static_cast<unsigned>(0xD800 + (v >> 10)),
                    static_cast<unsigned>(0xDC00 + (v & 0x3FF)));
      out += buf;
    }
  }
  return out;
}

Value f_tojson(Env& env, const Value& v, CallArgs& a) {
  Params p("tojson", a, {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonFormat format;
  const Value indent = p.get(1, Value(None{}));
  if (indent.is_string()) {
    format.indent = indent.str();
  } else if (indent.is_integral()) {
    format.indent = std::string(static_cast<std::size_t>(std::clamp<std::int64_t>(indent.as_int(), 0, 1 << 16)), ' ');
  } else if (!indent.is_none()) {
    fail("TypeError: indent must be None, an int or a str");
  }
  format.item_separator = format.indent ? "," : ", ";
  format.key_separator = ": ";
  const Value separators = p.get(2, Value(None{}));
  if (!separators.is_none()) {
    if (!separators.is_sequence() || separators.seq().items.size() != 2 || !separators.seq().items[0].is_string() ||
        !separators.seq().items[1].is_string())
      fail("TypeError: separators must be a pair of strings");
    format.item_separator = separators.seq().items[0].str();
    format.key_separator = separators.seq().items[1].str();
  }
  format.sort_keys = truthy(p.get(3, Value(false)));
  std::string json = to_json(v, format);
  if (truthy(p.get(0, Value(false)))) json = ascii_escaped(json);
  return make_string(env, std::move(json));
}

Value f_trim(Env& env, const Value& v, CallArgs& a) {
  Params p("trim", a, {"chars"});
  const Value chars = p.get(0, Value(None{}));
  return make_string(env, text::strip(to_str(v), chars.is_none() ? std::nullopt : std::optional<std::string>(to_str(chars)), true, true));
}

Value f_unique(Env& env, const Value& v, CallArgs& a) {
  return lazily([&](std::vector<Value>& out) {
    Params p("unique", a, {"case_sensitive", "attribute"});
    const bool case_sensitive = truthy(p.get(0, Value(false)));
    std::set<std::string> seen;
    for (const auto& item : iterate(v)) {
      Value k = p.has(1) && !p[1].is_none() ? attribute_of(env, item, p[1]) : item;
      if (!case_sensitive) k = ignore_case(k);
      const std::string id = key_identity(k);
      if (id.empty()) fail("TypeError: unhashable type: '", k.type_name(), "'");
      if (seen.insert(id).second) out.push_back(item);
    }
  });
}

Value f_wordcount(Env&, const Value& v, CallArgs& a) {
  Params p("wordcount", a, {});
  std::int64_t n = 0;
  bool in_word = false;
  for (char32_t c : text::decode(to_str(v))) {
    const bool w = c == '_' || text::is_alnum(c);
    n += w && !in_word;
    in_word = w;
  }
  return Value(n);
}

const std::map<std::string, Filter>& filters() {
  static const std::map<std::string, Filter> table = {
      {"abs", f_abs},           {"batch", f_batch},         {"capitalize", f_capitalize}, {"count", f_length},
      {"d", f_default},         {"default", f_default},     {"dictsort", f_dictsort},     {"e", f_escape},
      {"escape", f_escape},     {"first", f_first},         {"float", f_float},           {"indent", f_indent},
      {"int", f_int},           {"items", f_items},         {"join", f_join},             {"last", f_last},
      {"length", f_length},     {"list", f_list},           {"lower", f_lower},           {"map", f_map},
      {"max", f_max},           {"min", f_min},             {"reject", f_reject},         {"rejectattr", f_rejectattr},
      {"replace", f_replace},   {"reverse", f_reverse},     {"round", f_round},           {"safe", f_safe},
      {"select", f_select},     {"selectattr", f_selectattr}, {"sort", f_sort},           {"string", f_string},
      {"sum", f_sum},           {"title", f_title},         {"tojson", f_tojson},         {"trim", f_trim},
      {"unique", f_unique},     {"upper", f_upper},         {"wordcount", f_wordcount},
  };
  return table;
}

// --- tests ----------------------------------------------------------------------------
bool no_args(const char* name, CallArgs& a) {
  Params p(name, a, {});
  return true;
}
bool t_defined(Env&, const Value& v, CallArgs& a) { return no_args("defined", a) && !v.is_undefined(); }
bool t_undefined(Env&, const Value& v, CallArgs& a) { return no_args("undefined", a) && v.is_undefined(); }
bool t_none(Env&, const Value& v, CallArgs& a) { return no_args("none", a) && v.is_none(); }
bool t_boolean(Env&, const Value& v, CallArgs& a) { return no_args("boolean", a) && v.is_bool(); }
bool t_true(Env&, const Value& v, CallArgs& a) { return no_args("true", a) && v.is_bool() && v.as_bool(); }
bool t_false(Env&, const Value& v, CallArgs& a) { return no_args("false", a) && v.is_bool() && !v.as_bool(); }
bool t_integer(Env&, const Value& v, CallArgs& a) { return no_args("integer", a) && v.is_int(); }
bool t_float(Env&, const Value& v, CallArgs& a) { return no_args("float", a) && v.is_float(); }
bool t_number(Env&, const Value& v, CallArgs& a) { return no_args("number", a) && v.is_number(); }
bool t_string(Env&, const Value& v, CallArgs& a) { return no_args("string", a) && v.is_string(); }
bool t_mapping(Env&, const Value& v, CallArgs& a) { return no_args("mapping", a) && v.is_dict(); }
bool t_callable(Env&, const Value& v, CallArgs& a) {
  return no_args("callable", a) && (v.is_callable() || v.is_undefined());  // Undefined defines __call__
}
bool t_escaped(Env&, const Value& v, CallArgs& a) { return no_args("escaped", a) && v.is_markup(); }
bool t_iterable(Env&, const Value& v, CallArgs& a) {
  return no_args("iterable", a) && (v.is_string() || v.is_sequence() || v.is_dict() || v.is_iterator() || v.is_undefined());
}
bool t_sequence(Env&, const Value& v, CallArgs& a) {
  return no_args("sequence", a) &&
         (v.is_string() || v.is_dict() || v.is_undefined() ||
          (v.is_sequence() && (v.seq().kind == Sequence::Kind::list || v.seq().kind == Sequence::Kind::tuple ||
                               v.seq().kind == Sequence::Kind::range)));
}
bool t_lower(Env&, const Value& v, CallArgs& a) { return no_args("lower", a) && text::is_lower(to_str(v)); }
bool t_upper(Env&, const Value& v, CallArgs& a) { return no_args("upper", a) && text::is_upper(to_str(v)); }
bool t_even(Env& env, const Value& v, CallArgs& a) {
  no_args("even", a);
  return !truthy(binary_op(env, "%", v, Value(2)));
}
bool t_odd(Env& env, const Value& v, CallArgs& a) {
  no_args("odd", a);
  return equal(binary_op(env, "%", v, Value(2)), Value(1));
}
bool t_divisibleby(Env& env, const Value& v, CallArgs& a) {
  Params p("divisibleby", a, {"num"});
  return equal(binary_op(env, "%", v, p.need(0, "divisibleby")), Value(0));
}
bool t_sameas(Env&, const Value& v, CallArgs& a) {
  Params p("sameas", a, {"other"});
  const Value& o = p.need(0, "sameas");
  if (v.is_none() || o.is_none()) return v.is_none() && o.is_none();
  if (v.is_bool() || o.is_bool()) return v.is_bool() && o.is_bool() && v.as_bool() == o.as_bool();
  unsupported("'sameas' on ", v.type_name(), " values (Python object identity)");
}
bool t_in(Env&, const Value& v, CallArgs& a) {
  Params p("in", a, {"seq"});
  return compare_op("in", v, p.need(0, "in"));
}
template <const char* Op>
bool t_compare(Env&, const Value& v, CallArgs& a) {
  Params p(Op, a, {"other"});
  return compare_op(Op, v, p.need(0, Op));
}
constexpr char kEq[] = "==", kNe[] = "!=", kLt[] = "<", kLe[] = "<=", kGt[] = ">", kGe[] = ">=";

const std::map<std::string, Test>& tests() {
  static const std::map<std::string, Test> table = {
      {"boolean", t_boolean},   {"callable", t_callable},   {"defined", t_defined},     {"divisibleby", t_divisibleby},
      {"escaped", t_escaped},   {"even", t_even},           {"false", t_false},         {"float", t_float},
      {"in", t_in},             {"integer", t_integer},     {"iterable", t_iterable},   {"lower", t_lower},
      {"mapping", t_mapping},   {"none", t_none},           {"number", t_number},       {"odd", t_odd},
      {"sameas", t_sameas},     {"sequence", t_sequence},   {"string", t_string},       {"true", t_true},
      {"undefined", t_undefined}, {"upper", t_upper},
      {"==", t_compare<kEq>},   {"eq", t_compare<kEq>},     {"equalto", t_compare<kEq>}, {"!=", t_compare<kNe>},
      {"ne", t_compare<kNe>},   {"<", t_compare<kLt>},      {"lt", t_compare<kLt>},     {"lessthan", t_compare<kLt>},
      {"<=", t_compare<kLe>},   {"le", t_compare<kLe>},     {">", t_compare<kGt>},      {"gt", t_compare<kGt>},
      {"greaterthan", t_compare<kGt>}, {">=", t_compare<kGe>}, {"ge", t_compare<kGe>},
  };
  return table;
}

}  // namespace

bool has_filter(const std::string& name) { return filters().count(name) > 0; }
bool has_test(const std::string& name) { return tests().count(name) > 0; }

bool is_jinja_filter(const std::string& name) {
  static const std::set<std::string> jinja = {"attr", "center", "filesizeformat", "forceescape", "format", "groupby",
                                              "pprint", "random", "slice", "striptags", "truncate", "urlencode",
                                              "urlize", "wordwrap", "xmlattr"};
  return jinja.count(name) > 0;
}

bool is_jinja_test(const std::string& name) { return name == "filter" || name == "test"; }

// A name the parser let through only because it sits in an if or an inline if (jinja2 then
// fails when it is reached, not when it is compiled).
Value apply_filter(Env& env, const std::string& name, const Value& input, CallArgs& args) {
  const auto it = filters().find(name);
  if (it == filters().end()) {
    if (is_jinja_filter(name)) unsupported("the filter '", name, "'");
    fail("TemplateRuntimeError: No filter named '", name, "' found.");
  }
  return it->second(env, input, args);
}

bool apply_test(Env& env, const std::string& name, const Value& input, CallArgs& args) {
  const auto it = tests().find(name);
  if (it == tests().end()) {
    if (is_jinja_test(name)) unsupported("the test '", name, "'");
    fail("TemplateRuntimeError: No test named '", name, "' found.");
  }
  return it->second(env, input, args);
}

}  // namespace tessera::toolkit::jinja
