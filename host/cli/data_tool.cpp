#include "cli/data_tool.hpp"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/sdk/error.hpp"
#include "tessera/toolkit/chat_data.hpp"
#include "tessera/toolkit/chat_template.hpp"
#include "tessera/toolkit/token_shards.hpp"
#include "tessera/toolkit/tokenizer.hpp"

#include "cli/corpus_files.hpp"
#include "cli/prepare_pipeline.hpp"
#include "cli/trained_data.hpp"

namespace tessera::host {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr const char* kDataUsage = R"(usage:
  tessera data prepare --tokenizer T --input FILES|DIRS|GLOBS... --output DIR
                       [--text-key text] [--split file|blank-line|percent|line] [--jobs N]
                       [--shard-size 256M]
  tessera data prepare --format chat --tokenizer DIR --input CONVERSATIONS.jsonl --output DIR
                       [--loss-on assistant|all] [--max-length N] [--overflow truncate|drop]

  --tokenizer   a SentencePiece tokenizer.model, a Hugging Face tokenizer.json, or a folder with one
  --input       files, folders (read recursively; hidden and binary files skipped) or quoted globs;
                several after one --input, or --input repeated. *.jsonl / *.ndjson files are JSON
                Lines (one document per line, its text under --text-key); any other file is text
  --split       how a text file holds documents: the whole file (file, the default), records
                between blank lines (blank-line), between lines holding only `%` (percent, the
                fortune format), or one per line (line)
  --jobs        tokenizing threads (default: every core)
  --shard-size  input text per shard (K, M, G suffixes; default 256M)
  --format      text (the default: documents) or chat: each JSON line a conversation,
                {"messages": [{"role": ..., "content": ...}, ...]} with optional "tools", rendered
                through the chat template of the tokenizer's folder (tokenizer_config.json) as
                transformers' apply_chat_template renders and tokenizes it
  --loss-on     chat: which tokens the loss trains on: assistant (the default: what each assistant
                message adds to the rendering, its end-of-turn markup included) or all
  --max-length  chat: tokens a conversation may have (0, the default: any); a longer one is
                truncated to its first N tokens or dropped (--overflow; default truncate), and counted
Every text document gets the tokenizer's EOS id appended (a chat template ends its own turns). DIR receives manifest.json and
shard_NNNNN.bin (token ids) + shard_NNNNN.idx (document offsets); the `tokens` data plugin reads
it ([data] plugin = "tokens", path = "DIR"). Rerunning after an interruption skips finished shards.
)";

struct Settings {
  fs::path tokenizer, output;
  std::vector<std::string> inputs;
  std::string text_key = "text", split = "file";
  std::int64_t jobs = 0, shard_bytes = std::int64_t{256} << 20;
  std::string format = "text", loss_on = "assistant", overflow = "truncate";
  std::int64_t max_length = 0;
  bool chat() const { return format == "chat"; }
};

std::int64_t parse_size(const std::string& text) {
  std::size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    TESSERA_FAIL("--shard-size ", text, " is not a size (e.g. 256M)");
  }
  std::string suffix = text.substr(used);
  double scale = 1;
  if (suffix == "K" || suffix == "k") scale = 1 << 10;
  else if (suffix == "M" || suffix == "m") scale = 1 << 20;
  else if (suffix == "G" || suffix == "g") scale = 1 << 30;
  else TESSERA_CHECK(suffix.empty(), "--shard-size ", text, ": unknown suffix '", suffix, "' (K, M or G)");
  TESSERA_CHECK(value * scale >= 1, "--shard-size ", text, " must be positive");
  return static_cast<std::int64_t>(value * scale);
}

std::int64_t parse_count(const std::string& flag, const std::string& text) {
  std::size_t used = 0;
  long long value = -1;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
  }
  TESSERA_CHECK(used == text.size() && value >= 0, flag, " ", text, " is not a count (0, 1, 2, ...)");
  return value;
}

