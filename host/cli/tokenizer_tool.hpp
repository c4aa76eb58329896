#pragma once
/// `tessera tokenizer train|encode|decode|info|bench`: train a SentencePiece tokenizer on text
/// files (SentencePiece's own trainer), and use any tokenizer the toolkit loads from the shell.
namespace tessera::host {

/// argv[0] is "tokenizer". Returns the exit code: 0, 1 on an error (the message names the
/// file), 2 on bad arguments.
int tokenizer_tool(int argc, char** argv);

}  // namespace tessera::host
