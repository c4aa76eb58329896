#include "chat_template/value.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "chat_template/errors.hpp"
#include "chat_template/text.hpp"

namespace tessera::toolkit::jinja {
namespace {

std::shared_ptr<const Sequence> make_sequence(Sequence::Kind kind, std::vector<Value> items) {
  auto s = std::make_shared<Sequence>();
  s->kind = kind;
  for (const auto& item : items) s->shape.add(item);
  s->items = std::move(items);
  return s;
}

std::string string_repr(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos, has_double = s.find('"') != std::string::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  char buf[16];
  for (char32_t c : text::decode(s)) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c < 0x20 || c == 0x7F) {
      std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned>(c));
      out += buf;
    } else if (c < 0x7F || text::is_printable(c)) {
      text::append_utf8(out, c);
    } else {
      std::snprintf(buf, sizeof buf, c <= 0xFF ? "\\x%02x" : c <= 0xFFFF ? "\\u%04x" : "\\U%08x", static_cast<unsigned>(c));
      out += buf;
    }
  }
  out.push_back(quote);
  return out;
}

std::string join_repr(const std::vector<Value>& items) {
  std::string out;
  for (std::size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + repr(items[i]);
  return out;
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  char buf[8];
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
          out += buf;
        } else {
          out.push_back(c);
        }
    }
  }
  return out + "\"";
}

std::string json_float(double f) {
  if (std::isnan(f)) return "NaN";
  if (std::isinf(f)) return f > 0 ? "Infinity" : "-Infinity";
  return float_repr(f);
}

[[noreturn]] void not_serializable(const Value& v) {
  fail("TypeError: Object of type ", v.type_name(), " is not JSON serializable");
}

std::string json_key(const Value& k) {
  if (k.is_string()) return k.str();
  if (k.is_bool()) return k.as_bool() ? "true" : "false";
  if (k.is_int()) return std::to_string(k.as_int());
  if (k.is_float()) return json_float(k.as_double());
  if (k.is_none()) return "null";
  fail("TypeError: keys must be str, int, float, bool or None, not ", k.type_name());
}

void write_json(std::string& out, const Value& v, const JsonFormat& f, int level) {
  if (v.is_none()) {
    out += "null";
  } else if (v.is_bool()) {
    out += v.as_bool() ? "true" : "false";
  } else if (v.is_int()) {
    out += std::to_string(v.as_int());
  } else if (v.is_float()) {
    out += json_float(v.as_double());
  } else if (v.is_string()) {
    out += json_string(v.str());
  } else if (v.is_sequence() || v.is_dict()) {
    const bool is_dict = v.is_dict();
    if (v.is_sequence() && v.seq().kind != Sequence::Kind::list && v.seq().kind != Sequence::Kind::tuple)
      not_serializable(v);
    const std::size_t n = is_dict ? v.dict().items.size() : v.seq().items.size();
    if (n == 0) {
      out += is_dict ? "{}" : "[]";
      return;
    }
    std::vector<std::size_t> order(n);
    for (std::size_t i = 0; i < n; ++i) order[i] = i;
    std::vector<std::string> keys;
    if (is_dict) {
      for (const auto& [k, _] : v.dict().items) keys.push_back(json_key(k));
      if (f.sort_keys) {
        for (const auto& [k, _] : v.dict().items)
          if (!k.is_string()) fail("TypeError: '<' not supported between a str key and a ", k.type_name(), " key");
        std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return keys[a] < keys[b]; });
      }
    }
    out += is_dict ? '{' : '[';
    std::string separator = f.item_separator;
    if (f.indent) {
      std::string newline_indent = "\n";
      for (int i = 0; i <= level; ++i) newline_indent += *f.indent;
      separator += newline_indent;
      out += newline_indent;
    }
    for (std::size_t i = 0; i < n; ++i) {
      if (i) out += separator;
      if (is_dict) {
        out += json_string(keys[order[i]]) + f.key_separator;
        write_json(out, v.dict().items[order[i]].second, f, level + 1);
      } else {
        write_json(out, v.seq().items[i], f, level + 1);
      }
    }
    if (f.indent) {
      out += '\n';
      for (int i = 0; i < level; ++i) out += *f.indent;
    }
    out += is_dict ? '}' : ']';
  } else {
    not_serializable(v);
  }
}

}  // namespace

Value Value::list(std::vector<Value> items) { return Value(make_sequence(Sequence::Kind::list, std::move(items))); }
Value Value::tuple(std::vector<Value> items) { return Value(make_sequence(Sequence::Kind::tuple, std::move(items))); }

