#include "chat_template/parser.hpp"

#include <algorithm>
#include <initializer_list>

#include "chat_template/builtins.hpp"
#include "chat_template/errors.hpp"

namespace tessera::toolkit::jinja {
namespace {

// Deeper nesting than this is refused before the recursive descent can exhaust the stack.
constexpr int kMaxParseDepth = 200;

const char* const kUnsupportedTags[] = {"block", "extends", "include", "import", "from", "autoescape"};
// Chains such as a + b + c + ... build deep trees without recursing in the parser.
constexpr int kMaxTreeDepth = 1000;

class Parser {
 public:
  Parser(const std::vector<Token>& tokens, const std::string& origin) : t_(tokens), origin_(origin) {}

  Body parse_template() {
    Body body = subparse({});
    if (cur().type != Token::Type::eof) error("unexpected '" + describe(cur()) + "'");
    check(body, false);
    return body;
  }

 private:
  // --- after parsing: names, and what jinja2's compiler folds ------------------------------
  // A filter or test that does not exist (or that this interpreter lacks) is refused here,
  // except in a "soft frame" (an if's test and branches, an inline if), where jinja2 only
  // fails if it is reached; a for, macro, with or block body starts a frame that is not soft.
  void check(const Body& body, bool soft) {
    for (const auto& s : body) check(*s, soft);
  }

  void check(const Stmt& s, bool soft) {
    switch (s.kind) {
      case Stmt::Kind::if_:
        for (const auto& [test, body] : s.branches) check(*test, true), check(body, true);
        check(s.else_body, true);
        return;
      case Stmt::Kind::for_:
        check(*s.exprs[0], soft);
        if (s.exprs[1]) check(*s.exprs[1], false);
        check(s.body, false);
        check(s.else_body, false);
        return;
      case Stmt::Kind::macro:
      case Stmt::Kind::call_block:
        for (const auto& d : s.defaults) check(*d, false);
        for (const auto& e : s.exprs) check(*e, soft);
        check(s.body, false);
        return;
      case Stmt::Kind::output:
        check(*s.exprs[0], soft);
        if (constant(*s.exprs[0])) fold_slices(*s.exprs[0]);
        return;
      default:
        for (const auto& e : s.exprs)
          if (e) check(*e, soft);
        check(s.body, false);
    }
  }

  void check(Expr& e, bool soft) {
    if ((e.kind == Expr::Kind::filter && !has_filter(e.name)) || (e.kind == Expr::Kind::test && !has_test(e.name))) {
      const bool filter = e.kind == Expr::Kind::filter;
      const std::string what = std::string(filter ? "filter" : "test");
      if (!soft) {
        if (filter ? is_jinja_filter(e.name) : is_jinja_test(e.name))
          throw TemplateError(TemplateError::Kind::unsupported, origin_, e.line, e.column,
                              "the " + what + " '" + e.name + "' is not supported by Tessera's chat template interpreter");
        throw TemplateError(TemplateError::Kind::syntax, origin_, e.line, e.column, "No " + what + " named '" + e.name + "'.");
      }
    }
    const bool inner_soft = soft || e.kind == Expr::Kind::condition;
    for (auto& c : e.children)
      if (c) check(*c, inner_soft);
    for (auto& [_, c] : e.kwargs) check(*c, inner_soft);
  }

  // jinja2 computes a {{ }} whose expression is all literals at compile time (as_const), and
  // there a slice goes through the sandbox's getitem, which turns a TypeError into Undefined;
  // everywhere else a slice is a plain Python subscript, and the TypeError is raised.
  static bool constant(const Expr& e) {
    switch (e.kind) {
      case Expr::Kind::constant: return true;
      case Expr::Kind::filter:
        // Filters that take the context are never folded.
        if (e.name == "map" || e.name == "select" || e.name == "reject" || e.name == "selectattr" ||
            e.name == "rejectattr" || !e.children[0])
          return false;
        [[fallthrough]];
      case Expr::Kind::list: case Expr::Kind::tuple: case Expr::Kind::dict: case Expr::Kind::unary:
      case Expr::Kind::binary: case Expr::Kind::compare: case Expr::Kind::concat: case Expr::Kind::getattr:
      case Expr::Kind::getitem: case Expr::Kind::slice: case Expr::Kind::test: case Expr::Kind::condition:
        for (const auto& c : e.children)
          if (c && !constant(*c)) return false;
        for (const auto& [_, c] : e.kwargs)
          if (!constant(*c)) return false;
        return true;
      default: return false;
    }
  }

