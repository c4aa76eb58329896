// obj.attr, obj[key] and obj[a:b:c] as jinja2's ImmutableSandboxedEnvironment resolves them,
// and the methods of str, dict and list a template may call.
#include <algorithm>
#include <set>

#include "chat_template/builtins.hpp"
#include "chat_template/errors.hpp"
#include "chat_template/params.hpp"
#include "chat_template/text.hpp"

namespace tessera::toolkit::jinja {
namespace {

// Every attribute Python's str, dict and list have: one we do not implement is refused
// rather than taken for a missing key (which would render as empty).
const std::set<std::string> kStrAttributes = {
    "capitalize", "casefold", "center", "count", "encode", "endswith", "expandtabs", "find", "format", "format_map",
    "index", "isalnum", "isalpha", "isascii", "isdecimal", "isdigit", "isidentifier", "islower", "isnumeric",
    "isprintable", "isspace", "istitle", "isupper", "join", "ljust", "lower", "lstrip", "maketrans", "partition",
    "removeprefix", "removesuffix", "replace", "rfind", "rindex", "rjust", "rpartition", "rsplit", "rstrip", "split",
    "splitlines", "startswith", "strip", "swapcase", "title", "translate", "upper", "zfill"};
const std::set<std::string> kDictAttributes = {"clear", "copy", "fromkeys", "get", "items", "keys",
                                               "pop", "popitem", "setdefault", "update", "values"};
const std::set<std::string> kListAttributes = {"append", "clear", "copy", "count", "extend", "index",
                                               "insert", "pop", "remove", "reverse", "sort"};
// What the immutable sandbox refuses to call (modify_unsafe_methods): accessing one gives an
// Undefined that raises when used.
const std::set<std::string> kUnsafe = {"clear", "pop", "popitem", "setdefault", "update", "append",
                                       "extend", "insert", "remove", "reverse", "sort"};

Value method(const std::string& name, std::function<Value(CallArgs&)> fn) {
  return Value(std::shared_ptr<const Callable>(std::make_shared<Callable>(Callable{name, std::move(fn)})));
}

std::optional<std::string> optional_string(const Value& v, const std::string& callee) {
  if (v.is_none() || v.is_undefined()) return std::nullopt;
  if (!v.is_string()) fail("TypeError: ", callee, " arg must be None or str");
  return v.str();
}

std::int64_t int_arg(const Value& v, const std::string& callee) {
  if (!v.is_integral()) fail("TypeError: ", callee, "() needs an integer, not '", v.type_name(), "'");
  return v.as_int();
}

// str.startswith / endswith: a prefix, or a tuple of them.
bool affix(const std::string& s, const Value& what, bool start, const std::string& callee) {
  std::vector<Value> options = what.is_sequence() && what.seq().kind == Sequence::Kind::tuple ? what.seq().items
                                                                                            : std::vector<Value>{what};
  for (const auto& o : options) {
    if (!o.is_string()) fail("TypeError: ", callee, " first arg must be str or a tuple of str, not ", o.type_name());
    const std::string& p = o.str();
    if (p.size() <= s.size() && (start ? s.compare(0, p.size(), p) == 0 : s.compare(s.size() - p.size(), p.size(), p) == 0))
      return true;
  }
  return false;
}

std::int64_t code_point_index(const std::string& s, std::size_t byte) {
  return static_cast<std::int64_t>(text::length(std::string_view(s).substr(0, byte)));
}

Value strings(std::vector<std::string> parts) {
  std::vector<Value> items;
  for (auto& p : parts) items.emplace_back(std::move(p));
  return Value::list(std::move(items));
}

bool all_chars(const std::string& s, bool (*test)(char32_t)) {
  const auto cps = text::decode(s);
  return !cps.empty() && std::all_of(cps.begin(), cps.end(), test);
}

// "{} {0} {name}".format(...) without format specs or conversions.
std::string format(Env& env, const std::string& fmt, CallArgs& args) {
  std::string out;
  std::size_t auto_index = 0;
  for (std::size_t i = 0; i < fmt.size(); ++i) {
    const char c = fmt[i];
    if ((c == '{' || c == '}') && i + 1 < fmt.size() && fmt[i + 1] == c) {
      out.push_back(c);
      ++i;
      continue;
    }
    if (c == '}') fail("ValueError: Single '}' encountered in format string");
    if (c != '{') {
      out.push_back(c);
      continue;
    }
    const std::size_t close = fmt.find('}', i);
    if (close == std::string::npos) fail("ValueError: Single '{' encountered in format string");
    const std::string field = fmt.substr(i + 1, close - i - 1);
    if (field.find_first_of(":!.[") != std::string::npos) unsupported("a format field with a spec, conversion or lookup ('{", field, "}')");
    const Value* value = nullptr;
    if (field.empty() || std::all_of(field.begin(), field.end(), [](char d) { return d >= '0' && d <= '9'; })) {
      const std::size_t index = field.empty() ? auto_index++ : std::stoul(field);
      if (index >= args.positional.size()) fail("IndexError: Replacement index ", index, " out of range for positional args tuple");
      value = &args.positional[index];
    } else {
      for (const auto& [k, v] : args.keyword)
        if (k == field) value = &v;
      if (!value) fail("KeyError: '", field, "'");
    }
    out += to_str(*value);
    env.check_size(out.size());
    i = close;
  }
  return out;
}

Value str_method(Env& env, const Value& self, const std::string& name) {
  const std::string s = self.str();
  const std::string callee = "str." + name;
  const auto strip_like = [&](bool left, bool right) {
    return method(callee, [s, callee, left, right, &env](CallArgs& args) {
      Params p(callee, args, {"chars"});
      return make_string(env, text::strip(s, optional_string(p.get(0, Value(None{})), callee), left, right));
    });
  };
  if (name == "strip") return strip_like(true, true);
  if (name == "lstrip") return strip_like(true, false);
  if (name == "rstrip") return strip_like(false, true);
  if (name == "split" || name == "rsplit") {
    return method(callee, [s, callee, right = name == "rsplit"](CallArgs& args) {
      Params p(callee, args, {"sep", "maxsplit"});
      return strings(text::split(s, optional_string(p.get(0, Value(None{})), callee),
                                 int_arg(p.get(1, Value(-1)), callee), right));
    });
  }
  if (name == "splitlines") {
    return method(callee, [s, callee](CallArgs& args) {
      Params p(callee, args, {"keepends"});
      return strings(text::splitlines(s, truthy(p.get(0, Value(false)))));
    });
  }
  if (name == "startswith" || name == "endswith") {
    return method(callee, [s, callee, start = name == "startswith"](CallArgs& args) {
      Params p(callee, args, {"prefix", "start", "end"});
      if (p.has(1) || p.has(2)) unsupported(callee, "() with start or end");
      return Value(affix(s, p.need(0, callee), start, callee));
    });
  }
  if (name == "replace") {
    return method(callee, [s, callee, &env](CallArgs& args) {
      Params p(callee, args, {"old", "new", "count"});
      const Value& old = p.need(0, callee);
      const Value& replacement = p.need(1, callee);
      if (!old.is_string() || !replacement.is_string()) fail("TypeError: replace() arguments must be str");
      return make_string(env, text::replace(s, old.str(), replacement.str(), int_arg(p.get(2, Value(-1)), callee)));
    });
  }
  if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
    return method(callee, [s, callee, name, &env](CallArgs& args) {
      Params p(callee, args, {});
      return make_string(env, name == "upper"   ? text::upper(s)
                              : name == "lower" ? text::lower(s)
                              : name == "title" ? text::title(s)
                                                : text::capitalize(s));
    });
  }
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count") {
    return method(callee, [s, callee, name](CallArgs& args) {
      Params p(callee, args, {"sub", "start", "end"});
      if (p.has(1) || p.has(2)) unsupported(callee, "() with start or end");
      const Value& sub = p.need(0, callee);
      if (!sub.is_string()) fail("TypeError: must be str, not ", sub.type_name());
      const std::string& needle = sub.str();
      if (name == "count") {
        if (needle.empty()) return Value(static_cast<std::int64_t>(text::length(s) + 1));
        std::int64_t n = 0;
        for (std::size_t at = s.find(needle); at != std::string::npos; at = s.find(needle, at + needle.size())) ++n;
        return Value(n);
      }
      const std::size_t at = name[0] == 'r' ? s.rfind(needle) : s.find(needle);
      if (at == std::string::npos) {
        if (name == "index" || name == "rindex") fail("ValueError: substring not found");
        return Value(-1);
      }
      return Value(code_point_index(s, at));
    });
  }
  if (name == "join") {
    return method(callee, [s, callee, &env](CallArgs& args) {
      Params p(callee, args, {"iterable"});
      std::string out;
      bool first = true;
      for (const auto& item : iterate(p.need(0, callee))) {
        if (!item.is_string()) fail("TypeError: sequence item: expected str instance, ", item.type_name(), " found");
        out += (first ? "" : s) + item.str();
        first = false;
        env.check_size(out.size());
      }
      return Value(std::move(out));
    });
  }
  if (name == "removeprefix" || name == "removesuffix") {
    return method(callee, [s, callee, prefix = name == "removeprefix"](CallArgs& args) {
      Params p(callee, args, {"affix"});
      const Value& a = p.need(0, callee);
      if (!a.is_string()) fail("TypeError: ", callee, "() argument must be str");
      if (!affix(s, a, prefix, callee)) return Value(s);
      return Value(prefix ? s.substr(a.str().size()) : s.substr(0, s.size() - a.str().size()));
    });
  }
  if (name == "isdigit" || name == "isalpha" || name == "isalnum" || name == "isspace" || name == "islower" ||
      name == "isupper") {
    return method(callee, [s, callee, name](CallArgs& args) {
      Params p(callee, args, {});
      if (name == "isdigit") return Value(all_chars(s, text::is_digit));
      if (name == "isalpha") return Value(all_chars(s, text::is_alpha));
      if (name == "isalnum") return Value(all_chars(s, text::is_alnum));
      if (name == "isspace") return Value(all_chars(s, text::is_space));
      return Value(name == "islower" ? text::is_lower(s) : text::is_upper(s));
    });
  }
  if (name == "format") {
    return method(callee, [s, &env](CallArgs& args) { return Value(format(env, s, args)); });
  }
  unsupported("the str method '", name, "'");
}

