#pragma once
// The parsed template: jinja2's node types for the subset (jinja2/nodes.py names them the same).
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "chat_template/value.hpp"

namespace tessera::toolkit::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    constant,   // value
    name,       // name
    list,       // children
    tuple,      // children
    dict,       // children: key, value, key, value, ...
    getattr,    // children[0] . name
    getitem,    // children[0] [ children[1] ]
    slice,      // children[0] [ children[1] : children[2] : children[3] ] (null where omitted);
                // value true when jinja2 would fold it (a literal's slice)
    call,       // children[0] ( children[1..] , kwargs ); a kwarg named "*" or "**" is *args / **kwargs
    filter,     // children[0] | name ( children[1..] , kwargs ); children[0] null in a filter block
    test,       // children[0] is name ( children[1..] , kwargs )
    unary,      // name ("-", "+", "not") children[0]
    binary,     // children[0] name children[1]: + - * / // % ** and or
    concat,     // children joined by ~
    compare,    // children[0] ops[i] children[i + 1]: == != < <= > >= in notin
    condition,  // children[1] if children[0] else children[2] (null: undefined)
  };
  Kind kind;
  int line = 0, column = 0;
  int depth = 1;  // of the tree below (bounded by the parser: evaluation recurses over it)
  Value value;
  std::string name;
  std::vector<ExprPtr> children;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;
};

/// What `set`, `for` and `with` assign to: a name, a tuple of names to unpack, or ns.attr.
struct Target {
  enum class Kind { name, tuple, attribute };
  Kind kind = Kind::name;
  std::vector<std::string> names;  // one for name and attribute (the namespace), several for tuple
  std::string attribute;
};

struct Stmt;
using Body = std::vector<std::unique_ptr<Stmt>>;

struct Stmt {
  enum class Kind {
    data,        // text
    output,      // {{ expr }}
    if_,         // branches (test, body); else_body
    for_,        // target in exprs[0] if exprs[1] (may be null): body, else_body
    set,         // target = exprs[0]
    set_block,   // {% set target | filter %}body{% endset %}: exprs[0] the filter chain or null
    filter_block,// {% filter f %}body{% endfilter %}: exprs[0] the filter chain
    macro,       // name(params = defaults): body
    call_block,  // {% call(params = defaults) exprs[0] %}body{% endcall %}: the call gets caller=body
    break_,
    continue_,
    scope,       // {% with targets = exprs %}, and {% generation %} (transformers' tag, a call
                 // block in jinja2): the body in its own scope
  };
  Kind kind;
  int line = 0, column = 0;
  std::string text;
  std::vector<ExprPtr> exprs;
  Target target;
  std::vector<Target> targets;
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body body, else_body;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // of the last defaults.size() params
  bool uses_caller = false;       // a macro whose body names `caller` (it then takes caller=)
};

}  // namespace tessera::toolkit::jinja