  static void fold_slices(Expr& e) {
    if (e.kind == Expr::Kind::slice) e.value = Value(true);
    for (auto& c : e.children)
      if (c) fold_slices(*c);
  }

  // --- the token stream ---------------------------------------------------------------
  const Token& cur() const { return t_[pos_]; }
  const Token& look() const { return t_[std::min(pos_ + 1, t_.size() - 1)]; }
  const Token& advance() {
    const Token& t = t_[pos_];
    if (pos_ + 1 < t_.size()) ++pos_;
    return t;
  }
  bool is_op(const char* op) const { return cur().type == Token::Type::op && cur().text == op; }
  bool is_name(const char* name) const { return cur().type == Token::Type::name && cur().text == name; }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    advance();
    return true;
  }
  bool skip_name(const char* name) {
    if (!is_name(name)) return false;
    advance();
    return true;
  }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case Token::Type::eof: return "end of template";
      case Token::Type::block_begin: return "begin of statement block";
      case Token::Type::block_end: return "end of statement block";
      case Token::Type::variable_begin: return "begin of print statement";
      case Token::Type::variable_end: return "end of print statement";
      case Token::Type::data: return "template data";
      case Token::Type::string: return "string";
      default: return t.text;
    }
  }
  [[noreturn]] void error(const std::string& message, const Token* at = nullptr) const {
    const Token& t = at ? *at : cur();
    throw TemplateError(TemplateError::Kind::syntax, origin_, t.line, t.column, message);
  }
  [[noreturn]] void refuse(const std::string& what, const Token& at) const {
    throw TemplateError(TemplateError::Kind::unsupported, origin_, at.line, at.column,
                        what + " is not supported by Tessera's chat template interpreter");
  }
  void expect_op(const char* op) {
    if (!skip_op(op)) error(std::string("expected '") + op + "', got '" + describe(cur()) + "'");
  }
  const Token& expect_name() {
    if (cur().type != Token::Type::name) error("expected a name, got '" + describe(cur()) + "'");
    return advance();
  }
  void expect(Token::Type type, const char* what) {
    if (cur().type != type) error(std::string("expected ") + what + ", got '" + describe(cur()) + "'");
    advance();
  }

  struct Depth {
    Depth(Parser& p) : p(p) {
      if (++p.depth_ > kMaxParseDepth)
        throw TemplateError(TemplateError::Kind::budget, p.origin_, p.cur().line, p.cur().column,
                            "the template nests deeper than " + std::to_string(kMaxParseDepth) + " levels");
    }
    ~Depth() { --p.depth_; }
    Parser& p;
  };

  // Records the depth of `e` over its (complete) children; refuses a tree too deep to evaluate.
  ExprPtr sized(ExprPtr e) {
    for (const auto& c : e->children)
      if (c) e->depth = std::max(e->depth, c->depth + 1);
    for (const auto& [_, c] : e->kwargs) e->depth = std::max(e->depth, c->depth + 1);
    if (e->depth > kMaxTreeDepth)
      throw TemplateError(TemplateError::Kind::budget, origin_, e->line, e->column,
                          "the expression nests deeper than " + std::to_string(kMaxTreeDepth) + " levels");
    return e;
  }

  ExprPtr node(Expr::Kind kind, const Token& at) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = at.line;
    e->column = at.column;
    return e;
  }

  // --- statements -----------------------------------------------------------------------
  // Until a block whose first name is one of `ends` (left as the current token) or the end.
  Body subparse(std::initializer_list<const char*> ends) {
    looking_for_.emplace_back(ends);
    Body body = subparse_until(ends);
    looking_for_.pop_back();
    return body;
  }

  // "'endfor' or 'else'": what the innermost open block waits for.
  std::string awaited() const {
    std::string names;
    if (!looking_for_.empty())
      for (const char* end : looking_for_.back()) names += std::string(names.empty() ? "" : " or ") + "'" + end + "'";
    return names;
  }

  Body subparse_until(std::initializer_list<const char*> ends) {
    Body body;
    while (cur().type != Token::Type::eof) {
      const Token& t = cur();
      if (t.type == Token::Type::data) {
        auto s = stmt(Stmt::Kind::data, t);
        s->text = t.text;
        body.push_back(std::move(s));
        advance();
      } else if (t.type == Token::Type::variable_begin) {
        advance();
        auto s = stmt(Stmt::Kind::output, t);
        s->exprs.push_back(parse_tuple(true));
        expect(Token::Type::variable_end, "'}}'");
        body.push_back(std::move(s));
      } else if (t.type == Token::Type::block_begin) {
        advance();
        for (const char* end : ends)
          if (is_name(end)) return body;
        auto s = statement();
        expect(Token::Type::block_end, "'%}'");
        if (s) body.push_back(std::move(s));
      } else {
        error("unexpected '" + describe(t) + "'");
      }
    }
    if (ends.size()) error("Unexpected end of template. Jinja was looking for the following tags: " + awaited() + ".");
    return body;
  }

  // After the tag's own words: an optional ":" then "%}", then the body up to one of `ends`.
  Body statements(std::initializer_list<const char*> ends) {
    skip_op(":");
    expect(Token::Type::block_end, "'%}'");
    Depth depth(*this);
    return subparse(ends);
  }

  std::unique_ptr<Stmt> stmt(Stmt::Kind kind, const Token& at) {
    auto s = std::make_unique<Stmt>();
    s->kind = kind;
    s->line = at.line;
    s->column = at.column;
    return s;
  }

  std::unique_ptr<Stmt> statement() {
    const Token& t = cur();
    if (t.type != Token::Type::name) error("tag name expected");
    const std::string& tag = t.text;
    if (tag == "for") return parse_for();
    if (tag == "if") return parse_if();
    if (tag == "set") return parse_set();
    if (tag == "macro") return parse_macro();
    if (tag == "with") return parse_with();
    if (tag == "filter") return parse_filter_block();
    if (tag == "call") return parse_call_block();
    if (tag == "print") {
      advance();
      auto s = stmt(Stmt::Kind::output, t);
      auto tuple = node(Expr::Kind::tuple, t);
      while (cur().type != Token::Type::block_end) {
        if (!tuple->children.empty()) expect_op(",");
        tuple->children.push_back(parse_expression());
      }
      if (tuple->children.size() == 1) {
        s->exprs.push_back(std::move(tuple->children[0]));
      } else {
        s->exprs.push_back(std::move(tuple));
      }
      return s;
    }
    if (tag == "break" || tag == "continue") {
      if (loops_ == 0) error("'" + tag + "' outside of a loop");
      advance();
      return stmt(tag == "break" ? Stmt::Kind::break_ : Stmt::Kind::continue_, t);
    }
    if (tag == "generation") {
      // transformers' AssistantTracker: the body renders as it is (it records where).
      advance();
      auto s = stmt(Stmt::Kind::scope, t);
      s->body = statements({"endgeneration"});
      advance();
      return s;
    }
    for (const char* unsupported_tag : kUnsupportedTags)
      if (tag == unsupported_tag) refuse("the '" + tag + "' tag", t);
    const std::string awaiting = awaited();
    error("Encountered unknown tag '" + tag + "'." +
          (awaiting.empty() ? "" : " Jinja was looking for the following tags: " + awaiting + "."));
  }

  Target parse_target(bool with_tuple, bool with_namespace, const char* tuple_end) {
    Target target;
    const Token& first = cur();
    const auto one = [&](Target& into) {
      const Token& name = expect_name();
      if (name.text == "true" || name.text == "false" || name.text == "none" || name.text == "True" ||
          name.text == "False" || name.text == "None")
        error("can't assign to 'const'", &name);
      if (with_namespace && is_op(".")) {
        advance();
        into.kind = Target::Kind::attribute;
        into.names = {name.text};
        into.attribute = expect_name().text;
        return;
      }
      into.names.push_back(name.text);
    };
    if (!with_tuple) {
      one(target);
      return target;
    }
    bool tuple = false;
    std::vector<Target> parts;
    while (true) {
      if (!parts.empty()) expect_op(",");
      if (cur().type == Token::Type::block_end || (tuple_end && is_name(tuple_end)) || is_op(")")) break;
      parts.emplace_back();
      one(parts.back());
      if (!is_op(",")) break;
      tuple = true;
    }
    if (parts.empty()) error("expected a name to assign to", &first);
    if (!tuple) return parts[0];
    target.kind = Target::Kind::tuple;
    for (const auto& p : parts) {
      if (p.kind == Target::Kind::attribute) refuse("unpacking into a namespace attribute", first);
      target.names.push_back(p.names[0]);
    }
    return target;
  }

  std::unique_ptr<Stmt> parse_for() {
    const Token& t = advance();
    auto s = stmt(Stmt::Kind::for_, t);
    s->target = parse_target(true, false, "in");
    if (!skip_name("in")) error("expected 'in', got '" + describe(cur()) + "'");
    s->exprs.push_back(parse_tuple(false, "recursive"));
    s->exprs.push_back(skip_name("if") ? parse_expression() : nullptr);
    if (is_name("recursive")) refuse("a recursive for loop", cur());
    ++loops_;
    s->body = statements({"endfor", "else"});
    --loops_;
    if (advance().text == "else") s->else_body = statements({"endfor"}), advance();
    return s;
  }

  std::unique_ptr<Stmt> parse_if() {
    const Token& t = advance();
    auto s = stmt(Stmt::Kind::if_, t);
    while (true) {
      ExprPtr test = parse_tuple(false);
      Body body = statements({"elif", "else", "endif"});
      s->branches.emplace_back(std::move(test), std::move(body));
      const Token& end = advance();
      if (end.text == "elif") continue;
      if (end.text == "else") {
        s->else_body = statements({"endif"});
        advance();
      }
      break;
    }
    return s;
  }

  std::unique_ptr<Stmt> parse_set() {
    const Token& t = advance();
    Target target = parse_target(true, true, nullptr);
    if (skip_op("=")) {
      auto s = stmt(Stmt::Kind::set, t);
      s->target = std::move(target);
      s->exprs.push_back(parse_tuple(true));
      return s;
    }
    auto s = stmt(Stmt::Kind::set_block, t);
    s->target = std::move(target);
    s->exprs.push_back(is_op("|") ? parse_filters(nullptr, false) : nullptr);
    s->body = statements({"endset"});
    advance();
    return s;
  }

  std::unique_ptr<Stmt> parse_filter_block() {
    const Token& t = advance();
    auto s = stmt(Stmt::Kind::filter_block, t);
    s->exprs.push_back(parse_filters(nullptr, true));
    s->body = statements({"endfilter"});
    advance();
    return s;
  }

  // "(a, b=default)" of a macro or a call block.
  void parse_signature(Stmt& s) {
    expect_op("(");
    while (!is_op(")")) {
      if (!s.params.empty()) expect_op(",");
      s.params.push_back(expect_name().text);
      if (skip_op("=")) {
        s.defaults.push_back(parse_expression());
      } else if (!s.defaults.empty()) {
        error("non-default argument follows default argument");
      }
    }
    expect_op(")");
  }

  // A body of its own (a macro's, a call block's): break and continue do not reach out of it,
  // and whether it names `caller` is recorded.
  Body callable_body(Stmt& s, const char* end) {
    const int saved = loops_;
    const bool saved_caller = names_caller_;
    loops_ = 0;
    names_caller_ = false;
    Body body = statements({end});
    s.uses_caller = names_caller_;
    loops_ = saved;
    names_caller_ = saved_caller;
    advance();
    return body;
  }

  std::unique_ptr<Stmt> parse_macro() {
    const Token& t = advance();
    auto s = stmt(Stmt::Kind::macro, t);
    s->text = expect_name().text;
    parse_signature(*s);
    s->body = callable_body(*s, "endmacro");
    return s;
  }

  std::unique_ptr<Stmt> parse_call_block() {
    const Token& t = advance();
    auto s = stmt(Stmt::Kind::call_block, t);
    if (is_op("(")) parse_signature(*s);
    ExprPtr call = parse_expression();
    if (call->kind != Expr::Kind::call) error("expected call", &t);
    s->exprs.push_back(std::move(call));
    s->body = callable_body(*s, "endcall");
    return s;
  }

  std::unique_ptr<Stmt> parse_with() {
    const Token& t = advance();
    auto s = stmt(Stmt::Kind::scope, t);
    while (cur().type != Token::Type::block_end) {
      if (!s->targets.empty()) expect_op(",");
      s->targets.push_back(parse_target(false, false, nullptr));
      expect_op("=");
      s->exprs.push_back(parse_expression());
    }
    s->body = statements({"endwith"});
    advance();
    return s;
  }

  // --- expressions ----------------------------------------------------------------------
  ExprPtr parse_expression(bool with_condition = true) {
    Depth depth(*this);
    return with_condition ? parse_condition() : parse_or();
  }

  ExprPtr parse_condition() {
    ExprPtr expr = parse_or();
    while (is_name("if")) {
      const Token& t = advance();
      auto c = node(Expr::Kind::condition, t);
      c->children.push_back(parse_or());
      c->children.push_back(std::move(expr));
      c->children.push_back(skip_name("else") ? parse_condition() : nullptr);
      expr = sized(std::move(c));
    }
    return expr;
  }

  ExprPtr binary(const Token& at, const std::string& op, ExprPtr left, ExprPtr right) {
    auto b = node(Expr::Kind::binary, at);
    b->name = op;
    b->children.push_back(std::move(left));
    b->children.push_back(std::move(right));
    return sized(std::move(b));
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (is_name("or")) {
      const Token& t = advance();
      left = binary(t, "or", std::move(left), parse_and());
    }
    return left;
  }

  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (is_name("and")) {
      const Token& t = advance();
      left = binary(t, "and", std::move(left), parse_not());
    }
    return left;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      const Token& t = advance();
      Depth depth(*this);
      auto n = node(Expr::Kind::unary, t);
      n->name = "not";
      n->children.push_back(parse_not());
      return sized(std::move(n));
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    const Token& start = cur();
    ExprPtr first = parse_math1();
    ExprPtr cmp;
    while (true) {
      std::string op;
      if (cur().type == Token::Type::op &&
          (cur().text == "==" || cur().text == "!=" || cur().text == "<" || cur().text == "<=" || cur().text == ">" ||
           cur().text == ">=")) {
        op = advance().text;
      } else if (is_name("in")) {
        advance();
        op = "in";
      } else if (is_name("not") && look().type == Token::Type::name && look().text == "in") {
        advance();
        advance();
        op = "notin";
      } else {
        break;
      }
      if (!cmp) {
        cmp = node(Expr::Kind::compare, start);
        cmp->children.push_back(std::move(first));
      }
      cmp->ops.push_back(op);
      cmp->children.push_back(parse_math1());
    }
    return cmp ? sized(std::move(cmp)) : std::move(first);
  }

  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token& t = advance();
      left = binary(t, t.text, std::move(left), parse_concat());
    }
    return left;
  }

  ExprPtr parse_concat() {
    const Token& start = cur();
    ExprPtr first = parse_math2();
    if (!is_op("~")) return first;
    auto c = node(Expr::Kind::concat, start);
    c->children.push_back(std::move(first));
    while (skip_op("~")) c->children.push_back(parse_math2());
    return sized(std::move(c));
  }

  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& t = advance();
      left = binary(t, t.text, std::move(left), parse_pow());
    }
    return left;
  }

  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (is_op("**")) {
      const Token& t = advance();
      left = binary(t, "**", std::move(left), parse_unary(true));
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    Depth depth(*this);
    ExprPtr n;
    if (is_op("-") || is_op("+")) {
      const Token& t = advance();
      n = node(Expr::Kind::unary, t);
      n->name = t.text;
      n->children.push_back(parse_unary(false));
      n = sized(std::move(n));
    } else {
      n = parse_primary();
    }
    n = parse_postfix(std::move(n));
    if (with_filter) n = parse_filter_expr(std::move(n));
    return n;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    if (t.type == Token::Type::name) {
      advance();
      auto n = node(Expr::Kind::constant, t);
      if (t.text == "true" || t.text == "True") {
        n->value = Value(true);
      } else if (t.text == "false" || t.text == "False") {
        n->value = Value(false);
      } else if (t.text == "none" || t.text == "None") {
        n->value = Value(None{});
      } else {
        n->kind = Expr::Kind::name;
        n->name = t.text;
        names_caller_ = names_caller_ || t.text == "caller";
      }
      return n;
    }
    if (t.type == Token::Type::string) {
      std::string s;
      while (cur().type == Token::Type::string) s += advance().text;
      auto n = node(Expr::Kind::constant, t);
      n->value = Value(std::move(s));
      return n;
    }
    if (t.type == Token::Type::integer || t.type == Token::Type::floating) {
      advance();
      auto n = node(Expr::Kind::constant, t);
      n->value = t.type == Token::Type::integer ? Value(t.integer) : Value(t.floating);
      return n;
    }
    if (is_op("(")) {
      advance();
      ExprPtr inner = parse_tuple(true, nullptr, true);
      expect_op(")");
      return inner;
    }
    if (is_op("[")) {
      advance();
      auto n = node(Expr::Kind::list, t);
      while (!is_op("]")) {
        if (!n->children.empty()) expect_op(",");
        if (is_op("]")) break;
        n->children.push_back(parse_expression());
      }
      expect_op("]");
      return sized(std::move(n));
    }
    if (is_op("{")) {
      advance();
      auto n = node(Expr::Kind::dict, t);
      while (!is_op("}")) {
        if (!n->children.empty()) expect_op(",");
        if (is_op("}")) break;
        n->children.push_back(parse_expression());
        expect_op(":");
        n->children.push_back(parse_expression());
      }
      expect_op("}");
      return sized(std::move(n));
    }
    error("unexpected '" + describe(t) + "'");
  }

  // Expressions separated by commas: a tuple, or the one expression when there is no comma.
  ExprPtr parse_tuple(bool with_condition, const char* extra_end = nullptr, bool parenthesized = false) {
    const Token& start = cur();
    auto tuple = node(Expr::Kind::tuple, start);
    bool is_tuple = false;
    while (true) {
      if (!tuple->children.empty()) expect_op(",");
      if (cur().type == Token::Type::variable_end || cur().type == Token::Type::block_end || is_op(")") ||
          (extra_end && is_name(extra_end)))
        break;
      tuple->children.push_back(parse_expression(with_condition));
      if (!is_op(",")) break;
      is_tuple = true;
    }
    if (!is_tuple) {
      if (!tuple->children.empty()) return std::move(tuple->children[0]);
      if (!parenthesized) error("Expected an expression, got '" + describe(cur()) + "'");
    }
    return sized(std::move(tuple));
  }

  ExprPtr parse_postfix(ExprPtr n) {
    while (true) {
      if (is_op(".")) {
        const Token& t = advance();
        const Token& attr = cur();
        if (attr.type == Token::Type::name) {
          advance();
          auto g = node(Expr::Kind::getattr, t);
          g->name = attr.text;
          g->children.push_back(std::move(n));
          n = sized(std::move(g));
        } else if (attr.type == Token::Type::integer) {
          advance();
          auto g = node(Expr::Kind::getitem, t);
          auto index = node(Expr::Kind::constant, attr);
          index->value = Value(attr.integer);
          g->children.push_back(std::move(n));
          g->children.push_back(std::move(index));
          n = sized(std::move(g));
        } else {
          error("expected name or number");
        }
      } else if (is_op("[")) {
        n = parse_subscript(std::move(n));
      } else if (is_op("(")) {
        n = parse_call(std::move(n));
      } else {
        return n;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr obj) {
    const Token& t = advance();
    std::vector<ExprPtr> args;
    ExprPtr slice;
    while (!is_op("]")) {
      if (!args.empty() || slice) expect_op(",");
      // An item, or a slice a:b:c with any part left out.
      ExprPtr first;
      if (!is_op(":")) {
        first = parse_expression();
        if (!is_op(":")) {
          args.push_back(std::move(first));
          continue;
        }
      }
      advance();
      auto s = node(Expr::Kind::slice, t);
      s->children.push_back(nullptr);  // the object, set below
      s->children.push_back(std::move(first));
      s->children.push_back(is_op(":") || is_op("]") || is_op(",") ? nullptr : parse_expression());
      if (skip_op(":")) {
        s->children.push_back(is_op("]") || is_op(",") ? nullptr : parse_expression());
      } else {
        s->children.push_back(nullptr);
      }
      slice = std::move(s);
    }
    expect_op("]");
    if (slice) {
      if (!args.empty()) refuse("a subscript mixing a slice and items", t);
      slice->children[0] = std::move(obj);
      return sized(std::move(slice));
    }
    if (args.empty()) error("expected subscript expression", &t);
    auto g = node(Expr::Kind::getitem, t);
    g->children.push_back(std::move(obj));
    if (args.size() == 1) {
      g->children.push_back(std::move(args[0]));
    } else {
      auto tuple = node(Expr::Kind::tuple, t);
      tuple->children = std::move(args);
      g->children.push_back(sized(std::move(tuple)));
    }
    return sized(std::move(g));
  }

  // "(" args ")" into n's children (after those it has) and kwargs.
  void parse_call_args(Expr& n) {
    const Token& open = cur();
    expect_op("(");
    bool need_comma = false;
    while (!is_op(")")) {
      if (need_comma) {
        expect_op(",");
        if (is_op(")")) break;
      }
      if (is_op("*") || is_op("**")) {
        // *args and **kwargs: kept as keywords "*" and "**", at most one each, in that order.
        const std::string star = advance().text;
        for (const auto& [key, _] : n.kwargs)
          if (key == "**" || key == star) error("invalid syntax for function call expression", &open);
        n.kwargs.emplace_back(star, parse_expression());
      } else if (cur().type == Token::Type::name && look().type == Token::Type::op && look().text == "=") {
        for (const auto& [key, _] : n.kwargs)
          if (key == "**") error("invalid syntax for function call expression", &open);
        std::string key = advance().text;
        advance();
        n.kwargs.emplace_back(std::move(key), parse_expression());
      } else {
        if (!n.kwargs.empty()) error("invalid syntax for function call expression", &open);
        n.children.push_back(parse_expression());
      }
      need_comma = true;
    }
    expect_op(")");
  }

  ExprPtr parse_call(ExprPtr callee) {
    auto c = node(Expr::Kind::call, cur());
    c->children.push_back(std::move(callee));
    parse_call_args(*c);
    return sized(std::move(c));
  }

  ExprPtr parse_filter_expr(ExprPtr n) {
    while (true) {
      if (is_op("|")) {
        n = parse_filters(std::move(n), false);
      } else if (is_name("is")) {
        n = parse_test(std::move(n));
      } else if (is_op("(")) {
        n = parse_call(std::move(n));
      } else {
        return n;
      }
    }
  }

  std::string dotted_name() {
    std::string name = expect_name().text;
    while (skip_op(".")) name += "." + expect_name().text;
    return name;
  }

  // One or more "| name(args)"; `inline_first`: the first has no "|" ({% filter name %}).
  ExprPtr parse_filters(ExprPtr n, bool inline_first) {
    while (is_op("|") || inline_first) {
      if (!inline_first) advance();
      inline_first = false;
      const Token& t = cur();
      const std::string name = dotted_name();
      auto f = node(Expr::Kind::filter, t);
      f->name = name;
      f->children.push_back(std::move(n));
      if (is_op("(")) parse_call_args(*f);
      n = sized(std::move(f));
    }
    return n;
  }

  ExprPtr parse_test(ExprPtr n) {
    const Token& is = advance();
    const bool negated = skip_name("not");
    const std::string name = dotted_name();
    auto test = node(Expr::Kind::test, is);
    test->name = name;
    test->children.push_back(std::move(n));
    if (is_op("(")) {
      parse_call_args(*test);
    } else if ((cur().type == Token::Type::name || cur().type == Token::Type::string ||
                cur().type == Token::Type::integer || cur().type == Token::Type::floating || is_op("(") ||
                is_op("[") || is_op("{")) &&
               !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) error("You cannot chain multiple tests with is");
      test->children.push_back(parse_postfix(parse_primary()));
    }
    test = sized(std::move(test));
    if (!negated) return test;
    auto n_ = node(Expr::Kind::unary, is);
    n_->name = "not";
    n_->children.push_back(std::move(test));
    return sized(std::move(n_));
  }

  const std::vector<Token>& t_;
  const std::string& origin_;
  std::size_t pos_ = 0;
  int depth_ = 0, loops_ = 0;
  bool names_caller_ = false;
  std::vector<std::vector<const char*>> looking_for_;
};

}  // namespace

Body parse(const std::vector<Token>& tokens, const std::string& origin) { return Parser(tokens, origin).parse_template(); }

}  // namespace tessera::toolkit::jinja
