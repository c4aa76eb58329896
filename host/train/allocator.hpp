#pragma once
// What the training process asks of its malloc (jemalloc, linked into the binary): keep the
// pages a step frees for the next step.

namespace tessera::host {

/// Freed pages stay with the process (jemalloc's dirty decay off), blocks above jemalloc's
/// oversize threshold included only when `oversize_blocks_too` (one-process jobs: see
/// allocator.cpp). Nothing under another malloc, or when MALLOC_CONF sets a decay (the
/// user's choice wins).
void keep_freed_pages(bool oversize_blocks_too);

/// Hands every page jemalloc holds free back to the kernel now (its arenas purged, this
/// thread's cache flushed). A launcher calls it before its ranks are forked from it: what its
/// checks freed would otherwise be resident in every rank.
void return_freed_pages();

}  // namespace tessera::host