Settings parse(int argc, char** argv) {
  Settings s;
  TESSERA_CHECK(argc >= 2 && std::string(argv[1]) == "prepare", "unknown data command",
                argc >= 2 ? " '" + std::string(argv[1]) + "'" : std::string(), ": the one command is `data prepare`");
  std::set<std::string> given;
  for (int i = 2; i < argc; ++i) {
    const std::string flag = argv[i];
    given.insert(flag);
    auto value = [&]() -> std::string {
      TESSERA_CHECK(i + 1 < argc, flag, " needs a value");
      return argv[++i];
    };
    if (flag == "--tokenizer") s.tokenizer = value();
    else if (flag == "--output") s.output = value();
    else if (flag == "--text-key") s.text_key = value();
    else if (flag == "--split") s.split = value();
    else if (flag == "--jobs") s.jobs = parse_count(flag, value());
    else if (flag == "--shard-size") s.shard_bytes = parse_size(value());
    else if (flag == "--format") s.format = value();
    else if (flag == "--loss-on") s.loss_on = value();
    else if (flag == "--overflow") s.overflow = value();
    else if (flag == "--max-length") s.max_length = parse_count(flag, value());
    else if (flag == "--input") {
      s.inputs.push_back(value());
      while (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) s.inputs.push_back(argv[++i]);
    } else {
      TESSERA_FAIL("unknown option ", flag);
    }
  }
  TESSERA_CHECK(!s.tokenizer.empty(), "--tokenizer is required");
  TESSERA_CHECK(!s.inputs.empty(), "--input is required");
  TESSERA_CHECK(!s.output.empty(), "--output is required");
  const std::set<std::string> splits{"file", "blank-line", "percent", "line"};
  TESSERA_CHECK(splits.count(s.split), "--split ", s.split, ": valid: file, blank-line, percent, line");
  TESSERA_CHECK(s.format == "text" || s.format == "chat", "--format ", s.format, ": valid: text, chat");
  TESSERA_CHECK(s.loss_on == "assistant" || s.loss_on == "all", "--loss-on ", s.loss_on, ": valid: assistant, all");
  TESSERA_CHECK(s.overflow == "truncate" || s.overflow == "drop", "--overflow ", s.overflow, ": valid: truncate, drop");
  for (const std::string& flag : {"--loss-on", "--max-length", "--overflow"})
    TESSERA_CHECK(s.chat() || !given.count(flag), flag, " applies to --format chat only");
  for (const std::string& flag : {"--split", "--text-key"})
    TESSERA_CHECK(!s.chat() || !given.count(flag), flag, " applies to --format text only (a chat line is a conversation)");
  TESSERA_CHECK(s.jobs >= 0, "--jobs must be at least 1");
  if (s.jobs == 0) s.jobs = std::max(1u, std::thread::hardware_concurrency());
  return s;
}

bool is_json_lines(const fs::path& file) {
  const std::string ext = file.extension().string();
  return ext == ".jsonl" || ext == ".ndjson";
}

/// Calls `line(text)` for each line of `in` without its '\n', reading a block at a time (getline
/// and a string per line cost the reader more than the tokenizing threads can spare).
template <typename Line>
void for_each_line(std::istream& in, Line&& line) {
  std::vector<char> block(std::size_t{1} << 20);
  std::string carry;  // a line that crosses blocks
  while (in.read(block.data(), static_cast<std::streamsize>(block.size())) || in.gcount() > 0) {
    const char* p = block.data();
    const char* const end = p + in.gcount();
    while (p < end) {
      const auto* newline = static_cast<const char*>(std::memchr(p, '\n', static_cast<std::size_t>(end - p)));
      if (newline == nullptr) {
        carry.append(p, end);
        break;
      }
      if (carry.empty()) {
        line(std::string_view(p, static_cast<std::size_t>(newline - p)));
      } else {
        carry.append(p, newline);
        line(std::string_view(carry));
        carry.clear();
      }
      p = newline + 1;
    }
  }
  if (!carry.empty()) line(std::string_view(carry));
}

