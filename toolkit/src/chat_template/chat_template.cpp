// The public face of the interpreter (tessera/toolkit/chat_template.hpp), and the Hugging Face
// folder logic of transformers' apply_chat_template: which template, which variables.
#include "tessera/toolkit/chat_template.hpp"

#include <fstream>
#include <sstream>

#include "chat_template/errors.hpp"
#include "chat_template/lexer.hpp"
#include "chat_template/parser.hpp"
#include "chat_template/render.hpp"
#include "read_file.hpp"

namespace tessera::toolkit {
namespace {

std::string describe(TemplateError::Kind kind, const std::string& origin, int line, int column, const std::string& message) {
  std::string where = origin;
  if (line > 0) where += ":" + std::to_string(line) + ":" + std::to_string(column);
  return where + ": " + (kind == TemplateError::Kind::raised ? "the template raised an error: " : "") + message;
}

// transformers' SPECIAL_TOKENS_ATTRIBUTES, the names special_tokens_map passes to a template.
const char* const kSpecialTokens[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                      "pad_token", "cls_token", "mask_token", "additional_special_tokens"};

// A token as the config writes it: a string, or an AddedToken object {"content": ...}.
std::optional<std::string> token_text(const nlohmann::ordered_json& v, const std::string& file, const std::string& key) {
  if (v.is_null()) return std::nullopt;
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  TESSERA_FAIL(file, ": ", key, " is neither a string nor an AddedToken object with a \"content\" string");
}

nlohmann::ordered_json parse_json(const std::string& text, const std::string& file) {
  try {
    return nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    TESSERA_FAIL(file, " is not valid JSON: ", e.what());
  }
}

using detail::read_file;

jinja::Value converted(const nlohmann::ordered_json& j, const std::string& what) {
  try {
    return jinja::from_json(j);
  } catch (const jinja::Failure& f) {
    TESSERA_FAIL(what, ": ", f.message);
  }
}

}  // namespace

TemplateError::TemplateError(Kind kind, const std::string& origin, int line, int column, std::string message)
    : sdk::Error(describe(kind, origin, line, column, message)),
      kind_(kind),
      line_(line),
      column_(column),
      message_(std::move(message)) {}
TemplateError::~TemplateError() = default;

struct JinjaTemplate::Impl {
  jinja::Program program;
};

JinjaTemplate::JinjaTemplate(std::string_view source, std::string origin) {
  auto impl = std::make_shared<Impl>();
  impl->program.origin = std::move(origin);
  impl->program.body = jinja::parse(jinja::tokenize(source, impl->program.origin), impl->program.origin);
  impl_ = std::move(impl);
}
JinjaTemplate::~JinjaTemplate() = default;
JinjaTemplate::JinjaTemplate(JinjaTemplate&&) noexcept = default;
JinjaTemplate& JinjaTemplate::operator=(JinjaTemplate&&) noexcept = default;

const std::string& JinjaTemplate::origin() const { return impl_->program.origin; }

std::string JinjaTemplate::render(std::string_view variables_json, const RenderOptions& options) const {
  const auto j = parse_json(std::string(variables_json), "the variables of " + origin());
  TESSERA_CHECK(j.is_object(), "the variables of ", origin(), " must be a JSON object");
  std::vector<std::pair<std::string, jinja::Value>> variables;
  for (const auto& [key, value] : j.items()) variables.emplace_back(key, converted(value, "the variable " + key));
  return jinja::render(impl_->program, variables, options);
}

ChatTemplate ChatTemplate::load(const std::filesystem::path& path) {
  const std::filesystem::path dir = std::filesystem::is_directory(path) ? path : path.parent_path();
  TESSERA_CHECK(std::filesystem::is_directory(dir), path.string(), " is not a tokenizer folder");
  std::map<std::string, std::string> files;
  for (const char* name : {"tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"})
    if (std::filesystem::is_regular_file(dir / name)) files[name] = read_file(dir / name);
  const auto extra = dir / "additional_chat_templates";
  if (std::filesystem::is_directory(extra))
    for (const auto& entry : std::filesystem::directory_iterator(extra))
      if (entry.is_regular_file() && entry.path().extension() == ".jinja")
        files["additional_chat_templates/" + entry.path().filename().string()] = read_file(entry.path());
  return from_files(files, dir.string());
}

ChatTemplate ChatTemplate::from_files(const std::map<std::string, std::string>& files, const std::string& dir) {
  ChatTemplate t;
  t.dir_ = dir;
  const std::string config_file = dir + "/tokenizer_config.json";
  nlohmann::ordered_json config = nlohmann::ordered_json::object();
  if (const auto it = files.find("tokenizer_config.json"); it != files.end()) {
    config = parse_json(it->second, config_file);
    TESSERA_CHECK(config.is_object(), config_file, " is not a JSON object");
  }
  const auto add = [&](const std::string& name, const std::string& source, const std::string& origin) {
    t.templates_[name] = std::make_shared<const JinjaTemplate>(source, origin);
  };
  if (config.contains("chat_template")) {
    const auto& ct = config["chat_template"];
    if (ct.is_string()) {
      add("default", ct.get<std::string>(), config_file + " (chat_template)");
    } else if (ct.is_array()) {
      for (const auto& entry : ct) {
        TESSERA_CHECK(entry.is_object() && entry.contains("name") && entry["name"].is_string() &&
                          entry.contains("template") && entry["template"].is_string(),
                      config_file, ": chat_template is a list, but not of {\"name\": ..., \"template\": ...} objects");
        const std::string name = entry["name"].get<std::string>();
        add(name, entry["template"].get<std::string>(), config_file + " (chat_template '" + name + "')");
      }
    } else {
      TESSERA_CHECK(ct.is_null(), config_file, ": chat_template is neither a string nor a list of named templates");
    }
  }
  for (const auto& [name, text] : files) {
    if (name == "chat_template.jinja") add("default", text, dir + "/" + name);
    const std::string prefix = "additional_chat_templates/";
    if (name.rfind(prefix, 0) == 0 && name.size() > prefix.size() + 6)
      add(name.substr(prefix.size(), name.size() - prefix.size() - 6), text, dir + "/" + name);
  }
  TESSERA_CHECK(!t.templates_.empty(), dir, " has no chat template: neither tokenizer_config.json's chat_template nor a chat_template.jinja");

  // The special tokens: tokenizer_config.json's, overridden by special_tokens_map.json's (as
  // from_pretrained loads them); special_tokens_map passes those that are not empty.
  std::map<std::string, nlohmann::ordered_json> raw;
  for (const char* key : kSpecialTokens)
    if (config.contains(key)) raw[key] = config[key];
  if (const auto it = files.find("special_tokens_map.json"); it != files.end()) {
    const auto map = parse_json(it->second, dir + "/special_tokens_map.json");
    TESSERA_CHECK(map.is_object(), dir, "/special_tokens_map.json is not a JSON object");
    for (const char* key : kSpecialTokens)
      if (map.contains(key)) raw[key] = map[key];
  }
  nlohmann::ordered_json tokens = nlohmann::ordered_json::object();
  for (const char* key : kSpecialTokens) {
    if (!raw.count(key)) continue;
    const auto& v = raw[key];
    if (std::string(key) == "additional_special_tokens") {
      if (v.is_null()) continue;
      TESSERA_CHECK(v.is_array(), config_file, ": additional_special_tokens is not a list");
      nlohmann::ordered_json list = nlohmann::ordered_json::array();
      for (const auto& item : v)
        if (auto text = token_text(item, config_file, key)) list.push_back(*text);
      if (!list.empty()) tokens[key] = list;
    } else if (auto text = token_text(v, config_file, key); text && !text->empty()) {
      tokens[key] = *text;
    }
  }
  t.special_tokens_json_ = tokens.dump();
  return t;
}

std::vector<std::string> ChatTemplate::names() const {
  std::vector<std::string> out;
  for (const auto& [name, _] : templates_) out.push_back(name);
  return out;
}

const std::string& ChatTemplate::special_tokens_json() const { return special_tokens_json_; }

std::string ChatTemplate::apply(std::string_view conversation_json, bool add_generation_prompt,
                                const RenderOptions& options) const {
  const auto conversation = parse_json(std::string(conversation_json), "the conversation");
  TESSERA_CHECK(conversation.is_object(), "a conversation is a JSON object {\"messages\": [...]}, not ",
                conversation.type_name());
  TESSERA_CHECK(conversation.contains("messages") && conversation["messages"].is_array(),
                "a conversation needs \"messages\", a list");
  TESSERA_CHECK(!conversation.contains("add_generation_prompt"),
                "a conversation may not set add_generation_prompt (it is the command's option)");
  const bool has_tools = conversation.contains("tools") && !conversation["tools"].is_null();
  std::string name = has_tools && templates_.count("tool_use") ? "tool_use" : "default";
  TESSERA_CHECK(templates_.count(name), dir_, " has no default chat template; it names: ", sdk::join(names()));

  // render(messages=..., tools=..., documents=..., add_generation_prompt=..., **{special tokens, **kwargs}).
  std::vector<std::pair<std::string, jinja::Value>> variables;
  const auto set = [&](const std::string& key, jinja::Value v) {
    for (auto& [k, old] : variables)
      if (k == key) {
        old = std::move(v);
        return;
      }
    variables.emplace_back(key, std::move(v));
  };
  const auto special_tokens = nlohmann::ordered_json::parse(special_tokens_json_);
  for (const auto& [key, value] : special_tokens.items()) set(key, converted(value, key));
  for (const auto& [key, value] : conversation.items()) set(key, converted(value, "the conversation's " + key));
  if (!conversation.contains("tools")) set("tools", jinja::Value(jinja::None{}));
  if (!conversation.contains("documents")) set("documents", jinja::Value(jinja::None{}));
  set("add_generation_prompt", jinja::Value(add_generation_prompt));
  return jinja::render(templates_.at(name)->impl_->program, variables, options);
}

}  // namespace tessera::toolkit
