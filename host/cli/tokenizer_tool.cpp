#include "cli/tokenizer_tool.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/sdk/error.hpp"
#include "tessera/toolkit/chat_template.hpp"
#include "tessera/toolkit/tokenizer.hpp"

#include "cli/corpus_files.hpp"

namespace tessera::host {
namespace {
namespace fs = std::filesystem;

constexpr const char* kTokenizerUsage = R"(usage:
  tessera tokenizer train --input FILE|DIR... --vocab-size N --type bpe|unigram --output DIR
                          [--max-sentences N] [--character-coverage F] [--byte-fallback]
  tessera tokenizer encode --tokenizer T [--add-special-tokens] (--text STRING | FILE...)
  tessera tokenizer decode --tokenizer T [--skip-special-tokens] ID...
  tessera tokenizer info --tokenizer T
  tessera tokenizer bench --tokenizer T FILE...
  tessera tokenizer chat --tokenizer DIR --input CONVERSATIONS.jsonl [--add-generation-prompt] [--now TIME]

  train    trains a SentencePiece model (SentencePiece's own trainer) on the lines of the inputs
           (files, folders read recursively, quoted globs; hidden and binary files skipped, as
           `data prepare` reads them; lines holding only "%", the fortune-file record separator,
           are skipped) and writes DIR/tokenizer.model and
           DIR/tokenizer.vocab (its log in DIR/train.log). At most --max-sentences lines (default 200000), sampled
           uniformly, are used, so a large corpus trains in seconds.
  encode   prints the ids of --text, or of each FILE's whole content, one line of ids per input
  decode   prints the text of the ids
  info     prints the kind, vocabulary size, BOS/EOS/PAD ids and special tokens
  bench    encodes the files on one thread and prints MB/s and tokens/s
  chat     renders each line of CONVERSATIONS.jsonl, {"messages": [...]} with optional "tools",
           "documents" and template keywords (such as "enable_thinking": false), through the chat
           template of the Hugging Face folder DIR, as transformers' apply_chat_template(tokenize=False)
           renders it, and prints each as one JSON string per line. --add-generation-prompt ends each
           with the assistant's header; --now YYYY-MM-DDTHH:MM:SS fixes the local time the template's
           strftime_now sees (default: now), so that renders repeat.
  T is a SentencePiece tokenizer.model, a Hugging Face tokenizer.json, or a directory holding one.
)";

std::string read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  TESSERA_CHECK(in, "cannot read ", path.string());
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

/// Redirects this process's stderr (fd 2) to `file` for its lifetime.
class StderrTo {
 public:
  explicit StderrTo(const fs::path& file) {
    std::cerr.flush();
    const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    TESSERA_CHECK(fd >= 0, "cannot create ", file.string(), ": ", std::strerror(errno));
    saved_ = ::dup(STDERR_FILENO);
    ::dup2(fd, STDERR_FILENO);
    ::close(fd);
  }
  ~StderrTo() {
    std::cerr.flush();
    ::dup2(saved_, STDERR_FILENO);
    ::close(saved_);
  }
  StderrTo(const StderrTo&) = delete;
  StderrTo& operator=(const StderrTo&) = delete;

 private:
  int saved_ = -1;
};

// The training sentences: the input files' lines, without writing a merged copy of the corpus.
class Lines {
 public:
  explicit Lines(std::vector<fs::path> files) : files_(std::move(files)) {}
  std::optional<std::string_view> next() {
    while (true) {
      if (in_.is_open() && std::getline(in_, line_)) {
        if (!line_.empty() && line_.back() == '\r') line_.pop_back();
        if (line_.empty() || line_ == "%") continue;
        ++count_;
        return line_;
      }
      if (next_ == files_.size()) return std::nullopt;
      in_ = std::ifstream(files_[next_]);
      TESSERA_CHECK(in_, "cannot read ", files_[next_].string());
      ++next_;
    }
  }
  std::size_t count() const { return count_; }

