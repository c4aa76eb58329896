#pragma once
/// `tessera checkpoint inspect|verify|export PATH [--to FILE]`: what a checkpoint holds, whether
/// every byte is intact, and a copy other tools read (a safetensors file of the weights, or a
/// full .ckpt for torch.load). Works on full (.ckpt) and sharded (folder) checkpoints.
namespace tessera::host {

/// argv[0] is "checkpoint". Returns the exit code: 0, 1 on a damaged or unreadable
/// checkpoint (the message names the file), 2 on bad arguments.
int checkpoint_tool(int argc, char** argv);

}  // namespace tessera::host
