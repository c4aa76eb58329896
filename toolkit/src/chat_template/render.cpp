#include "chat_template/render.hpp"

#include <algorithm>
#include <unordered_map>

#include "chat_template/builtins.hpp"
#include "chat_template/errors.hpp"

namespace tessera::toolkit::jinja {
namespace {

struct Scope {
  std::unordered_map<std::string, Value> vars;
  std::shared_ptr<Scope> parent;
};
using ScopePtr = std::shared_ptr<Scope>;

enum class Flow { normal, break_, continue_ };

// Names jinja2 defines that this interpreter does not: using one is refused, not rendered as
// an undefined value.
bool unsupported_name(const std::string& name) {
  return name == "lipsum" || name == "cycler" || name == "joiner" || name == "self" || name == "varargs" ||
         name == "kwargs";
}

class Renderer final : public Env {
 public:
  Renderer(const Program& program, const RenderOptions& options) : program_(program), options_(options) {
    now_ = options.now ? *options.now : std::chrono::system_clock::now();
  }

  std::string run(const std::vector<std::pair<std::string, Value>>& variables) {
    const char here = 0;
    stack_base_ = &here;
    auto root = std::make_shared<Scope>();
    for (const auto& [name, value] : variables) root->vars[name] = value;
    std::string out;
    exec(program_.body, root, out);
    return out;
  }

  void check_size(std::size_t bytes) override {
    if (bytes > options_.limits.max_bytes)
      throw Failure{TemplateError::Kind::budget, "the render budget allows strings and lists of at most " +
                                                     std::to_string(options_.limits.max_bytes) + " bytes"};
  }
  void count_steps(std::int64_t n) override {
    steps_ += n;
    if (steps_ > options_.limits.max_steps)
      throw Failure{TemplateError::Kind::budget,
                    "the render budget of " + std::to_string(options_.limits.max_steps) + " steps is spent (a loop too long?)"};
  }
  std::chrono::system_clock::time_point now() const override { return now_; }

 private:
  struct Depth {
    Depth(Renderer& r) : r(r) {
      if (++r.depth_ > r.options_.limits.max_depth)
        throw Failure{TemplateError::Kind::budget, "the render budget allows macro calls and loops nested " +
                                                       std::to_string(r.options_.limits.max_depth) + " deep"};
    }
    ~Depth() { --r.depth_; }
    Renderer& r;
  };

  [[noreturn]] void located(const Failure& f, int line, int column) const {
    throw TemplateError(f.kind, program_.origin, line, column, f.message);
  }

  void append(std::string& out, const std::string& s) {
    out += s;
    check_size(out.size());
  }

  // --- statements -----------------------------------------------------------------------
  Flow exec(const Body& body, const ScopePtr& scope, std::string& out) {
    for (const auto& s : body) {
      const Flow flow = exec(*s, scope, out);
      if (flow != Flow::normal) return flow;
    }
    return Flow::normal;
  }

  // The stack the recursion has taken since run() began (it grows down on every platform we build for).
  void check_stack() const {
    const char here = 0;
    if (static_cast<std::size_t>(stack_base_ - &here) > options_.limits.max_stack_bytes)
      throw Failure{TemplateError::Kind::budget, "the render budget's stack (" +
                                                     std::to_string(options_.limits.max_stack_bytes) +
                                                     " bytes) is spent: the template nests too deeply"};
  }

  Flow exec(const Stmt& s, const ScopePtr& scope, std::string& out) {
    try {
      count_steps(1);
      check_stack();
      switch (s.kind) {
        case Stmt::Kind::data:
          append(out, s.text);
          return Flow::normal;
        case Stmt::Kind::output:
          append(out, to_str(eval(*s.exprs[0], scope)));
          return Flow::normal;
        case Stmt::Kind::if_:
          for (const auto& [test, body] : s.branches)
            if (truthy(eval(*test, scope))) return exec(body, scope, out);
          return exec(s.else_body, scope, out);
        case Stmt::Kind::for_:
          exec_for(s, scope, out);
          return Flow::normal;
        case Stmt::Kind::set:
          assign(s.target, eval(*s.exprs[0], scope), scope);
          return Flow::normal;
        case Stmt::Kind::set_block:
        case Stmt::Kind::filter_block: {
          std::string captured;
          exec(s.body, child(scope), captured);
          Value v(std::move(captured));
          if (s.exprs[0]) v = eval_filters(*s.exprs[0], v, scope);
          if (s.kind == Stmt::Kind::set_block) {
            assign(s.target, v, scope);
          } else {
            append(out, to_str(v));
          }
          return Flow::normal;
        }
        case Stmt::Kind::macro:
          scope->vars[s.text] = make_macro(s.text, s, scope);
          return Flow::normal;
        case Stmt::Kind::call_block: {
          // The called macro gets caller=, a macro of the block's body (in this scope).
          const Expr& call = *s.exprs[0];
          const Value callee = eval(*call.children[0], scope);
          CallArgs args = arguments(call, 1, scope);
          args.keyword.emplace_back("caller", make_macro("caller", s, scope));
          if (callee.is_undefined()) fail("UndefinedError: ", callee.undefined_hint());
          if (!callee.is_callable()) fail("TypeError: '", callee.type_name(), "' object is not callable");
          append(out, to_str(callee.callable().call(args)));
          return Flow::normal;
        }
        case Stmt::Kind::break_: return Flow::break_;
        case Stmt::Kind::continue_: return Flow::continue_;
        case Stmt::Kind::scope: {
          auto inner = child(scope);
          for (std::size_t i = 0; i < s.targets.size(); ++i) assign(s.targets[i], eval(*s.exprs[i], scope), inner);
          return exec(s.body, inner, out);
        }
      }
    } catch (const Failure& f) {
      located(f, s.line, s.column);
    }
    return Flow::normal;
  }