 private:
  std::vector<fs::path> files_;
  std::size_t next_ = 0, count_ = 0;
  std::ifstream in_;
  std::string line_;
};

struct Options {
  std::string command, tokenizer, output, type, text;
  std::vector<std::string> inputs, positional;
  long vocab_size = 0, max_sentences = 200000;
  std::string character_coverage;
  bool byte_fallback = false, add_special = false, skip_special = false, has_text = false;
  bool add_generation_prompt = false;
  std::string now;
};

Options parse(const std::vector<std::string>& words) {
  Options o;
  const std::vector<std::string> commands{"train", "encode", "decode", "info", "bench", "chat"};
  for (std::size_t i = 0; i < words.size(); ++i) {
    const std::string& w = words[i];
    const auto value = [&]() -> std::string {
      TESSERA_CHECK(i + 1 < words.size(), w, " needs a value");
      return words[++i];
    };
    const auto number = [&](const std::string& s) -> long {
      try {
        std::size_t used = 0;
        const long n = std::stol(s, &used);
        if (used == s.size() && n > 0) return n;
      } catch (const std::exception&) {
      }
      TESSERA_FAIL(w, " needs a positive integer, not '", s, "'");
    };
    if (o.command.empty()) {
      TESSERA_CHECK(std::find(commands.begin(), commands.end(), w) != commands.end(), "unknown tokenizer command '", w,
                    "'", sdk::did_you_mean(w, commands), "; valid: ", sdk::join(commands));
      o.command = w;
    } else if (w == "--input") {
      o.inputs.push_back(value());
      while (i + 1 < words.size() && words[i + 1].rfind("--", 0) != 0) o.inputs.push_back(words[++i]);
    } else if (w == "--vocab-size") {
      o.vocab_size = number(value());
    } else if (w == "--max-sentences") {
      o.max_sentences = number(value());
    } else if (w == "--type") {
      o.type = value();
      TESSERA_CHECK(o.type == "bpe" || o.type == "unigram", "--type is bpe or unigram, not '", o.type, "'");
    } else if (w == "--output") {
      o.output = value();
    } else if (w == "--character-coverage") {
      o.character_coverage = value();
    } else if (w == "--byte-fallback") {
      o.byte_fallback = true;
    } else if (w == "--tokenizer") {
      o.tokenizer = value();
    } else if (w == "--text") {
      o.text = value();
      o.has_text = true;
    } else if (w == "--add-special-tokens") {
      o.add_special = true;
    } else if (w == "--skip-special-tokens") {
      o.skip_special = true;
    } else if (w == "--add-generation-prompt") {
      o.add_generation_prompt = true;
    } else if (w == "--now") {
      o.now = value();
    } else {
      TESSERA_CHECK(w.rfind("--", 0) != 0, "unknown option '", w, "' for tokenizer ", o.command);
      o.positional.push_back(w);
    }
  }
  TESSERA_CHECK(!o.command.empty(), "tokenizer needs a command");
  const bool train = o.command == "train", chat = o.command == "chat";
  TESSERA_CHECK(train || chat || o.inputs.empty(), "--input is for train and chat (encode and bench take FILE arguments)");
  TESSERA_CHECK(chat || (!o.add_generation_prompt && o.now.empty()), "--add-generation-prompt and --now are for chat");
  TESSERA_CHECK(train || (o.vocab_size == 0 && o.type.empty() && o.output.empty() && !o.byte_fallback &&
                          o.character_coverage.empty()),
                "--vocab-size, --type, --output, --byte-fallback and --character-coverage are for train");
  TESSERA_CHECK(o.command == "encode" || (!o.has_text && !o.add_special), "--text and --add-special-tokens are for encode");
  TESSERA_CHECK(o.command == "decode" || !o.skip_special, "--skip-special-tokens is for decode");
  if (train) {
    TESSERA_CHECK(!o.inputs.empty() && o.vocab_size > 0 && !o.type.empty() && !o.output.empty(),
                  "train needs --input, --vocab-size, --type and --output");
    TESSERA_CHECK(o.positional.empty(), "unexpected argument '", o.positional.front(), "'");
  } else if (chat) {
    TESSERA_CHECK(!o.tokenizer.empty(), "chat needs --tokenizer DIR");
    TESSERA_CHECK(o.inputs.size() == 1, "chat needs one --input CONVERSATIONS.jsonl");
    TESSERA_CHECK(o.positional.empty(), "unexpected argument '", o.positional.front(), "'");
  } else {
    TESSERA_CHECK(!o.tokenizer.empty(), o.command, " needs --tokenizer");
    TESSERA_CHECK(o.command != "encode" || o.has_text != !o.positional.empty(), "encode needs --text or FILEs (not both)");
    TESSERA_CHECK(o.command != "bench" || !o.positional.empty(), "bench needs FILEs");
    TESSERA_CHECK(o.command != "info" || o.positional.empty(), "unexpected argument '",
                  o.positional.empty() ? "" : o.positional.front(), "'");
  }
  return o;
}

void train(const Options& o) {
  std::int64_t skipped_binary = 0;
  const auto files = corpus_files(o.inputs, "--input", skipped_binary);
  fs::create_directories(o.output);
  std::vector<std::pair<std::string, std::string>> flags{
      {"model_prefix", (fs::path(o.output) / "tokenizer").string()},
      {"model_type", o.type},
      {"vocab_size", std::to_string(o.vocab_size)},
      {"input_sentence_size", std::to_string(o.max_sentences)},
      {"shuffle_input_sentence", "true"},
      {"byte_fallback", o.byte_fallback ? "true" : "false"},
  };
  if (!o.character_coverage.empty()) flags.emplace_back("character_coverage", o.character_coverage);
  Lines lines(files);
  const fs::path log = fs::path(o.output) / "train.log";
  {
    // SentencePiece's trainer logs hundreds of lines to stderr; they go to DIR/train.log (its
    // errors come back as exceptions either way).
    StderrTo to_log(log);
    toolkit::train_sentencepiece(flags, [&] { return lines.next(); });
  }
  const auto tokenizer = toolkit::load_tokenizer(fs::path(o.output) / "tokenizer.model");
  std::cout << "wrote " << (fs::path(o.output) / "tokenizer.model").string() << " (" << o.type << ", vocabulary "
            << tokenizer->vocab_size() << ", from " << lines.count() << " lines of " << files.size() << " file(s)"
            << (skipped_binary > 0 ? ", " + std::to_string(skipped_binary) + " binary file(s) skipped" : "")
            << "; SentencePiece's log: " << log.string() << ")\n";
}

void print_ids(const std::vector<toolkit::TokenId>& ids) {
  for (std::size_t i = 0; i < ids.size(); ++i) std::cout << (i ? " " : "") << ids[i];
  std::cout << "\n";
}

// --now: a local time, as datetime.now() would give it.
std::chrono::system_clock::time_point parse_now(const std::string& text) {
  std::tm tm{};
  const char* end = strptime(text.c_str(), "%Y-%m-%dT%H:%M:%S", &tm);
  TESSERA_CHECK(end && *end == '\0', "--now is YYYY-MM-DDTHH:MM:SS, not '", text, "'");
  tm.tm_isdst = -1;
  return std::chrono::system_clock::from_time_t(std::mktime(&tm));
}

void chat(const Options& o) {
  const auto templates = toolkit::ChatTemplate::load(o.tokenizer);
  toolkit::RenderOptions options;
  if (!o.now.empty()) options.now = parse_now(o.now);
  std::ifstream in(o.inputs[0], std::ios::binary);
  TESSERA_CHECK(in, "cannot read ", o.inputs[0]);
  std::size_t line_number = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    std::string rendered;
    try {
      rendered = templates.apply(line, o.add_generation_prompt, options);
    } catch (const sdk::Error& e) {
      TESSERA_FAIL(o.inputs[0], ":", line_number, ": ", e.what());
    }
    std::cout << nlohmann::json(rendered).dump() << "\n";
  }
}

int run(const Options& o) {
  if (o.command == "train") {
    train(o);
    return 0;
  }
  if (o.command == "chat") {
    chat(o);
    return 0;
  }
  const auto tokenizer = toolkit::load_tokenizer(o.tokenizer);
  if (o.command == "encode") {
    if (o.has_text) print_ids(tokenizer->encode(o.text, o.add_special));
    for (const auto& file : o.positional) print_ids(tokenizer->encode(read_all(file), o.add_special));
  } else if (o.command == "decode") {
    std::vector<toolkit::TokenId> ids;
    for (const auto& word : o.positional) {
      std::size_t used = 0;
      long id = -1;
      try {
        id = std::stol(word, &used);
      } catch (const std::exception&) {
      }
      TESSERA_CHECK(used == word.size() && id >= 0 && id < (1L << 31), "'", word, "' is not a token id");
      ids.push_back(static_cast<toolkit::TokenId>(id));
    }
    std::cout << tokenizer->decode(ids, o.skip_special) << "\n";
  } else if (o.command == "info") {
    const auto show = [](const std::optional<toolkit::TokenId>& id) { return id ? std::to_string(*id) : "none"; };
    std::cout << "kind: " << tokenizer->kind() << "\nvocab_size: " << tokenizer->vocab_size()
              << "\nbos_id: " << show(tokenizer->bos_id()) << "\neos_id: " << show(tokenizer->eos_id())
              << "\npad_id: " << show(tokenizer->pad_id()) << "\nspecial_tokens: " << sdk::join(tokenizer->special_tokens(), " ")
              << "\n";
  } else {  // bench
    std::vector<std::string> texts;
    std::size_t bytes = 0;
    for (const auto& file : o.positional) {
      texts.push_back(read_all(file));
      bytes += texts.back().size();
    }
    // Line by line, as `data prepare` feeds documents: a whole file at once would be one huge piece.
    std::vector<std::string> lines;
    for (const auto& text : texts) {
      std::istringstream in(text);
      for (std::string line; std::getline(in, line);) lines.push_back(line + "\n");
    }
    // Thread CPU time as well as wall time: on a busy machine the CPU figure is the one that
    // says what one core does.
    const auto cpu_seconds = [] {
      timespec now{};
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
      return now.tv_sec + now.tv_nsec * 1e-9;
    };
    std::size_t tokens = 0;
    const auto start = std::chrono::steady_clock::now();
    const double cpu_start = cpu_seconds();
    for (const auto& line : lines) tokens += tokenizer->encode(line).size();
    const double cpu = cpu_seconds() - cpu_start;
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::cout << tokenizer->kind() << ": " << bytes / 1e6 << " MB, " << lines.size() << " lines, " << tokens
              << " tokens: " << bytes / 1e6 / cpu << " MB/s per CPU second (" << bytes / 1e6 / wall
              << " MB/s wall), " << tokens / cpu << " tokens/s, one thread\n";
  }
  return 0;
}

}  // namespace

int tokenizer_tool(int argc, char** argv) {
  const std::vector<std::string> words(argv + 1, argv + argc);
  for (const auto& w : words) {
    if (w == "--help" || w == "-h") return std::cout << kTokenizerUsage, 0;
  }
  Options options;
  try {
    options = parse(words);
  } catch (const sdk::Error& e) {
    std::cerr << "tessera tokenizer: " << e.what() << "\n\n" << kTokenizerUsage;
    return 2;
  }
  try {
    return run(options);
  } catch (const std::exception& e) {
    std::cerr << "tessera tokenizer " << options.command << ": error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace tessera::host