/// Calls `emit(text, line)` for every non-empty document of `file`, in order, with the line it
/// starts on (for messages).
void read_documents(const fs::path& file, const Settings& s,
                    const std::function<void(std::string_view, std::int64_t)>& emit) {
  std::ifstream in(file, std::ios::binary);
  TESSERA_CHECK(in, "cannot open ", file);
  if (s.chat()) {  // a conversation a line: parsed, rendered and checked by the encoder (chat_encoder)
    TESSERA_CHECK(is_json_lines(file), file.string(), ": --format chat reads JSON Lines (*.jsonl, *.ndjson), one ",
                  "conversation {\"messages\": [...]} a line");
    std::int64_t number = 0;
    for_each_line(in, [&](std::string_view line) {
      ++number;
      if (line.find_first_not_of(" \t\r") != std::string_view::npos) emit(line, number);
    });
    return;
  }
  if (is_json_lines(file)) {
    std::int64_t number = 0;
    for_each_line(in, [&](std::string_view line) {
      ++number;
      if (line.find_first_not_of(" \t\r") == std::string_view::npos) return;
      json j;
      try {
        j = json::parse(line);
      } catch (const json::exception& e) {
        TESSERA_FAIL(file.string(), ":", number, ": not a JSON value (", e.what(), ")");
      }
      if (!j.is_object() || !j.contains(s.text_key)) {
        std::vector<std::string> keys;
        if (j.is_object())
          for (auto it = j.begin(); it != j.end(); ++it) keys.push_back(it.key());
        TESSERA_FAIL(file.string(), ":", number, ": no \"", s.text_key, "\" key in this line",
                     keys.empty() ? std::string() : " (its keys: " + sdk::join(keys) + ")",
                     "; choose the key with --text-key");
      }
      TESSERA_CHECK(j.at(s.text_key).is_string(), file.string(), ":", number, ": \"", s.text_key,
                    "\" is not a string");
      const auto& text = j.at(s.text_key).get_ref<const std::string&>();
      if (!text.empty()) emit(text, number);
    });
    return;
  }
  if (s.split == "file") {
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!text.empty()) emit(text, 1);
    return;
  }
  std::string record;
  std::int64_t number = 0, first = 0;  // the line read, the record's first
  auto flush = [&] {
    while (!record.empty() && record.back() == '\n') record.pop_back();
    if (!record.empty()) emit(record, first);
    record.clear();
  };
  for_each_line(in, [&](std::string_view line) {
    ++number;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (s.split == "line") {
      if (!line.empty()) emit(line, number);
    } else if (s.split == "percent" ? line == "%" : line.find_first_not_of(" \t") == std::string_view::npos) {
      flush();
    } else {
      if (record.empty()) first = number;
      record += line;
      record += '\n';
    }
  });
  flush();
}

/// What the output was (or is being) prepared from: a rerun resumes only the same preparation.
json plan_of(const Settings& s, const std::vector<fs::path>& files, const std::string& tokenizer_hash) {
  json inputs = json::array();
  for (const auto& f : files) {
    const auto time = fs::last_write_time(f).time_since_epoch();
    inputs.push_back({{"path", fs::absolute(f).string()},
                      {"bytes", fs::file_size(f)},
                      {"mtime_ns", std::chrono::duration_cast<std::chrono::nanoseconds>(time).count()}});
  }
  json plan = {{"tokenizer_xxh64", tokenizer_hash}, {"text_key", s.text_key},    {"split", s.split},
               {"shard_bytes", s.shard_bytes},      {"inputs", inputs}};
  if (s.chat())  // absent for text: a text preparation of an earlier tessera still resumes
    plan["chat"] = {{"loss_on", s.loss_on}, {"max_length", s.max_length}, {"overflow", s.overflow}};
  return plan;
}

std::string human(double value) {
  char text[32];
  if (value >= 1e9) std::snprintf(text, sizeof text, "%.2fG", value / 1e9);
  else if (value >= 1e6) std::snprintf(text, sizeof text, "%.2fM", value / 1e6);
  else if (value >= 1e3) std::snprintf(text, sizeof text, "%.1fk", value / 1e3);
  else std::snprintf(text, sizeof text, "%.0f", value);
  return text;
}

/// Text per batch: small enough to keep every thread busy to the end of a shard, large enough
/// that handing batches over costs nothing.
constexpr std::int64_t kBatchBytes = std::int64_t{1} << 20;

class Preparation {
 public:
  Preparation(Settings settings, std::vector<fs::path> files, std::int64_t total_bytes)
      : s_(std::move(settings)), files_(std::move(files)), total_bytes_(total_bytes) {}

