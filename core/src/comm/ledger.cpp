#include "tessera/core/ledger.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <sstream>

#include "tessera/sdk/error.hpp"

namespace tessera::core {

namespace {

std::map<std::string, std::string> parse_fields(const std::string& text, const std::string& what) {
  std::map<std::string, std::string> fields;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    auto eq = line.find('=');
    TESSERA_CHECK(eq != std::string::npos, "malformed ", what, " record line '", line, "'");
    if (line.compare(0, eq, "message") == 0) {  // the rest, newlines included
      auto at = text.find("\nmessage=");
      fields["message"] = at == std::string::npos ? line.substr(eq + 1) : text.substr(at + 9);
      break;
    }
    fields[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return fields;
}

std::int64_t field_int(const std::map<std::string, std::string>& f, const std::string& key) {
  auto it = f.find(key);
  if (it == f.end() || it->second.empty()) return 0;
  try {
    return std::stoll(it->second);
  } catch (const std::exception&) {
    TESSERA_FAIL("malformed ledger field ", key, "='", it->second, "'");
  }
}

std::string field(const std::map<std::string, std::string>& f, const std::string& key) {
  auto it = f.find(key);
  return it == f.end() ? std::string() : it->second;
}

std::string one_line(const std::string& s) {
  std::string line = s.substr(0, s.find('\n'));
  return line.size() > 300 ? line.substr(0, 300) + "..." : line;
}

std::string where(const LedgerEntry& e) {
  std::string s = e.step >= 0 ? "at step " + std::to_string(e.step) : "before training";
  if (e.phase != "train" && !e.phase.empty()) s += " (" + e.phase + ")";
  return s;
}

std::string collective(std::int64_t seq, const std::string& tag) { return "#" + std::to_string(seq) + " " + tag; }

std::string last_collective(const LedgerEntry& e) {
  return e.issued > 0 ? "last collective " + collective(e.issued, e.issued_tag) : "no collective yet";
}

std::string ranks_list(const std::vector<std::int64_t>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

bool several_hosts(const std::vector<std::optional<LedgerEntry>>& ledgers) {
  std::string first;
  for (const auto& l : ledgers) {
    if (!l || l->host.empty()) continue;
    if (first.empty()) first = l->host;
    else if (l->host != first) return true;
  }
  return false;
}

struct State {
  std::mutex mutex;
  LedgerEntry entry;
};

State& state() {
  static State* s = [] {
    auto* created = new State;  // never destroyed: the publisher may read it during exit
    created->entry.pid = ::getpid();
    return created;
  }();
  return *s;
}

}  // namespace

std::string ranks_text(const std::vector<std::int64_t>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  bool contiguous = ranks.size() > 2;
  for (std::size_t i = 1; i < ranks.size() && contiguous; ++i) contiguous = ranks[i] == ranks[i - 1] + 1;
  if (contiguous || (ranks.size() == 2 && ranks[1] == ranks[0] + 1))
    return s + std::to_string(ranks.front()) + "-" + std::to_string(ranks.back());
  for (std::size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

std::string rank_name(std::int64_t rank, const std::vector<std::optional<LedgerEntry>>& ledgers) {
  std::string s = "rank " + std::to_string(rank);
  if (rank < 0 || rank >= static_cast<std::int64_t>(ledgers.size()) || !several_hosts(ledgers)) return s;
  const auto& l = ledgers[static_cast<std::size_t>(rank)];
  if (!l || l->host.empty()) return s;
  return s + " (node " + std::to_string(l->node) + ", " + l->host + ")";
}

std::string host_name() {
  char name[256] = {0};
  if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == 0) return "?";
  return name;
}

std::int64_t wall_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string LedgerEntry::serialize() const {
  std::ostringstream out;
  out << "rank=" << rank << "\npid=" << pid << "\npublished_ms=" << published_ms << "\nstep=" << step
      << "\nmicro_batch=" << micro_batch << "\nphase=" << phase << "\nissued=" << issued << "\nissued_tag=" << issued_tag
      << "\nwaiting=" << waiting << "\nwaiting_tag=" << waiting_tag << "\nwaiting_since_ms=" << waiting_since_ms
      << "\nerror_file=" << error_file << "\nhost=" << host << "\nnode=" << node << "\n";
  return out.str();
}

LedgerEntry LedgerEntry::parse(const std::string& text) {
  auto f = parse_fields(text, "ledger");
  LedgerEntry e;
  e.rank = field_int(f, "rank");
  e.pid = field_int(f, "pid");
  e.published_ms = field_int(f, "published_ms");
  e.step = field_int(f, "step");
  e.micro_batch = field_int(f, "micro_batch");
  e.phase = field(f, "phase");
  e.issued = field_int(f, "issued");
  e.issued_tag = field(f, "issued_tag");
  e.waiting = field_int(f, "waiting");
  e.waiting_tag = field(f, "waiting_tag");
  e.waiting_since_ms = field_int(f, "waiting_since_ms");
  e.error_file = field(f, "error_file");
  e.host = field(f, "host");
  e.node = field_int(f, "node");
  return e;
}

std::string FailureRecord::serialize() const {
  std::ostringstream out;
  std::string summary = root_summary;
  std::replace(summary.begin(), summary.end(), '\n', ' ');
  out << "rank=" << rank << "\ntime_ms=" << time_ms << "\nconsequence=" << (consequence ? 1 : 0) << "\nroot=" << root
      << "\nroot_summary=" << summary << "\nmessage=" << message;
  return out.str();
}

FailureRecord FailureRecord::parse(const std::string& text) {
  auto f = parse_fields(text, "failure");
  FailureRecord r;
  r.rank = field_int(f, "rank");
  r.time_ms = field_int(f, "time_ms");
  r.consequence = field_int(f, "consequence") != 0;
  r.root = field(f, "root").empty() ? -1 : field_int(f, "root");
  r.root_summary = field(f, "root_summary");
  r.message = field(f, "message");
  return r;
}

Diagnosis diagnose(std::int64_t me, const std::vector<std::optional<LedgerEntry>>& ledgers,
                   const std::map<std::int64_t, FailureRecord>& failures, std::int64_t now_ms, double stale_s,
                   const std::vector<std::int64_t>& exited) {
  const auto world = static_cast<std::int64_t>(ledgers.size());
  auto gone = [&](std::int64_t r) { return std::find(exited.begin(), exited.end(), r) != exited.end(); };
  auto stale = [&](std::int64_t r) {
    return r != me && ledgers[r] && static_cast<double>(now_ms - ledgers[r]->published_ms) > stale_s * 1000.0;
  };
  auto name = [&](std::int64_t r) { return rank_name(r, ledgers); };
  Diagnosis d;
  std::string root_text;
  // 1. the earliest failure a rank reported as its own
  const FailureRecord* first = nullptr;
  for (const auto& [rank, record] : failures)
    if (!record.consequence && rank != me && (first == nullptr || record.time_ms < first->time_ms)) first = &record;
  if (first != nullptr) {
    d.root = first->rank;
    d.root_reported = true;
    d.root_time_ms = first->time_ms;
    d.cause = "reported";
    root_text = name(first->rank) + " failed: " + one_line(first->message);
  }
  // 2. a rank whose process is gone (it cannot be stuck: it exited without a report)
  for (std::int64_t r : exited) {
    if (d.root >= 0 || r == me || failures.count(r)) continue;
    d.root = r;
    d.cause = "exited";
    root_text = name(r) + " exited " + (ledgers[r] ? where(*ledgers[r]) : std::string("before it published a ledger")) +
                " without a report (its process is gone)";
    if (ledgers[r]) d.root_time_ms = ledgers[r]->published_ms;
  }
  // 3. a rank that stopped responding (the most behind first): a whole node lost is named as the node
  for (std::int64_t r = 0; r < world && d.root < 0; ++r) {
    if (!stale(r) || failures.count(r)) continue;
    std::int64_t best = r;
    for (std::int64_t s = r + 1; s < world; ++s)
      if (stale(s) && !failures.count(s) && ledgers[s]->issued < ledgers[best]->issued) best = s;
    const LedgerEntry& e = *ledgers[best];
    d.root = best;
    d.root_time_ms = e.published_ms;
    d.cause = "lost";
    root_text = name(best) + " stopped responding " + where(e) + " (no heartbeat for " +
                std::to_string((now_ms - e.published_ms) / 1000) + " s; " + last_collective(e) +
                (e.waiting > 0 ? ", waiting at " + collective(e.waiting, e.waiting_tag) : "") + ")";
    if (several_hosts(ledgers)) {
      std::vector<std::int64_t> node_ranks;
      bool whole = true;
      for (std::int64_t s = 0; s < world; ++s) {
        if (!ledgers[s] || ledgers[s]->host != e.host || ledgers[s]->node != e.node) continue;
        node_ranks.push_back(s);
        whole = whole && s != me && (stale(s) || gone(s));
      }
      if (whole)
        root_text = "node " + std::to_string(e.node) + " (" + e.host + "): " + ranks_text(node_ranks) + " lost " +
                    where(e) + " (no heartbeat for " + std::to_string((now_ms - e.published_ms) / 1000) +
                    " s: the host is down or unreachable; " + last_collective(e) + ")";
    }
  }
  // 4. a rank that never published its ledger
  for (std::int64_t r = 0; r < world && d.root < 0; ++r) {
    if (r == me || ledgers[r] || failures.count(r)) continue;
    d.root = r;
    d.cause = "unpublished";
    root_text = "rank " + std::to_string(r) + " never reported where it is (not started, or the store is unreachable)";
  }
  // 5. a live rank outside any collective while others wait for a later one
  std::int64_t max_waiting = 0;
  for (std::int64_t r = 0; r < world; ++r)
    if (ledgers[r] && ledgers[r]->waiting > 0) max_waiting = std::max(max_waiting, ledgers[r]->waiting);
  for (std::int64_t r = 0; r < world && d.root < 0; ++r) {
    if (r == me || !ledgers[r] || stale(r) || failures.count(r) || gone(r)) continue;
    const LedgerEntry& e = *ledgers[r];
    if (e.waiting == 0 && e.issued < max_waiting) {
      d.root = r;
      d.cause = "stuck";
      root_text = name(r) + " is stuck outside any collective " + where(e) + " (" + last_collective(e) + ")";
    }
  }
  // 6. a rank waiting on an earlier collective than the others (they disagree on the order)
  for (std::int64_t r = 0; r < world && d.root < 0; ++r) {
    if (!ledgers[r] || stale(r) || failures.count(r) || gone(r)) continue;
    const LedgerEntry& e = *ledgers[r];
    if (e.waiting > 0 && e.waiting < max_waiting) {
      d.root = r;
      d.cause = "behind";
      root_text = name(r) + " is behind: it waits at " + collective(e.waiting, e.waiting_tag) + " " + where(e);
    }
  }

  // Where everyone else is: ranks waiting on the same collective together.
  std::map<std::pair<std::int64_t, std::string>, std::vector<std::int64_t>> waiting;
  std::vector<std::string> others;
  for (std::int64_t r = 0; r < world; ++r) {
    if (r == d.root) continue;
    auto f = failures.find(r);
    if (f != failures.end() && r != me) {
      others.push_back(name(r) + (f->second.consequence ? " failed as a consequence: " : " failed: ") +
                       one_line(f->second.message));
    } else if (gone(r) && r != me) {
      others.push_back(name(r) + " also exited " + (ledgers[r] ? where(*ledgers[r]) : std::string()));
    } else if (!ledgers[r]) {
      others.push_back("rank " + std::to_string(r) + ": no ledger");
    } else if (stale(r)) {
      others.push_back(name(r) + " also stopped responding " + where(*ledgers[r]));
    } else if (ledgers[r]->waiting > 0) {
      waiting[{ledgers[r]->waiting, ledgers[r]->waiting_tag}].push_back(r);
    } else {
      others.push_back(name(r) + " runs " + where(*ledgers[r]) + " (" + last_collective(*ledgers[r]) + ")");
    }
  }
  for (const auto& [key, ranks] : waiting)
    others.insert(others.begin(), ranks_list(ranks) + (ranks.size() == 1 ? " waits" : " wait") + " at " +
                                      collective(key.first, key.second) + " " + where(*ledgers[ranks[0]]));
  if (d.root >= 0 && d.root_time_ms == 0) d.root_time_ms = now_ms;
  if (d.root >= 0 && ledgers[d.root]) d.root_error_file = ledgers[d.root]->error_file;
  d.root_summary = root_text;
  d.text = root_text.empty() ? "no rank stands out" : root_text;
  for (const auto& o : others) d.text += "; " + o;
  return d;
}

LedgerEntry ledger_snapshot() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.entry;
}

void ledger_set_step(std::int64_t step, std::int64_t micro_batch) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.entry.step = step;
  s.entry.micro_batch = micro_batch;
  if (s.entry.phase == "setup") s.entry.phase = "train";
}

std::string ledger_phase() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.entry.phase;
}

bool is_checkpoint_phase(const std::string& phase) {
  return phase == "save_checkpoint" || phase == "load_checkpoint";
}

LedgerPhase::LedgerPhase(const std::string& phase) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  previous_ = s.entry.phase;
  s.entry.phase = phase;
}

LedgerPhase::~LedgerPhase() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.entry.phase = previous_;
}

namespace detail {

std::int64_t ledger_issue(const std::string& tag) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.entry.issued_tag = tag;
  return ++s.entry.issued;
}

void ledger_wait(std::int64_t seq, const std::string& tag) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.entry.waiting = seq;
  s.entry.waiting_tag = tag;
  s.entry.waiting_since_ms = wall_ms();
}

void ledger_done() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.entry.waiting = 0;
  s.entry.waiting_tag.clear();
}

void ledger_set_rank(std::int64_t rank, std::int64_t node) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.entry.rank = rank;
  s.entry.node = node;
  s.entry.host = host_name();
  if (const char* f = std::getenv("TORCHELASTIC_ERROR_FILE")) s.entry.error_file = f;
}

}  // namespace detail

}  // namespace tessera::core
