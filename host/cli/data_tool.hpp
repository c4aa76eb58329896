#pragma once
/// `tessera data prepare --tokenizer T --input FILES|DIRS|GLOBS... --output DIR [--text-key KEY]
/// [--split file|blank-line|percent|line] [--jobs N] [--shard-size BYTES]`: tokenizes a corpus on
/// every core into token shards and a manifest (tessera/toolkit/token_shards.hpp), which the
/// `tokens` data plugin memory-maps. Rerunning it after an interruption skips finished shards
/// and writes byte-identical output.
namespace tessera::host {

/// argv[0] is "data". Returns the exit code: 0, 1 on bad input (the message names the file),
/// 2 on bad arguments.
int data_tool(int argc, char** argv);

}  // namespace tessera::host