  int run() {
    tokenizer_ = toolkit::load_tokenizer(s_.tokenizer);
    const fs::path tokenizer_path = toolkit::tokenizer_file(s_.tokenizer).value_or(fs::path(s_.tokenizer));
    const std::optional<toolkit::TokenId> eos = tokenizer_->eos_id();
    TESSERA_CHECK(eos.has_value(), "--tokenizer ", s_.tokenizer, ": the tokenizer has no EOS token, which prepare ",
                  "appends after every document");
    manifest_.tokenizer_name = tokenizer_path.filename().string();
    manifest_.tokenizer_kind = tokenizer_->kind();
    manifest_.tokenizer_xxh64 = fs::is_regular_file(tokenizer_path) ? toolkit::xxh64_file(tokenizer_path) : "";
    manifest_.vocab_size = tokenizer_->vocab_size();
    manifest_.dtype = toolkit::dtype_for(manifest_.vocab_size);
    manifest_.eos_id = *eos;
    manifest_.content = s_.format;

    fs::create_directories(s_.output);
    const json plan = plan_of(s_, files_, manifest_.tokenizer_xxh64);
    const fs::path plan_path = s_.output / "prepare.json";
    std::error_code ec;
    if (fs::exists(plan_path, ec)) {
      json earlier;
      try {
        std::ifstream in(plan_path);
        earlier = json::parse(in);
      } catch (const json::exception&) {
      }
      json earlier_plan = earlier;
      if (earlier_plan.is_object()) earlier_plan.erase("finished");
      TESSERA_CHECK(earlier_plan == plan, s_.output, " holds a preparation of other inputs, tokenizer or settings (",
                    plan_path, "); nothing there was changed: choose another --output, or delete ", s_.output,
                    " to prepare again");
      resuming_ = true;
      read_records(earlier);
    } else {
      TESSERA_CHECK(!fs::exists(s_.output / toolkit::kManifestName, ec), s_.output, " already holds ",
                    toolkit::kManifestName, " from another preparation; nothing there was changed: choose another --output");
    }
    plan_ = plan;
    plan_["finished"] = json::object();
    for (const auto& [file, info] : recorded_) plan_["finished"][file] = to_json(info);
    write_plan();

    start_ = Clock::now();
    std::vector<std::string> sources;
    for (const auto& file : files_) sources.push_back(file.string());
    pool_ = std::make_unique<TokenizerPool>(s_.chat() ? chat_encoder() : text_encoder(), s_.jobs, std::move(sources));
    writer_ = std::make_unique<SerialWorker>();
    for (std::size_t f = 0; f < files_.size(); ++f)
      read_documents(files_[f], s_, [&](std::string_view doc, std::int64_t line) { add(doc, f, line); });
    if (in_shard_) end_shard();
    writer_->drain();
    writer_.reset();
    pool_.reset();
    manifest_.shards = written_;
    if (interactive_) std::cerr << "\n";
    TESSERA_CHECK(!manifest_.shards.empty(), "the inputs hold no document (", files_.size(), " file(s), all empty",
                  s_.split == "file" ? "" : " or only separators", "): nothing was written to ", s_.output);
    toolkit::write_manifest(s_.output, manifest_);
    for (const auto& entry : fs::directory_iterator(s_.output))  // what a killed run left half-written
      if (entry.path().extension() == ".tmp") fs::remove(entry.path(), ec);
    const double seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    std::cout << "prepared " << s_.output.string() << ": " << manifest_.total_documents() << " documents, "
              << manifest_.total_tokens() << " tokens (" << toolkit::to_string(manifest_.dtype) << ", vocab_size "
              << manifest_.vocab_size << ", EOS " << manifest_.eos_id << ") in " << manifest_.shards.size()
              << " shard(s)" << (skipped_ > 0 ? ", " + std::to_string(skipped_.load()) + " already finished" : "")
              << chat_counts()
              << "; " << human(static_cast<double>(tokenized_bytes_) / std::max(seconds, 1e-9)) << "B/s of text tokenized in "
              << seconds << " s with " << s_.jobs << " thread(s)\n";
    return 0;
  }

 private:
  DocumentEncoder text_encoder() const {
    return [this](std::string_view document, std::vector<toolkit::TokenId>& tokens, std::vector<std::uint8_t>&) {
      const std::vector<toolkit::TokenId> ids = tokenizer_->encode(document, /*add_special_tokens=*/false);
      tokens.insert(tokens.end(), ids.begin(), ids.end());
      tokens.push_back(manifest_.eos_id);
      return true;
    };
  }

