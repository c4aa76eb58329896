#pragma once
/// Token shards: what `tessera data prepare` writes and the `tokens` data plugin reads (nanoGPT's
/// flat uint16 files, Megatron's document index). A prepared directory holds
///   manifest.json        tokenizer (name, kind, checksum), vocab_size, dtype, eos_id, the shards
///   shard_NNNNN.bin      the token ids, a flat little-endian array of dtype (uint16 or uint32)
///   shard_NNNNN.idx      documents + 1 little-endian uint64 token offsets: document d is [o[d], o[d+1])
///   shard_NNNNN.mask     (chat data, manifest version 2) one byte per token: 1 where the token is a
///                        label the loss trains on (an assistant's), 0 where it is only context
/// Each shard file is written under a temporary name and renamed, the token file last, and the
/// manifest is written (the same way) after every shard: a killed prepare never leaves a shard
/// that a reader loads.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "tessera/toolkit/tokenizer.hpp"

namespace tessera::toolkit {

enum class TokenDtype { uint16, uint32 };

/// The narrowest dtype that holds every id below `vocab_size`.
TokenDtype dtype_for(std::int64_t vocab_size);
std::size_t dtype_bytes(TokenDtype dtype);
const char* to_string(TokenDtype dtype);

struct ShardInfo {
  std::string file;          ///< token ids, relative to the prepared directory
  std::int64_t tokens = 0;
  std::int64_t documents = 0;
  std::string offsets_file;  ///< the document offsets, relative to the prepared directory
  std::string xxh64;         ///< XXH64 (seed 0) of `file`, 16 hex digits
  std::string offsets_xxh64; ///< of `offsets_file`
  std::string mask_file;     ///< the loss mask (one byte per token), relative; empty: every token trains
  std::string mask_xxh64;    ///< of `mask_file`
};

struct TokenManifest {
  std::string tokenizer_name;   ///< the tokenizer file's name (e.g. "tokenizer.model")
  std::string tokenizer_kind;   ///< Tokenizer::kind(): "sentencepiece", "huggingface"
  std::string tokenizer_xxh64;  ///< of the tokenizer file: tells a different tokenizer apart
  std::int64_t vocab_size = 0;
  TokenDtype dtype = TokenDtype::uint16;
  std::int64_t eos_id = -1;     ///< appended after every document of text (not of chat: its template ends turns)
  std::string content = "text"; ///< "text" (documents) or "chat" (conversations through a chat template)
  std::vector<ShardInfo> shards;

  /// Whether the shards carry a loss mask (then every shard does).
  bool has_mask() const { return !shards.empty() && !shards.front().mask_file.empty(); }

  std::int64_t total_tokens() const;
  std::int64_t total_documents() const;
};

inline constexpr const char* kManifestName = "manifest.json";
/// Version 1: tokens and offsets; 2 adds "content" and the per-shard loss mask ("mask", "mask_xxh64").
inline constexpr int kManifestVersion = 2;

/// Reads `dir`/manifest.json; an sdk::Error names the file and the field at fault.
TokenManifest read_manifest(const std::filesystem::path& dir);
/// Writes `dir`/manifest.json through a temporary file and a rename.
void write_manifest(const std::filesystem::path& dir, const TokenManifest& manifest);

/// XXH64 (seed 0) of a file's bytes as 16 hex digits, read through a fixed buffer (never mapped:
/// checking a corpus does not grow the process's resident memory).
std::string xxh64_file(const std::filesystem::path& file);
std::string xxh64_hex(std::uint64_t hash);

/// Writes shard `name` (`name`.bin, `name`.idx, with `masked` also `name`.mask) under `dir` as its
/// documents arrive, so writing overlaps tokenizing: each file goes to a temporary name and is
/// flushed and renamed by finish(), the token file last, so a finished .bin means a finished
/// shard. A writer destroyed unfinished removes its temporaries.
class ShardWriter {
 public:
  ShardWriter(const std::filesystem::path& dir, const std::string& name, TokenDtype dtype, bool masked = false);
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  /// Appends documents: `tokens` holds them end to end and `ends[d]` is where document d ends in
  /// `tokens`; `mask` (a masked writer's, one 0/1 byte per token) which tokens are labels. Throws
  /// when an id does not fit the dtype.
  void append(const std::vector<TokenId>& tokens, const std::vector<std::uint64_t>& ends,
              const std::vector<std::uint8_t>& mask = {});
  ShardInfo finish();

 private:
  struct File;
  std::string name_;
  TokenDtype dtype_;
  std::unique_ptr<File> tokens_, offsets_, mask_;
  std::uint64_t written_tokens_ = 0;
  std::int64_t documents_ = 0;
  std::vector<char> buffer_;
};

/// A whole shard at once: `tokens` with documents delimited by `offsets` (offsets.front() == 0,
/// offsets.back() == tokens.size()).
ShardInfo write_shard(const std::filesystem::path& dir, const std::string& name, TokenDtype dtype,
                      const std::vector<TokenId>& tokens, const std::vector<std::uint64_t>& offsets);

/// A read-only MAP_SHARED memory map of a whole file: the ranks of a machine that map the same
/// file share its pages in the page cache.
class MappedFile {
 public:
  explicit MappedFile(const std::filesystem::path& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const std::uint8_t* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  const std::uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
};

/// The shards of a prepared directory, memory-mapped. Opening checks every shard's presence and
/// size against the manifest (a missing or truncated shard is an error naming the file); with
/// `verify`, also each file's checksum, that the document offsets are consistent and that every
/// id is below the vocabulary size, in one streaming pass (seconds per GB, before any step).
/// Reads are const and safe from several threads.
class TokenShards {
 public:
  TokenShards(const std::filesystem::path& dir, bool verify);
  ~TokenShards();

  const std::filesystem::path& dir() const { return dir_; }
  const TokenManifest& manifest() const { return manifest_; }
  std::int64_t shards() const { return static_cast<std::int64_t>(manifest_.shards.size()); }
  std::int64_t tokens(std::int64_t shard) const { return manifest_.shards[shard].tokens; }
  std::int64_t documents(std::int64_t shard) const { return manifest_.shards[shard].documents; }
  /// First token of document `d` of `shard` (d == documents(shard): the shard's end).
  std::int64_t document_start(std::int64_t shard, std::int64_t d) const;
  /// Copies `count` ids from token `begin` of `shard` into `out`; throws (naming the file) on an
  /// id at or above the vocabulary size.
  void read(std::int64_t shard, std::int64_t begin, std::int64_t count, std::int64_t* out) const;
  /// Copies `count` loss-mask bytes (1: a label) from token `begin` of `shard`; the manifest must
  /// have a mask (manifest().has_mask()).
  void read_mask(std::int64_t shard, std::int64_t begin, std::int64_t count, std::uint8_t* out) const;
  /// The path of shard `shard`'s token file, for messages.
  std::filesystem::path shard_path(std::int64_t shard) const;

 private:
  std::filesystem::path dir_;
  TokenManifest manifest_;
  std::vector<std::unique_ptr<MappedFile>> tokens_, offsets_, masks_;
};

}  // namespace tessera::toolkit