std::string Value::type_name() const {
  if (is_undefined()) return "Undefined";
  if (is_none()) return "NoneType";
  if (is_bool()) return "bool";
  if (is_int()) return "int";
  if (is_float()) return "float";
  if (is_string()) return is_markup() ? "Markup" : "str";
  if (is_dict()) return "dict";
  if (is_iterator()) return iter().type;
  if (is_namespace()) return "Namespace";
  if (is_callable()) return "function";
  switch (seq().kind) {
    case Sequence::Kind::list: return "list";
    case Sequence::Kind::tuple: return "tuple";
    case Sequence::Kind::keys: return "dict_keys";
    case Sequence::Kind::values: return "dict_values";
    case Sequence::Kind::items: return "dict_items";
    case Sequence::Kind::range: return "range";
  }
  return "object";
}

Shape shape_of(const Value& v) {
  if (v.is_sequence()) return v.seq().shape;
  if (v.is_dict()) return v.dict().shape;
  if (v.is_iterator()) return v.iter().shape;
  Shape s;
  s.depth = 0;
  s.holds_reference = v.is_namespace() || v.is_callable();
  return s;
}

void Shape::add(const Value& v) {
  const Shape child = shape_of(v);
  depth = std::max(depth, child.depth + 1);
  holds_reference = holds_reference || child.holds_reference;
  if (depth > kMaxDepth) fail("values nested more than ", kMaxDepth, " deep");
}

std::string key_identity(const Value& key) {
  if (key.is_string()) return "s" + key.str();
  if (key.is_integral()) return "i" + std::to_string(key.as_int());
  if (key.is_float()) {
    const double f = key.as_double();
    if (std::isfinite(f) && f == std::floor(f) && std::fabs(f) < 9.2e18)
      return "i" + std::to_string(static_cast<std::int64_t>(f));
    return "f" + float_repr(f);
  }
  if (key.is_none()) return "n";
  if (key.is_undefined()) return "u";  // Undefined hashes (by its type)
  if (key.is_sequence() && key.seq().kind == Sequence::Kind::tuple) {
    std::string id = "t(";
    for (const auto& item : key.seq().items) {
      const std::string part = key_identity(item);
      if (part.empty()) return {};
      id += std::to_string(part.size()) + ":" + part;
    }
    return id + ")";
  }
  return {};
}

const Value* Dict::find(const Value& key) const {
  const auto it = index.find(key_identity(key));
  return it == index.end() ? nullptr : &items[it->second].second;
}

const Value* Dict::find(const std::string& key) const {
  const auto it = index.find("s" + key);
  return it == index.end() ? nullptr : &items[it->second].second;
}

void Dict::set(const Value& key, Value value) {
  std::string id = key_identity(key);
  if (id.empty()) fail("TypeError: unhashable type: '", key.type_name(), "'");
  shape.add(value);
  const auto [it, inserted] = index.emplace(std::move(id), items.size());
  if (inserted) {
    items.emplace_back(key, std::move(value));
  } else {
    items[it->second].second = std::move(value);
  }
}

bool truthy(const Value& v) {
  if (v.is_undefined() || v.is_none()) return false;
  if (v.is_bool()) return v.as_bool();
  if (v.is_int()) return v.as_int() != 0;
  if (v.is_float()) return v.as_double() != 0.0;
  if (v.is_string()) return !v.str().empty();
  if (v.is_sequence()) return !v.seq().items.empty();
  if (v.is_dict()) return !v.dict().items.empty();
  return true;  // iterators, namespaces, callables
}

bool equal(const Value& a, const Value& b) {
  if (a.is_undefined() || b.is_undefined()) return a.is_undefined() && b.is_undefined();
  if (a.is_none() || b.is_none()) return a.is_none() && b.is_none();
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.is_string() && b.is_string()) return a.str() == b.str();
  if (a.is_sequence() && b.is_sequence()) {
    const auto& x = a.seq();
    const auto& y = b.seq();
    // A list never equals a tuple; views and ranges compare as their own types.
    if (x.kind != y.kind || x.items.size() != y.items.size()) return false;
    if (x.kind == Sequence::Kind::values) return &x == &y;
    for (std::size_t i = 0; i < x.items.size(); ++i)
      if (!equal(x.items[i], y.items[i])) return false;
    return true;
  }
  if (a.is_dict() && b.is_dict()) {
    const auto& x = a.dict();
    const auto& y = b.dict();
    if (x.items.size() != y.items.size()) return false;
    for (const auto& [k, v] : x.items) {
      const Value* other = y.find(k);
      if (!other || !equal(v, *other)) return false;
    }
    return true;
  }
  if (a.is_namespace() && b.is_namespace()) return &a.ns() == &b.ns();
  if (a.is_iterator() && b.is_iterator()) return &a.iter() == &b.iter();
  if (a.is_callable() && b.is_callable()) return &a.callable() == &b.callable();
  return false;
}