  /// A conversation through the chat template, its loss mask, --max-length and --overflow.
  DocumentEncoder chat_encoder() {
    // load() takes the tokenizer file's folder, as --tokenizer may name the file.
    chat_template_ = std::make_unique<toolkit::ChatTemplate>(toolkit::ChatTemplate::load(s_.tokenizer));
    const auto loss = s_.loss_on == "all" ? toolkit::ChatLoss::all : toolkit::ChatLoss::assistant;
    return [this, loss](std::string_view line, std::vector<toolkit::TokenId>& tokens, std::vector<std::uint8_t>& mask) {
      toolkit::ChatTokens chat = toolkit::encode_chat(*chat_template_, *tokenizer_, line, loss);
      if (s_.max_length > 0 && static_cast<std::int64_t>(chat.ids.size()) > s_.max_length) {
        if (s_.overflow == "drop") {
          ++dropped_long_;
          return false;
        }
        ++truncated_;
        chat.ids.resize(static_cast<std::size_t>(s_.max_length));
        chat.labels.resize(chat.ids.size());
      }
      // Nothing to train on (no assistant message, or truncated before one): a row of it would
      // divide a zero loss by zero labels.
      if (std::find(chat.labels.begin(), chat.labels.end(), 1) == chat.labels.end()) {
        ++dropped_unlabelled_;
        return false;
      }
      tokens.insert(tokens.end(), chat.ids.begin(), chat.ids.end());
      mask.insert(mask.end(), chat.labels.begin(), chat.labels.end());
      return true;
    };
  }

  std::string chat_counts() const {
    if (!s_.chat()) return "";
    return "; conversations: " + std::to_string(truncated_.load()) + " truncated to --max-length, " +
           std::to_string(dropped_long_.load()) + " dropped as longer than it, " +
           std::to_string(dropped_unlabelled_.load()) + " dropped with no token to train on";
  }

  /// The reader's side: a document joins the current batch and shard.
  void add(std::string_view doc, std::size_t file, std::int64_t line) {
    if (!in_shard_) begin_shard();
    shard_text_ += static_cast<std::int64_t>(doc.size());
    if (!finished_earlier_) {
      if (!batch_) {
        batch_ = std::make_shared<Batch>();
        batch_->text.reserve(kBatchBytes + doc.size());
      }
      batch_->starts.push_back(batch_->text.size());
      batch_->origins.push_back({file, line});
      batch_->text += doc;
      if (static_cast<std::int64_t>(batch_->text.size()) >= kBatchBytes) submit_batch();
    }
    if (shard_text_ >= s_.shard_bytes) end_shard();
    if (interactive_ && Clock::now() - last_report_ > std::chrono::milliseconds(200)) report(false);
  }

  void begin_shard() {
    char name[32];
    std::snprintf(name, sizeof name, "shard_%05zu", shards_begun_++);
    const std::string shard = name;
    std::error_code ec;
    // Finished by an earlier run of this same plan (the .bin is renamed last), and still what
    // that run wrote: a shard changed since is prepared again, its checksum never re-recorded.
    finished_earlier_ = resuming_ && fs::is_regular_file(s_.output / (shard + ".bin"), ec) &&
                        fs::is_regular_file(s_.output / (shard + ".idx"), ec) && still_as_recorded(shard);
    in_shard_ = true;
    shard_text_ = 0;
    if (finished_earlier_) {
      writer_->post([this, info = recorded_.at(shard + ".bin")] {
        ++skipped_;
        add_written(info);
      });
    } else {
      writer_->post([this, shard] {
        shard_name_ = shard;
        shard_writer_ = std::make_unique<toolkit::ShardWriter>(s_.output, shard, manifest_.dtype, s_.chat());
      });
    }
  }

  /// The batch goes to the tokenizing threads, and the writer appends it once it is tokenized.
  void submit_batch() {
    std::shared_ptr<Batch> batch = std::move(batch_);
    pool_->submit(batch);
    writer_->post([this, batch] {
      try {
        pool_->wait(*batch);
      } catch (const std::exception& e) {
        TESSERA_FAIL("tokenizing ", shard_name_, ": ", e.what());
      }
      shard_writer_->append(batch->tokens, batch->ends, batch->mask);
      std::vector<toolkit::TokenId>().swap(batch->tokens);
      std::vector<std::uint8_t>().swap(batch->mask);
    });
  }

  void end_shard() {
    if (batch_) submit_batch();
    in_shard_ = false;
    if (finished_earlier_) {
      skipped_bytes_ += shard_text_;
      return;
    }
    writer_->post([this, bytes = shard_text_] {
      maybe_fail(shard_name_);
      const toolkit::ShardInfo info = shard_writer_->finish();
      shard_writer_.reset();
      plan_["finished"][info.file] = to_json(info);  // what a rerun checks this shard against
      write_plan();
      add_written(info);
      tokenized_bytes_ += bytes;
    });
  }

