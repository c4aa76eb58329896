#pragma once
/// `tessera tokenizer train|encode|decode|info|bench|chat`: train a SentencePiece tokenizer on text
/// files (SentencePiece's own trainer), use any tokenizer the toolkit loads from the shell, and
/// render conversations through a Hugging Face folder's chat template.
namespace tessera::host {

/// argv[0] is "tokenizer". Returns the exit code: 0, 1 on an error (the message names the
/// file), 2 on bad arguments.
int tokenizer_tool(int argc, char** argv);

}  // namespace tessera::host