Value dict_method(const Value& self, const std::string& name) {
  const std::string callee = "dict." + name;
  if (name == "keys" || name == "values" || name == "items") {
    return method(callee, [self, callee, name](CallArgs& args) {
      Params p(callee, args, {});
      auto view = std::make_shared<Sequence>();
      view->kind = name == "keys" ? Sequence::Kind::keys : name == "values" ? Sequence::Kind::values : Sequence::Kind::items;
      for (const auto& [k, v] : self.dict().items) {
        Value item = name == "keys" ? k : name == "values" ? v : Value::tuple({k, v});
        view->shape.add(item);
        view->items.push_back(std::move(item));
      }
      return Value(std::shared_ptr<const Sequence>(std::move(view)));
    });
  }
  if (name == "get") {
    return method(callee, [self, callee](CallArgs& args) {
      Params p(callee, args, {"key", "default"});
      const Value& key = p.need(0, callee);
      if (key_identity(key).empty()) fail("TypeError: unhashable type: '", key.type_name(), "'");
      const Value* v = self.dict().find(key);
      return v ? *v : p.get(1, Value(None{}));
    });
  }
  if (name == "copy") return method(callee, [self](CallArgs&) { return self; });
  unsupported("the dict method '", name, "'");
}

Value list_method(const Value& self, const std::string& name) {
  const std::string callee = self.type_name() + "." + name;
  if (name == "index" || name == "count") {
    return method(callee, [self, callee, name](CallArgs& args) {
      Params p(callee, args, {"value"});
      const Value& x = p.need(0, callee);
      std::int64_t n = 0;
      for (std::size_t i = 0; i < self.seq().items.size(); ++i) {
        if (!equal(self.seq().items[i], x)) continue;
        if (name == "index") return Value(static_cast<std::int64_t>(i));
        ++n;
      }
      if (name == "index") fail("ValueError: ", repr(x), " is not in list");
      return Value(n);
    });
  }
  if (name == "copy") return method(callee, [self](CallArgs&) { return Value::list(self.seq().items); });
  unsupported("the list method '", name, "'");
}