  /// What earlier runs recorded of the shards they finished: prepare.json's "finished" (written as
  /// each shard is), else a finished preparation's manifest.json (prepare.json without it).
  void read_records(const json& earlier) {
    if (earlier.contains("finished") && earlier.at("finished").is_object()) {
      for (const auto& [file, record] : earlier.at("finished").items()) {
        try {
          toolkit::ShardInfo info;
          info.file = record.at("file").get<std::string>();
          info.offsets_file = record.at("offsets_file").get<std::string>();
          info.tokens = record.at("tokens").get<std::int64_t>();
          info.documents = record.at("documents").get<std::int64_t>();
          info.xxh64 = record.at("xxh64").get<std::string>();
          info.offsets_xxh64 = record.at("offsets_xxh64").get<std::string>();
          info.mask_file = record.value("mask", std::string());
          info.mask_xxh64 = record.value("mask_xxh64", std::string());
          if (info.file == file) recorded_[file] = info;
        } catch (const json::exception&) {  // unreadable: that shard is prepared again
        }
      }
      return;
    }
    std::error_code ec;
    if (!fs::exists(s_.output / toolkit::kManifestName, ec)) return;
    try {
      for (const toolkit::ShardInfo& info : toolkit::read_manifest(s_.output).shards) recorded_[info.file] = info;
    } catch (const std::exception&) {  // damaged: every shard is prepared again
    }
  }

  /// Whether `shard`'s files hash to what was recorded when they were written.
  bool still_as_recorded(const std::string& shard) {
    const std::string bin = shard + ".bin", idx = shard + ".idx";
    auto it = recorded_.find(bin);
    if (it == recorded_.end() || it->second.offsets_file != idx) {
      std::cerr << "prepare: " << (s_.output / bin).string() << " has no checksum recorded by the run that wrote it: "
                << "prepared again\n";
      return false;
    }
    std::vector<std::pair<std::string, std::string>> files{{bin, it->second.xxh64}, {idx, it->second.offsets_xxh64}};
    if (s_.chat()) {
      std::error_code ec;
      if (it->second.mask_file != shard + ".mask" || !fs::is_regular_file(s_.output / it->second.mask_file, ec)) {
        std::cerr << "prepare: " << (s_.output / bin).string() << " has no loss mask recorded: prepared again\n";
        recorded_.erase(it);
        return false;
      }
      files.emplace_back(it->second.mask_file, it->second.mask_xxh64);
    }
    for (const auto& [file, recorded] : files) {
      const std::string now = toolkit::xxh64_file(s_.output / file);
      if (now == recorded) continue;
      std::cerr << "prepare: " << (s_.output / file).string() << " does not match the checksum recorded when it was "
                << "written (xxh64 " << recorded << ", now " << now << "): changed or damaged since, prepared again\n";
      recorded_.erase(it);
      return false;
    }
    return true;
  }

  static json to_json(const toolkit::ShardInfo& info) {
    json j = {{"file", info.file},          {"offsets_file", info.offsets_file}, {"tokens", info.tokens},
              {"documents", info.documents}, {"xxh64", info.xxh64},               {"offsets_xxh64", info.offsets_xxh64}};
    if (!info.mask_file.empty()) {
      j["mask"] = info.mask_file;
      j["mask_xxh64"] = info.mask_xxh64;
    }
    return j;
  }

  /// prepare.json, through a temporary file and a rename: a kill leaves the old one or the new.
  void write_plan() {
    const fs::path path = s_.output / "prepare.json", temp = s_.output / "prepare.json.tmp";
    {
      std::ofstream out(temp, std::ios::trunc);
      out << plan_.dump(2) << "\n";
      out.flush();
      TESSERA_CHECK(out.good(), "cannot write ", temp.string());
    }
    fs::rename(temp, path);
  }

  void add_written(const toolkit::ShardInfo& info) {
    {
      std::lock_guard<std::mutex> lock(written_mutex_);
      written_.push_back(info);
      documents_ += info.documents;
      tokens_ += info.tokens;
    }
    if (!interactive_) report(/*final_line=*/true);  // a line per shard in logs (the reader draws the live one)
  }

