#pragma once
/// Conversations as training rows: rendered through the model's chat template, tokenized as
/// transformers' apply_chat_template(tokenize=True) tokenizes (the whole rendering, special tokens
/// parsed, none added), with a loss mask on what the assistant says. The mask is found by
/// rendering, never by guessing token ids: assistant message i spans from the rendering of the
/// messages before it with the generation prompt to the rendering of the messages through it, and
/// both renderings (and their tokens) must be prefixes of the whole one.
#include <cstdint>
#include <string_view>
#include <vector>

#include "tessera/toolkit/chat_template.hpp"
#include "tessera/toolkit/tokenizer.hpp"

namespace tessera::toolkit {

struct ChatTokens {
  std::vector<TokenId> ids;
  /// One byte per id: 1 where the id is a label the loss trains on.
  std::vector<std::uint8_t> labels;
  std::int64_t assistant_messages = 0;
};

enum class ChatLoss {
  assistant,  ///< only the assistant messages' tokens (their end-of-turn markup included)
  all,        ///< every token
};

/// `conversation_json`: {"messages": [...]} with optional "tools", "documents" and template keywords.
/// Raises sdk::Error (naming the message) when the template does not render the conversation prefix
/// by prefix, or the tokenizer merges tokens across a message's boundary, so that no mask follows.
ChatTokens encode_chat(const ChatTemplate& chat_template, const Tokenizer& tokenizer,
                       std::string_view conversation_json, ChatLoss loss);

/// The ids of a conversation rendered with the generation prompt (what the model continues).
std::vector<TokenId> encode_chat_prompt(const ChatTemplate& chat_template, const Tokenizer& tokenizer,
                                        std::string_view conversation_json);

}  // namespace tessera::toolkit