std::string float_repr(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f > 0 ? "inf" : "-inf";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, f, std::chars_format::scientific);
  std::string sci(buf, r.ptr);
  std::string sign;
  if (sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  const std::size_t e = sci.find('e');
  std::string digits = sci.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exponent = std::stoi(sci.substr(e + 1));
  const int decpt = exponent + 1;  // digits before the decimal point
  const int n = static_cast<int>(digits.size());
  std::string out;
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out = "0." + std::string(static_cast<std::size_t>(-decpt), '0') + digits;
    } else if (decpt >= n) {
      out = digits + std::string(static_cast<std::size_t>(decpt - n), '0') + ".0";
    } else {
      out = digits.substr(0, static_cast<std::size_t>(decpt)) + "." + digits.substr(static_cast<std::size_t>(decpt));
    }
  } else {
    out = digits.substr(0, 1);
    if (n > 1) out += "." + digits.substr(1);
    const int x = decpt - 1;
    std::snprintf(buf, sizeof buf, "e%c%02d", x < 0 ? '-' : '+', std::abs(x));
    out += buf;
  }
  return sign + out;
}

std::string repr(const Value& v) {
  if (v.is_string()) return v.is_markup() ? "Markup(" + string_repr(v.str()) + ")" : string_repr(v.str());
  if (v.is_undefined()) return "Undefined";
  if (v.is_none()) return "None";
  if (v.is_bool()) return v.as_bool() ? "True" : "False";
  if (v.is_int()) return std::to_string(v.as_int());
  if (v.is_float()) return float_repr(v.as_double());
  if (v.is_dict()) {
    std::string out = "{";
    bool first = true;
    for (const auto& [k, val] : v.dict().items) {
      out += (first ? "" : ", ") + repr(k) + ": " + repr(val);
      first = false;
    }
    return out + "}";
  }
  if (v.is_namespace()) {
    Value attrs(std::make_shared<const Dict>(v.ns().attributes));
    return "<Namespace " + repr(attrs) + ">";
  }
  if (v.is_sequence()) {
    const auto& s = v.seq();
    switch (s.kind) {
      case Sequence::Kind::list: return "[" + join_repr(s.items) + "]";
      case Sequence::Kind::tuple: return "(" + join_repr(s.items) + (s.items.size() == 1 ? ",)" : ")");
      case Sequence::Kind::keys: return "dict_keys([" + join_repr(s.items) + "])";
      case Sequence::Kind::values: return "dict_values([" + join_repr(s.items) + "])";
      case Sequence::Kind::items: return "dict_items([" + join_repr(s.items) + "])";
      case Sequence::Kind::range:
        return "range(" + std::to_string(s.range_start) + ", " + std::to_string(s.range_stop) +
               (s.range_step != 1 ? ", " + std::to_string(s.range_step) : "") + ")";
    }
  }
  // Python prints these with a memory address.
  unsupported("printing a ", v.type_name());
}

std::string to_str(const Value& v) {
  if (v.is_string()) return v.str();
  if (v.is_undefined()) return "";
  return repr(v);
}

std::string to_json(const Value& v, const JsonFormat& format) {
  std::string out;
  write_json(out, v, format, 0);
  return out;
}

Value from_json(const nlohmann::ordered_json& j) {
  struct Walk {
    static Value convert(const nlohmann::ordered_json& j, int depth) {
      if (depth > kMaxDepth) fail("JSON nested more than ", kMaxDepth, " deep");
      switch (j.type()) {
        case nlohmann::ordered_json::value_t::null: return Value(None{});
        case nlohmann::ordered_json::value_t::boolean: return Value(j.get<bool>());
        case nlohmann::ordered_json::value_t::number_integer: return Value(j.get<std::int64_t>());
        case nlohmann::ordered_json::value_t::number_unsigned: {
          const auto u = j.get<std::uint64_t>();
          if (u > static_cast<std::uint64_t>(INT64_MAX)) unsupported("the integer ", u, " (beyond 64 bits)");
          return Value(static_cast<std::int64_t>(u));
        }
        case nlohmann::ordered_json::value_t::number_float: return Value(j.get<double>());
        case nlohmann::ordered_json::value_t::string: return Value(j.get<std::string>());
        case nlohmann::ordered_json::value_t::array: {
          std::vector<Value> items;
          items.reserve(j.size());
          for (const auto& item : j) items.push_back(convert(item, depth + 1));
          return Value::list(std::move(items));
        }
        case nlohmann::ordered_json::value_t::object: {
          auto d = std::make_shared<Dict>();
          for (const auto& [k, item] : j.items()) d->set(Value(k), convert(item, depth + 1));
          return Value(std::shared_ptr<const Dict>(std::move(d)));
        }
        default: fail("binary JSON values are not supported");
      }
    }
  };
  return Walk::convert(j, 1);
}

}  // namespace tessera::toolkit::jinja