  /// TESSERA_FAULT_PREPARE=shard_00001: SIGKILL this process while that shard is half written
  /// (its offsets renamed into place, its tokens still a temporary file): tests of the rerun.
  void maybe_fail(const std::string& name) {
    const char* fault = std::getenv("TESSERA_FAULT_PREPARE");
    if (fault == nullptr || name != fault) return;
    std::ofstream(s_.output / (name + ".bin.tmp")) << "half-written";
    std::ofstream(s_.output / (name + ".idx")) << "half-written";
    std::cerr << "fault injection: prepare killed while writing " << name << "\n";
    ::raise(SIGKILL);
  }

  void report(bool final_line) {
    last_report_ = Clock::now();
    const double seconds = std::max(1e-9, std::chrono::duration<double>(last_report_ - start_).count());
    const double done = static_cast<double>(pool_->bytes() + skipped_bytes_.load());
    const double rate = done / seconds;
    const double left = std::max(0.0, static_cast<double>(total_bytes_) - done);
    std::ostringstream line;
    std::size_t shards = 0;
    double documents = 0, tokens = 0;
    {
      std::lock_guard<std::mutex> lock(written_mutex_);
      shards = written_.size();
      documents = static_cast<double>(documents_);
      tokens = static_cast<double>(tokens_);
    }
    line << "prepare: " << shards << " shard(s), " << human(documents) << " documents, " << human(tokens)
         << " tokens, " << human(rate) << "B/s, ";
    if (rate > 0) line << "ETA " << static_cast<std::int64_t>(left / rate) << " s";
    if (interactive_) std::cerr << "\r" << line.str() << "   " << std::flush;
    else if (final_line) std::cerr << line.str() << "\n";
  }

  Settings s_;
  std::vector<fs::path> files_;
  std::int64_t total_bytes_;
  std::unique_ptr<toolkit::Tokenizer> tokenizer_;
  std::unique_ptr<toolkit::ChatTemplate> chat_template_;  ///< --format chat's
  std::atomic<std::int64_t> truncated_{0}, dropped_long_{0}, dropped_unlabelled_{0};
  toolkit::TokenManifest manifest_;
  bool resuming_ = false;
  json plan_;  ///< prepare.json: the plan and the shards finished (the writer's, once shards are written)
  std::map<std::string, toolkit::ShardInfo> recorded_;  ///< earlier runs' finished shards (the reader's)
  bool interactive_ = ::isatty(STDERR_FILENO) != 0;
  Clock::time_point start_, last_report_;
  std::unique_ptr<TokenizerPool> pool_;
  std::unique_ptr<SerialWorker> writer_;  ///< declared after pool_: stopped before it
  // The reader's.
  std::shared_ptr<Batch> batch_;
  std::size_t shards_begun_ = 0;
  bool in_shard_ = false, finished_earlier_ = false;
  std::int64_t shard_text_ = 0;
  // The writer's.
  std::string shard_name_;
  std::unique_ptr<toolkit::ShardWriter> shard_writer_;
  std::atomic<std::int64_t> tokenized_bytes_{0}, skipped_bytes_{0}, skipped_{0};
  std::mutex written_mutex_;  ///< guards what the writer finished, read by the reader's progress line
  std::vector<toolkit::ShardInfo> written_;
  std::int64_t documents_ = 0, tokens_ = 0;
};

}  // namespace

int data_tool(int argc, char** argv) {
  Settings settings;
  try {
    if (argc >= 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) return std::cout << kDataUsage, 0;
    settings = parse(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "tessera data: " << e.what() << "\n\n" << kDataUsage;
    return 2;
  }
  try {
    std::int64_t skipped_binary = 0;
    std::vector<fs::path> files = corpus_files(settings.inputs, "--input", skipped_binary);
    std::int64_t total = 0;
    for (const auto& f : files) total += static_cast<std::int64_t>(fs::file_size(f));
    std::cerr << "prepare: " << files.size() << " file(s), " << human(static_cast<double>(total)) << "B"
              << (skipped_binary > 0 ? " (" + std::to_string(skipped_binary) + " binary file(s) skipped)" : "")
              << ", " << settings.jobs << " thread(s)\n";
    return Preparation(settings, std::move(files), total).run();
  } catch (const std::exception& e) {
    std::cerr << "tessera data: error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace tessera::host