Value missing_attribute(const Value& obj, const std::string& name) {
  return Value::undefined("'" + obj.type_name() + " object' has no attribute '" + name + "'");
}

Value unsafe(const Value& obj, const std::string& name) {
  return Value::undefined("access to attribute '" + name + "' of '" + obj.type_name() + "' object is unsafe.");
}

// Python-style index adjustment of one slice bound (PySlice_AdjustIndices).
std::int64_t bound(const Value& v, std::int64_t n, std::int64_t step, bool is_start) {
  if (v.is_none()) return is_start ? (step < 0 ? n - 1 : 0) : (step < 0 ? -1 : n);
  std::int64_t i = v.as_int();
  if (i < 0) {
    i += n;
    if (i < 0) i = step < 0 ? -1 : 0;
  } else if (i >= n) {
    i = step < 0 ? n - 1 : n;
  }
  return i;
}

}  // namespace

Value get_attribute(Env& env, const Value& obj, const std::string& name) {
  if (obj.is_undefined()) fail("UndefinedError: ", obj.undefined_hint());
  if (!name.empty() && name[0] == '_') return unsafe(obj, name);
  if (obj.is_string()) {
    if (kStrAttributes.count(name)) return str_method(env, obj, name);
    return missing_attribute(obj, name);
  }
  if (obj.is_dict()) {
    if (kDictAttributes.count(name)) return kUnsafe.count(name) ? unsafe(obj, name) : dict_method(obj, name);
    if (const Value* v = obj.dict().find(name)) return *v;
    return missing_attribute(obj, name);
  }
  if (obj.is_sequence() && (obj.seq().kind == Sequence::Kind::list || obj.seq().kind == Sequence::Kind::tuple)) {
    const bool tuple = obj.seq().kind == Sequence::Kind::tuple;
    if (tuple ? (name == "index" || name == "count") : kListAttributes.count(name) > 0)
      return kUnsafe.count(name) ? unsafe(obj, name) : list_method(obj, name);
    return missing_attribute(obj, name);
  }
  if (obj.is_namespace()) {
    if (const Value* v = obj.ns().attributes.find(name)) return *v;
    return missing_attribute(obj, name);
  }
  if (obj.is_number() || obj.is_none()) {
    static const std::set<std::string> numeric = {"real", "imag", "numerator", "denominator", "conjugate",
                                                  "bit_length", "bit_count", "is_integer", "hex", "as_integer_ratio",
                                                  "to_bytes", "from_bytes", "fromhex"};
    if (!obj.is_none() && numeric.count(name)) unsupported("the attribute '", name, "' of ", obj.type_name());
    return missing_attribute(obj, name);
  }
  if (obj.is_sequence() && obj.seq().kind == Sequence::Kind::range &&
      (name == "start" || name == "stop" || name == "step" || name == "index" || name == "count"))
    unsupported("the attribute '", name, "' of range");
  return missing_attribute(obj, name);
}