  static ScopePtr child(const ScopePtr& parent) {
    auto s = std::make_shared<Scope>();
    s->parent = parent;
    return s;
  }

  void assign(const Target& target, const Value& value, const ScopePtr& scope) {
    if (target.kind == Target::Kind::name) {
      scope->vars[target.names[0]] = value;
    } else if (target.kind == Target::Kind::tuple) {
      const auto items = iterate(value);
      if (items.size() != target.names.size())
        fail("ValueError: ", items.size() < target.names.size() ? "not enough" : "too many", " values to unpack (expected ",
             target.names.size(), ", got ", items.size(), ")");
      for (std::size_t i = 0; i < items.size(); ++i) scope->vars[target.names[i]] = items[i];
    } else {
      const Value ns = lookup(target.names[0], scope);
      if (!ns.is_namespace()) fail("TemplateRuntimeError: cannot assign attribute on non-namespace object");
      if (shape_of(value).holds_reference || value.is_namespace() || value.is_callable())
        unsupported("storing a namespace or a function in a namespace");
      ns.ns().attributes.set(Value(target.attribute), value);
    }
  }

  void exec_for(const Stmt& s, const ScopePtr& scope, std::string& out) {
    Depth depth(*this);
    std::vector<Value> items = iterate(eval(*s.exprs[0], scope));
    if (s.exprs[1]) {
      // `for x in xs if test`: the test sees the loop's target, and loop.* counts only what passes.
      std::vector<Value> kept;
      for (auto& item : items) {
        count_steps(1);
        auto probe = child(scope);
        assign(s.target, item, probe);
        if (truthy(eval(*s.exprs[1], probe))) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      exec(s.else_body, child(scope), out);
      return;
    }
    const auto n = static_cast<std::int64_t>(items.size());
    auto changed_state = std::make_shared<std::optional<std::vector<Value>>>();
    for (std::int64_t i = 0; i < n; ++i) {
      count_steps(1);
      auto iteration = child(scope);
      assign(s.target, items[static_cast<std::size_t>(i)], iteration);
      iteration->vars["loop"] = loop_object(items, i, changed_state);
      if (exec(s.body, iteration, out) == Flow::break_) break;
    }
  }

  Value loop_object(const std::vector<Value>& items, std::int64_t i, const std::shared_ptr<std::optional<std::vector<Value>>>& changed) {
    const auto n = static_cast<std::int64_t>(items.size());
    auto d = std::make_shared<Dict>();
    d->set(Value("index"), Value(i + 1));
    d->set(Value("index0"), Value(i));
    d->set(Value("revindex"), Value(n - i));
    d->set(Value("revindex0"), Value(n - i - 1));
    d->set(Value("first"), Value(i == 0));
    d->set(Value("last"), Value(i == n - 1));
    d->set(Value("length"), Value(n));
    d->set(Value("depth"), Value(1));
    d->set(Value("depth0"), Value(0));
    d->set(Value("previtem"), i > 0 ? items[static_cast<std::size_t>(i - 1)] : Value::undefined("there is no previous item"));
    d->set(Value("nextitem"), i + 1 < n ? items[static_cast<std::size_t>(i + 1)] : Value::undefined("there is no next item"));
    d->set(Value("cycle"), Value(std::shared_ptr<const Callable>(std::make_shared<Callable>(Callable{"loop.cycle", [i](CallArgs& a) {
                                  if (a.positional.empty()) fail("TypeError: no items for cycling given");
                                  return a.positional[static_cast<std::size_t>(i) % a.positional.size()];
                                }}))));
    d->set(Value("changed"), Value(std::shared_ptr<const Callable>(std::make_shared<Callable>(Callable{"loop.changed", [changed](CallArgs& a) {
                                    const bool differs = !*changed || changed->value().size() != a.positional.size() ||
                                                         !std::equal(a.positional.begin(), a.positional.end(),
                                                                     changed->value().begin(), equal);
                                    if (differs) *changed = a.positional;
                                    return Value(differs);
                                  }}))));
    return Value(std::shared_ptr<const Dict>(std::move(d)));
  }

  // A macro (or a call block's caller) over `s`'s parameters and body, seeing `scope`.
  Value make_macro(const std::string& name, const Stmt& s, const ScopePtr& scope) {
    std::weak_ptr<Scope> defined_in = scope;
    return Value(std::shared_ptr<const Callable>(std::make_shared<Callable>(Callable{name, [this, &s, name, defined_in](CallArgs& a) {
      const ScopePtr parent = defined_in.lock();
      if (!parent) unsupported("calling a macro after the scope that defined it has ended");
      Depth depth(*this);
      if (a.positional.size() > s.params.size())
        fail("TypeError: macro '", name, "' takes not more than ", s.params.size(), " argument(s)");
      auto frame = child(parent);
      if (s.uses_caller) frame->vars["caller"] = Value::undefined("No caller defined");
      std::vector<bool> given(s.params.size(), false);
      for (std::size_t i = 0; i < a.positional.size(); ++i) {
        frame->vars[s.params[i]] = a.positional[i];
        given[i] = true;
      }
      for (auto& [key, value] : a.keyword) {
        const auto it = std::find(s.params.begin(), s.params.end(), key);
        if (it == s.params.end() && key == "caller" && s.uses_caller) {
          frame->vars["caller"] = value;
          continue;
        }
        if (it == s.params.end()) fail("TypeError: macro '", name, "' takes no keyword argument '", key, "'");
        const auto i = static_cast<std::size_t>(it - s.params.begin());
        if (given[i]) fail("TypeError: macro '", name, "' got multiple values for argument '", key, "'");
        frame->vars[key] = value;
        given[i] = true;
      }
      const std::size_t first_default = s.params.size() - s.defaults.size();
      for (std::size_t i = 0; i < s.params.size(); ++i) {
        if (given[i]) continue;
        frame->vars[s.params[i]] = i >= first_default ? eval(*s.defaults[i - first_default], frame)
                                                      : Value::undefined("parameter '" + s.params[i] + "' was not provided");
      }
      std::string out;
      exec(s.body, frame, out);
      return Value(std::move(out));
    }})));
  }

  // --- expressions ----------------------------------------------------------------------
  Value lookup(const std::string& name, const ScopePtr& scope) {
    for (const Scope* s = scope.get(); s; s = s->parent.get()) {
      const auto it = s->vars.find(name);
      if (it != s->vars.end()) return it->second;
    }
    Value g = global(*this, name);
    if (!g.is_undefined()) return g;
    if (unsupported_name(name)) unsupported("the name '", name, "'");
    return Value::undefined("'" + name + "' is undefined");
  }

  // The call's arguments, *args and **kwargs spread after the others, as Python spreads them.
  CallArgs arguments(const Expr& e, std::size_t first, const ScopePtr& scope) {
    CallArgs args;
    for (std::size_t i = first; i < e.children.size(); ++i) args.positional.push_back(eval(*e.children[i], scope));
    std::optional<Value> star, star_star;
    for (const auto& [key, value] : e.kwargs) {
      if (key == "*") {
        star = eval(*value, scope);
      } else if (key == "**") {
        star_star = eval(*value, scope);
      } else {
        args.keyword.emplace_back(key, eval(*value, scope));
      }
    }
    if (star)
      for (auto& v : iterate(*star)) args.positional.push_back(std::move(v));
    if (star_star) {
      if (!star_star->is_dict()) fail("TypeError: argument after ** must be a mapping, not ", star_star->type_name());
      for (const auto& [k, v] : star_star->dict().items) {
        if (!k.is_string()) fail("TypeError: keywords must be strings");
        for (const auto& [existing, _] : args.keyword)
          if (existing == k.str()) fail("TypeError: got multiple values for keyword argument '", k.str(), "'");
        args.keyword.emplace_back(k.str(), v);
      }
    }
    return args;
  }

  // A filter chain whose innermost input is `input` (the body of a set or filter block).
  Value eval_filters(const Expr& e, const Value& input, const ScopePtr& scope) {
    try {
      const Value in = e.children[0] ? eval_filters(*e.children[0], input, scope) : input;
      CallArgs args = arguments(e, 1, scope);
      return apply_filter(*this, e.name, in, args);
    } catch (const Failure& f) {
      located(f, e.line, e.column);
    }
  }

  Value eval(const Expr& e, const ScopePtr& scope) {
    try {
      count_steps(1);
      check_stack();
      return eval_node(e, scope);
    } catch (const Failure& f) {
      located(f, e.line, e.column);
    }
  }

  Value eval_node(const Expr& e, const ScopePtr& scope) {
    switch (e.kind) {
      case Expr::Kind::constant: return e.value;
      case Expr::Kind::name: return lookup(e.name, scope);
      case Expr::Kind::list:
      case Expr::Kind::tuple: {
        std::vector<Value> items;
        for (const auto& c : e.children) items.push_back(eval(*c, scope));
        return e.kind == Expr::Kind::list ? Value::list(std::move(items)) : Value::tuple(std::move(items));
      }
      case Expr::Kind::dict: {
        auto d = std::make_shared<Dict>();
        for (std::size_t i = 0; i + 1 < e.children.size(); i += 2) {
          Value k = eval(*e.children[i], scope);
          d->set(k, eval(*e.children[i + 1], scope));
        }
        return Value(std::shared_ptr<const Dict>(std::move(d)));
      }
      case Expr::Kind::getattr: return get_attribute(*this, eval(*e.children[0], scope), e.name);
      case Expr::Kind::getitem: {
        const Value obj = eval(*e.children[0], scope);
        return get_item(*this, obj, eval(*e.children[1], scope));
      }
      case Expr::Kind::slice: {
        const Value obj = eval(*e.children[0], scope);
        const auto part = [&](std::size_t i) { return e.children[i] ? eval(*e.children[i], scope) : Value(None{}); };
        const Value start = part(1), stop = part(2), step = part(3);
        return get_slice(*this, obj, start, stop, step, e.value.is_bool());
      }
      case Expr::Kind::call: {
        const Value callee = eval(*e.children[0], scope);
        CallArgs args = arguments(e, 1, scope);
        if (callee.is_undefined()) fail("UndefinedError: ", callee.undefined_hint());
        if (!callee.is_callable()) fail("TypeError: '", callee.type_name(), "' object is not callable");
        return callee.callable().call(args);
      }
      case Expr::Kind::filter: {
        const Value in = eval(*e.children[0], scope);
        CallArgs args = arguments(e, 1, scope);
        return apply_filter(*this, e.name, in, args);
      }
      case Expr::Kind::test: {
        const Value in = eval(*e.children[0], scope);
        CallArgs args = arguments(e, 1, scope);
        return Value(apply_test(*this, e.name, in, args));
      }
      case Expr::Kind::unary: {
        const Value v = eval(*e.children[0], scope);
        if (e.name == "not") return Value(!truthy(v));
        if (v.is_undefined()) fail("UndefinedError: ", v.undefined_hint());
        if (!v.is_number()) fail("TypeError: bad operand type for unary ", e.name, ": '", v.type_name(), "'");
        if (e.name == "+") return v.is_float() ? v : Value(v.as_int());
        if (v.is_float()) return Value(-v.as_double());
        if (v.as_int() == INT64_MIN) unsupported("an integer beyond 64 bits");
        return Value(-v.as_int());
      }
      case Expr::Kind::binary: {
        Value left = eval(*e.children[0], scope);
        if (e.name == "and") return truthy(left) ? eval(*e.children[1], scope) : left;
        if (e.name == "or") return truthy(left) ? left : eval(*e.children[1], scope);
        return binary_op(*this, e.name, left, eval(*e.children[1], scope));
      }
      case Expr::Kind::concat: {
        std::string s;
        for (const auto& c : e.children) {
          s += to_str(eval(*c, scope));
          check_size(s.size());
        }
        return Value(std::move(s));
      }
      case Expr::Kind::compare: {
        Value left = eval(*e.children[0], scope);
        for (std::size_t i = 0; i < e.ops.size(); ++i) {
          Value right = eval(*e.children[i + 1], scope);
          if (!compare_op(e.ops[i], left, right)) return Value(false);
          left = std::move(right);
        }
        return Value(true);
      }
      case Expr::Kind::condition:
        if (truthy(eval(*e.children[0], scope))) return eval(*e.children[1], scope);
        if (e.children[2]) return eval(*e.children[2], scope);
        return Value::undefined("the inline if-expression on line " + std::to_string(e.line) +
                                " evaluated to false and no else section was defined.");
    }
    fail("internal: unknown expression");
  }

  const Program& program_;
  const RenderOptions& options_;
  std::chrono::system_clock::time_point now_;
  std::int64_t steps_ = 0;
  int depth_ = 0;
  const char* stack_base_ = nullptr;
};

}  // namespace

std::string render(const Program& program, const std::vector<std::pair<std::string, Value>>& variables,
                   const RenderOptions& options) {
  try {
    return Renderer(program, options).run(variables);
  } catch (const Failure& f) {
    throw TemplateError(f.kind, program.origin, 0, 0, f.message);
  }
}

}  // namespace tessera::toolkit::jinja
