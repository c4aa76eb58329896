// libFuzzer: a chat template (untrusted: it comes with a downloaded model) parsed and rendered
// with a conversation that has a system prompt, tool calls and tools. The input is the
// template, optionally followed by a NUL and the variables as JSON. A tight render budget keeps
// each input fast; refusing with an error is fine, crashing or running away is a finding.
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string_view>

#include "tessera/toolkit/chat_template.hpp"

namespace {

constexpr std::string_view kVariables = R"({"messages": [
  {"role": "system", "content": "You are helpful."},
  {"role": "user", "content": "Weather in Oslo? \u00e9\ud83d\ude00"},
  {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}]},
  {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 7.5}"},
  {"role": "assistant", "content": "<think>easy</think>It is 7.5 degrees."}],
  "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
  "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>", "documents": null})";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const std::size_t nul = input.find('\0');
  const std::string_view source = input.substr(0, nul);
  const std::string_view variables = nul == std::string_view::npos ? kVariables : input.substr(nul + 1);
  tessera::toolkit::RenderOptions options;
  options.limits.max_steps = 200000;
  options.limits.max_bytes = 1 << 20;
  options.limits.max_depth = 64;
  options.now = std::chrono::system_clock::time_point(std::chrono::seconds(1725358830));
  try {
    const tessera::toolkit::JinjaTemplate t(source, "fuzz-input.jinja");
    (void)t.render(variables, options);
  } catch (const std::exception&) {
  }
  return 0;
}