Value get_item(Env& env, const Value& obj, const Value& key) {
  if (obj.is_undefined()) fail("UndefinedError: ", obj.undefined_hint());
  const auto fallback = [&]() -> Value {
    if (key.is_string()) return get_attribute(env, obj, key.str());
    return Value::undefined(obj.type_name() + " object has no element " + repr(key));
  };
  if (obj.is_dict()) {
    if (!key_identity(key).empty())
      if (const Value* v = obj.dict().find(key)) return *v;
    return fallback();
  }
  const bool indexable = obj.is_string() || (obj.is_sequence() && (obj.seq().kind == Sequence::Kind::list ||
                                                                    obj.seq().kind == Sequence::Kind::tuple ||
                                                                    obj.seq().kind == Sequence::Kind::range));
  if (indexable && key.is_integral()) {
    if (obj.is_string()) {
      const auto cps = text::decode(obj.str());
      std::int64_t i = key.as_int();
      const auto n = static_cast<std::int64_t>(cps.size());
      if (i < 0) i += n;
      if (i < 0 || i >= n) return fallback();
      std::string c;
      text::append_utf8(c, cps[static_cast<std::size_t>(i)]);
      return Value(std::move(c));
    }
    const auto& items = obj.seq().items;
    std::int64_t i = key.as_int();
    const auto n = static_cast<std::int64_t>(items.size());
    if (i < 0) i += n;
    if (i < 0 || i >= n) return fallback();
    return items[static_cast<std::size_t>(i)];
  }
  return fallback();
}

