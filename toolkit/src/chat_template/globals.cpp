// The functions a chat template can call by name: jinja2's range, dict and namespace
// (range capped as the sandbox caps it), and transformers' raise_exception and strftime_now.
#include <ctime>

#include "chat_template/builtins.hpp"
#include "chat_template/errors.hpp"
#include "chat_template/params.hpp"

namespace tessera::toolkit::jinja {
namespace {

// jinja2.sandbox.MAX_RANGE
constexpr std::int64_t kMaxRange = 100000;

Value function(const std::string& name, std::function<Value(CallArgs&)> fn) {
  return Value(std::shared_ptr<const Callable>(std::make_shared<Callable>(Callable{name, std::move(fn)})));
}

std::int64_t integer(const Value& v) {
  if (!v.is_integral()) fail("TypeError: '", v.type_name(), "' object cannot be interpreted as an integer");
  return v.as_int();
}

Value range(Env& env, CallArgs& args) {
  if (!args.keyword.empty()) fail("TypeError: range() takes no keyword arguments");
  const auto& a = args.positional;
  if (a.empty() || a.size() > 3) fail("TypeError: range expected 1 to 3 arguments, got ", a.size());
  const std::int64_t start = a.size() == 1 ? 0 : integer(a[0]);
  const std::int64_t stop = a.size() == 1 ? integer(a[0]) : integer(a[1]);
  const std::int64_t step = a.size() == 3 ? integer(a[2]) : 1;
  if (step == 0) fail("ValueError: range() arg 3 must not be zero");
  const long double n = step > 0 ? (static_cast<long double>(stop) - start + step - 1) / step
                                 : (static_cast<long double>(start) - stop - step - 1) / -step;
  if (n > kMaxRange)
    fail("OverflowError: Range too big. The sandbox blocks ranges larger than MAX_RANGE (", kMaxRange, ").");
  auto r = std::make_shared<Sequence>();
  r->kind = Sequence::Kind::range;
  r->range_start = start;
  r->range_stop = stop;
  r->range_step = step;
  for (std::int64_t i = start; step > 0 ? i < stop : i > stop; i += step) r->items.emplace_back(i);
  env.count_steps(static_cast<std::int64_t>(r->items.size()));
  return Value(std::shared_ptr<const Sequence>(std::move(r)));
}

// dict(mapping or pairs, **kwargs)
std::shared_ptr<Dict> make_dict(CallArgs& args, const char* callee) {
  auto d = std::make_shared<Dict>();
  if (args.positional.size() > 1) fail("TypeError: ", callee, " expected at most 1 argument, got ", args.positional.size());
  if (!args.positional.empty()) {
    const Value& src = args.positional[0];
    if (src.is_dict()) {
      for (const auto& [k, v] : src.dict().items) d->set(k, v);
    } else if (src.is_namespace()) {
      fail("TypeError: 'Namespace' object is not iterable");
    } else {
      for (const auto& pair : iterate(src)) {
        const auto items = iterate(pair);
        if (items.size() != 2) fail("ValueError: dictionary update sequence element has length ", items.size(), "; 2 is required");
        d->set(items[0], items[1]);
      }
    }
  }
  for (auto& [k, v] : args.keyword) d->set(Value(k), v);
  return d;
}

// datetime.now().strftime(format): %f, %z and %Z as datetime does them (a naive time has no
// zone), everything else by the C library as time.strftime does.
std::string strftime_now(std::chrono::system_clock::time_point now, const std::string& format) {
  const std::time_t seconds = std::chrono::system_clock::to_time_t(now);
  const auto micros = std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count() % 1000000;
  std::tm local{};
  localtime_r(&seconds, &local);
  std::string fmt;
  for (std::size_t i = 0; i < format.size(); ++i) {
    if (format[i] != '%' || i + 1 == format.size()) {
      fmt.push_back(format[i]);
      continue;
    }
    const char c = format[++i];
    if (c == 'f') {
      char buf[8];
      std::snprintf(buf, sizeof buf, "%06lld", static_cast<long long>(micros < 0 ? micros + 1000000 : micros));
      fmt += buf;
    } else if (c == 'z' || c == 'Z') {
    } else {
      fmt.push_back('%');
      fmt.push_back(c);
    }
  }
  if (fmt.empty()) return {};
  std::string out(fmt.size() * 4 + 64, '\0');
  while (true) {
    const std::size_t n = std::strftime(out.data(), out.size(), fmt.c_str(), &local);
    if (n > 0 || out.size() > fmt.size() * 64 + 1024) {
      out.resize(n);
      return out;
    }
    out.resize(out.size() * 2);
  }
}

}  // namespace

Value global(Env& env, const std::string& name) {
  if (name == "range") return function(name, [&env](CallArgs& a) { return range(env, a); });
  if (name == "dict") {
    return function(name, [](CallArgs& a) { return Value(std::shared_ptr<const Dict>(make_dict(a, "dict"))); });
  }
  if (name == "namespace") {
    return function(name, [](CallArgs& a) {
      auto ns = std::make_shared<Namespace>();
      ns->attributes = std::move(*make_dict(a, "namespace"));
      if (ns->attributes.shape.holds_reference) unsupported("a namespace holding a namespace or a function");
      return Value(std::move(ns));
    });
  }
  if (name == "raise_exception") {
    return function(name, [](CallArgs& a) -> Value {
      Params p("raise_exception", a, {"message"});
      throw Failure{TemplateError::Kind::raised, to_str(p.need(0, "raise_exception"))};
    });
  }
  if (name == "strftime_now") {
    return function(name, [&env](CallArgs& a) {
      Params p("strftime_now", a, {"format"});
      const Value& f = p.need(0, "strftime_now");
      if (!f.is_string()) fail("TypeError: strftime() argument 1 must be str, not ", f.type_name());
      env.check_size(f.str().size() * 8);
      return make_string(env, strftime_now(env.now(), f.str()));
    });
  }
  return Value();
}

}  // namespace tessera::toolkit::jinja
