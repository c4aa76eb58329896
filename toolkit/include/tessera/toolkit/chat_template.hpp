#pragma once
/// Chat templates as Hugging Face transformers renders them: a Jinja interpreter for the
/// subset of Jinja that real chat templates use, with the environment of transformers'
/// `_compile_jinja_template` (jinja2's ImmutableSandboxedEnvironment, trim_blocks and
/// lstrip_blocks, the loopcontrols extension, the {% generation %} tag, its own `tojson`,
/// `raise_exception` and `strftime_now`), and the folder logic of `apply_chat_template`
/// (which template, which special tokens). A construct outside the subset is refused when
/// the template is parsed or the first time it is evaluated, naming its line and column;
/// it never renders differently from jinja2. A template is untrusted input: a render
/// budget refuses one that loops, nests or grows without bound. docs/tokenizers.md.
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/sdk/error.hpp"

namespace tessera::toolkit {

/// An error of a template: its syntax, a construct outside the subset, a failure while it
/// renders (a type error, an undefined value used), raise_exception, or the budget.
/// what() is "ORIGIN:LINE:COLUMN: MESSAGE"; message() the part after it.
class TemplateError : public sdk::Error {
 public:
  enum class Kind { syntax, unsupported, runtime, raised, budget };
  TemplateError(Kind kind, const std::string& origin, int line, int column, std::string message);
  ~TemplateError() override;
  Kind kind() const { return kind_; }
  int line() const { return line_; }
  int column() const { return column_; }
  /// For Kind::raised, the template's own message (raise_exception's argument).
  const std::string& message() const { return message_; }

 private:
  Kind kind_;
  int line_, column_;
  std::string message_;
};

/// What one render may spend. A chat template renders a conversation in thousands of steps;
/// the defaults refuse runaway loops in about a second.
struct RenderLimits {
  /// Statements, loop iterations and expression nodes evaluated.
  std::int64_t max_steps = 5'000'000;
  /// Bytes of the output, and of any one string or list a template builds.
  std::size_t max_bytes = 64u << 20;
  /// Nested macro calls and loops.
  int max_depth = 200;
  /// Stack the evaluator's recursion may take (nesting within nesting: macros calling macros
  /// inside deep expressions), so that a render fits a thread's stack.
  std::size_t max_stack_bytes = 1u << 20;
};

struct RenderOptions {
  RenderLimits limits;
  /// What strftime_now formats (transformers: datetime.now(), local time); nullopt: now.
  std::optional<std::chrono::system_clock::time_point> now;
};

/// A parsed Jinja template. Immutable after parsing; render() may run on many threads at once.
class JinjaTemplate {
 public:
  /// Parses `source`; `origin` names it in errors (a file, or "FILE (chat_template)").
  /// Raises TemplateError for a syntax error or a construct outside the subset.
  JinjaTemplate(std::string_view source, std::string origin);
  ~JinjaTemplate();
  JinjaTemplate(JinjaTemplate&&) noexcept;
  JinjaTemplate& operator=(JinjaTemplate&&) noexcept;

  /// Renders with the variables of `variables_json`, a JSON object (as jinja2's
  /// render(**variables)). Raises TemplateError, or sdk::Error when the JSON is not an object.
  std::string render(std::string_view variables_json, const RenderOptions& options = {}) const;
  const std::string& origin() const;

 private:
  friend class ChatTemplate;
  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

/// The chat template(s) and special tokens of a Hugging Face tokenizer folder.
class ChatTemplate {
 public:
  /// Reads DIR/tokenizer_config.json (`chat_template`: a string, or a list of {name,
  /// template}; the special tokens, strings or AddedToken objects), DIR/special_tokens_map.json
  /// where present (its tokens win, as transformers loads them), DIR/chat_template.jinja and
  /// DIR/additional_chat_templates/NAME.jinja (newer transformers' files, which win over the
  /// config's). Raises sdk::Error naming the file when there is no template or a file is bad.
  static ChatTemplate load(const std::filesystem::path& dir);
  /// The same from the files' contents; `files` maps a file name ("tokenizer_config.json",
  /// "special_tokens_map.json", "chat_template.jinja", "additional_chat_templates/x.jinja")
  /// to its bytes, `dir` names them in errors. For tests and the fuzz target.
  static ChatTemplate from_files(const std::map<std::string, std::string>& files, const std::string& dir);

  /// apply_chat_template(messages, tools=tools, documents=documents, add_generation_prompt=...,
  /// tokenize=False, **rest) of `conversation_json`: {"messages": [...]} with optional "tools",
  /// "documents" and any other key (passed to the template as a variable, as
  /// apply_chat_template passes its keyword arguments: e.g. Qwen3's enable_thinking). The
  /// template is "tool_use" when there are tools and the folder names one, else "default".
  std::string apply(std::string_view conversation_json, bool add_generation_prompt,
                    const RenderOptions& options = {}) const;

  /// The names of the templates ("default" for a single one).
  std::vector<std::string> names() const;
  /// The special tokens transformers passes to the template (bos_token, eos_token, ...), as JSON.
  const std::string& special_tokens_json() const;

 private:
  ChatTemplate() = default;
  std::map<std::string, std::shared_ptr<const JinjaTemplate>> templates_;
  std::string special_tokens_json_;
  std::string dir_;
};

}  // namespace tessera::toolkit