Value get_slice(Env& env, const Value& obj, const Value& start, const Value& stop, const Value& step, bool folded) {
  if (obj.is_undefined()) fail("UndefinedError: ", obj.undefined_hint());
  const bool sliceable = obj.is_string() || (obj.is_sequence() && (obj.seq().kind == Sequence::Kind::list ||
                                                                    obj.seq().kind == Sequence::Kind::tuple ||
                                                                    obj.seq().kind == Sequence::Kind::range));
  // jinja2 compiles a slice to a plain Python subscript: what Python refuses raises.
  const bool index_like = [&] {
    for (const Value* b : {&start, &stop, &step})
      if (!b->is_none() && !b->is_integral()) return false;
    return true;
  }();
  if (folded && (!sliceable || !index_like)) return Value::undefined(obj.type_name() + " object has no element slice");
  if (!sliceable) fail("TypeError: '", obj.type_name(), "' object is not subscriptable by a slice");
  for (const Value* bound : {&start, &stop, &step}) {
    if (bound->is_undefined()) fail("UndefinedError: ", bound->undefined_hint());
    if (!bound->is_none() && !bound->is_integral())
      fail("TypeError: slice indices must be integers or None or have an __index__ method");
  }
  const std::int64_t k = step.is_none() ? 1 : step.as_int();
  if (k == 0) fail("ValueError: slice step cannot be zero");
  const std::vector<char32_t> cps = obj.is_string() ? text::decode(obj.str()) : std::vector<char32_t>{};
  const auto n = static_cast<std::int64_t>(obj.is_string() ? cps.size() : obj.seq().items.size());
  const std::int64_t a = bound(start, n, k, true), b = bound(stop, n, k, false);
  std::vector<std::int64_t> picked;
  for (std::int64_t i = a; k > 0 ? i < b : i > b; i += k) picked.push_back(i);
  env.count_steps(static_cast<std::int64_t>(picked.size()));
  if (obj.is_string()) {
    std::string out;
    for (auto i : picked) text::append_utf8(out, cps[static_cast<std::size_t>(i)]);
    return Value(std::move(out));
  }
  auto out = std::make_shared<Sequence>();
  out->kind = obj.seq().kind;
  for (auto i : picked) {
    out->shape.add(obj.seq().items[static_cast<std::size_t>(i)]);
    out->items.push_back(obj.seq().items[static_cast<std::size_t>(i)]);
  }
  if (out->kind == Sequence::Kind::range) {
    const auto& r = obj.seq();
    out->range_start = r.range_start + a * r.range_step;
    out->range_stop = r.range_start + b * r.range_step;
    out->range_step = r.range_step * k;
  }
  return Value(std::shared_ptr<const Sequence>(std::move(out)));
}

}  // namespace tessera::toolkit::jinja
