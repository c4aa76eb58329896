#include "tessera/toolkit/chat_data.hpp"

#include <algorithm>
#include <string>

#include <nlohmann/json.hpp>

#include "tessera/sdk/error.hpp"

namespace tessera::toolkit {

namespace {

using json = nlohmann::json;

json parse_conversation(std::string_view conversation_json) {
  json conversation;
  try {
    conversation = json::parse(conversation_json);
  } catch (const json::exception& e) {
    TESSERA_FAIL("not a JSON object (", e.what(), ")");
  }
  TESSERA_CHECK(conversation.is_object() && conversation.contains("messages") && conversation["messages"].is_array(),
                "a conversation is {\"messages\": [{\"role\": ..., \"content\": ...}, ...]}");
  return conversation;
}

/// The conversation with only its first `count` messages, as JSON text.
std::string first_messages(json conversation, std::size_t count) {
  json& messages = conversation["messages"];
  messages.erase(messages.begin() + static_cast<std::ptrdiff_t>(count), messages.end());
  return conversation.dump();
}

/// How many of `ids` the rendering `prefix` of the whole text tokenizes to, checked to be a prefix
/// of them: the mask's boundary in tokens.
std::size_t tokens_of_prefix(const Tokenizer& tokenizer, const std::string& prefix, const std::vector<TokenId>& ids,
                             std::size_t message) {
  const std::vector<TokenId> head = tokenizer.encode(prefix, /*add_special_tokens=*/false);
  TESSERA_CHECK(head.size() <= ids.size() && std::equal(head.begin(), head.end(), ids.begin()), "message ", message,
                ": the tokenizer merges tokens across the boundary of this assistant message (its tokens rendered "
                "alone are not a prefix of the whole conversation's), so no loss mask follows; use --loss-on all");
  return head.size();
}

}  // namespace

ChatTokens encode_chat(const ChatTemplate& chat_template, const Tokenizer& tokenizer,
                       std::string_view conversation_json, ChatLoss loss) {
  const json conversation = parse_conversation(conversation_json);
  const std::string whole = chat_template.apply(conversation_json, /*add_generation_prompt=*/false);
  ChatTokens out;
  out.ids = tokenizer.encode(whole, /*add_special_tokens=*/false);
  out.labels.assign(out.ids.size(), loss == ChatLoss::all ? 1 : 0);
  const json& messages = conversation["messages"];
  for (std::size_t i = 0; i < messages.size(); ++i) {
    if (!messages[i].is_object() || messages[i].value("role", std::string()) != "assistant") continue;
    ++out.assistant_messages;
    if (loss == ChatLoss::all) continue;
    const std::string before = chat_template.apply(first_messages(conversation, i), /*add_generation_prompt=*/true);
    const std::string through = chat_template.apply(first_messages(conversation, i + 1), false);
    TESSERA_CHECK(whole.compare(0, before.size(), before) == 0 && whole.compare(0, through.size(), through) == 0 &&
                      before.size() <= through.size(),
                  "message ", i, ": the chat template renders the conversation up to this assistant message "
                  "differently once later messages follow (as templates that drop earlier turns' reasoning do), "
                  "so its span cannot be found by rendering prefix by prefix; use --loss-on all");
    const std::size_t begin = tokens_of_prefix(tokenizer, before, out.ids, i);
    const std::size_t end = tokens_of_prefix(tokenizer, through, out.ids, i);
    std::fill(out.labels.begin() + static_cast<std::ptrdiff_t>(begin),
              out.labels.begin() + static_cast<std::ptrdiff_t>(std::max(begin, end)), 1);
  }
  return out;
}

std::vector<TokenId> encode_chat_prompt(const ChatTemplate& chat_template, const Tokenizer& tokenizer,
                                        std::string_view conversation_json) {
  parse_conversation(conversation_json);
  return tokenizer.encode(chat_template.apply(conversation_json, /*add_generation_prompt=*/true),
                          /*add_special_tokens=*/false);
}

}  // namespace tessera::toolkit
