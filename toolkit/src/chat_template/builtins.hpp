#pragma once
// What jinja2 and transformers give a chat template besides syntax: the filters and tests,
// the methods of str, dict and list, attribute and item access as the sandbox does them,
// and the globals (range, dict, namespace, raise_exception, strftime_now).
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "chat_template/value.hpp"

namespace tessera::toolkit::jinja {

/// The renderer's services the builtins use.
class Env {
 public:
  virtual ~Env() = default;
  /// Raises the budget error when a string or list of `bytes` would pass the limit.
  virtual void check_size(std::size_t bytes) = 0;
  /// Counts `n` steps of work (items a filter walks) against the budget.
  virtual void count_steps(std::int64_t n) = 0;
  virtual std::chrono::system_clock::time_point now() const = 0;
};

/// Whether `name` is a filter / test this interpreter implements.
bool has_filter(const std::string& name);
bool has_test(const std::string& name);
/// Whether jinja2 has it (so that a template using one we lack is told it is unsupported,
/// not that it does not exist).
bool is_jinja_filter(const std::string& name);
bool is_jinja_test(const std::string& name);

Value apply_filter(Env& env, const std::string& name, const Value& input, CallArgs& args);
bool apply_test(Env& env, const std::string& name, const Value& input, CallArgs& args);

/// obj.name as the sandbox resolves it: a method of str/dict/list, else obj["name"]; a
/// missing one is Undefined.
Value get_attribute(Env& env, const Value& obj, const std::string& name);
/// obj[key]: an index (negative from the end), a dict key, else obj's attribute `key`.
Value get_item(Env& env, const Value& obj, const Value& key);
/// obj[start:stop:step] (None where left out). A slice Python refuses raises, or is Undefined
/// when `folded` (jinja2 evaluated a literal's slice at compile time through getitem).
Value get_slice(Env& env, const Value& obj, const Value& start, const Value& stop, const Value& step, bool folded);

/// The items of iterating `v` (a dict's keys, a string's characters); consumes an iterator.
std::vector<Value> iterate(const Value& v);
/// len(v); raises for what has no length.
std::int64_t length(const Value& v);

/// The global of `name` (range, dict, namespace, raise_exception, strftime_now), or Undefined.
Value global(Env& env, const std::string& name);

/// Binary operators: + - * / // % ** and the comparisons == != < <= > >= in notin.
Value binary_op(Env& env, const std::string& op, const Value& a, const Value& b);
bool compare_op(const std::string& op, const Value& a, const Value& b);

/// A string value, checked against the budget.
Value make_string(Env& env, std::string s, bool markup = false);

}  // namespace tessera::toolkit::jinja
