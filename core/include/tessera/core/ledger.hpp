#pragma once
/// Each rank's ledger (PyTorch's flight recorder, reduced to what a hang report needs): the
/// step and micro-batch, the phase, the last collective issued and the one it waits on,
/// plus a heartbeat. The communicator publishes it through the rendezvous store, so when a
/// collective fails or times out the detecting rank reads every rank's ledger and names the
/// stuck one. Failure records, also in the store, let the launcher blame the root cause.
/// This header is pure data and rules (no c10d): core/src/comm/ledger.cpp.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace tessera::core {

/// Where one rank is.
struct LedgerEntry {
  std::int64_t rank = 0;
  std::int64_t pid = 0;
  std::int64_t published_ms = 0;  ///< wall clock of the last publication: the heartbeat
  std::int64_t step = -1;         ///< optimizer step being computed (-1: before training)
  std::int64_t micro_batch = -1;
  std::string phase = "setup";    ///< "setup", "train", "save_checkpoint", "load_checkpoint", ...
  std::int64_t issued = 0;        ///< sequence number of the last collective issued (1-based)
  std::string issued_tag;
  std::int64_t waiting = 0;       ///< the collective it waits on now (0: none)
  std::string waiting_tag;
  std::int64_t waiting_since_ms = 0;
  std::string error_file;         ///< its TORCHELASTIC_ERROR_FILE, if any
  std::string host;               ///< its host name (reports name the host once a job spans several)
  std::int64_t node = 0;          ///< its node rank

  std::string serialize() const;
  /// Throws sdk::Error on a malformed record.
  static LedgerEntry parse(const std::string& text);
};

/// What a rank reported as it failed. A consequence is a failure caused by another rank's
/// (a collective that broke or timed out); `root` names that rank when it is known.
struct FailureRecord {
  std::int64_t rank = 0;
  std::int64_t time_ms = 0;
  bool consequence = false;
  std::int64_t root = -1;
  std::string message;
  std::string root_summary;  ///< a consequence: what its hang report said of the root ("node 1 (hostb): ranks 2-3 lost ...")

  std::string serialize() const;
  static FailureRecord parse(const std::string& text);
};

/// A hang or broken-collective report and the rank it blames (-1: unknown).
struct Diagnosis {
  std::int64_t root = -1;
  std::string text;
  std::string root_summary;        ///< the part of `text` about the root cause
  bool root_reported = false;      ///< the root wrote its own failure record
  std::int64_t root_time_ms = 0;   ///< when the root failed or was last heard of
  std::string root_error_file;     ///< the root's TORCHELASTIC_ERROR_FILE, from its ledger
  /// How the root was found: "reported" (its own failure record), "exited" (its process is gone),
  /// "lost" (no heartbeat), "unpublished", "stuck" (alive outside collectives), "behind"; empty: none.
  std::string cause;
};

/// Diagnoses a collective that failed or timed out on rank `me`: `ledgers[r]` is rank r's
/// ledger (nullopt: never published or unreadable), `failures` the failure records found.
/// A rank whose heartbeat is older than `stale_s` stopped responding. The root cause is the
/// earliest failure reported as its own, else a rank that stopped responding, else a rank
/// stuck outside collectives or behind the others. Example text: "rank 1 stopped responding
/// at step 20 (no heartbeat for 6 s; last collective #412 backward reduce-scatter of
/// blocks.3); rank 0 waits at #413 forward all-gather of blocks.2".
/// `exited` lists ranks known to be gone (their process exited: this host's ranks are checked
/// by pid), named as such before any other rule but a reported failure. Once the ledgers show
/// more than one host, every rank is named with its node and host ("rank 2 (node 1, hostb)"),
/// and a node whose every rank is lost or gone is named as the root ("node 1 (hostb): ranks
/// 2-3 lost at step 18").
Diagnosis diagnose(std::int64_t me, const std::vector<std::optional<LedgerEntry>>& ledgers,
                   const std::map<std::int64_t, FailureRecord>& failures, std::int64_t now_ms, double stale_s,
                   const std::vector<std::int64_t>& exited = {});

/// "rank 2" in a one-host job, "rank 2 (node 1, hostb)" once `ledgers` show several hosts.
std::string rank_name(std::int64_t rank, const std::vector<std::optional<LedgerEntry>>& ledgers);
/// "ranks 2-3", "ranks 0, 2", "rank 1".
std::string ranks_text(const std::vector<std::int64_t>& ranks);
/// This machine's host name (gethostname), "?" when it has none.
std::string host_name();

/// Milliseconds since the epoch (comparable across processes of one host).
std::int64_t wall_ms();

/// This process's own ledger. Updates are cheap (a mutex); the communicator publishes it.
LedgerEntry ledger_snapshot();
/// The trainer marks each step and micro-batch.
void ledger_set_step(std::int64_t step, std::int64_t micro_batch);
/// The current phase (see LedgerPhase).
std::string ledger_phase();

/// Sets the ledger's phase for a scope. Collectives issued while the phase is
/// "save_checkpoint" or "load_checkpoint" wait up to [launch] checkpoint_timeout_s instead of
/// collective_timeout_s.
class LedgerPhase {
 public:
  explicit LedgerPhase(const std::string& phase);
  ~LedgerPhase();
  LedgerPhase(const LedgerPhase&) = delete;
  LedgerPhase& operator=(const LedgerPhase&) = delete;

 private:
  std::string previous_;
};

/// Whether `phase` is a checkpoint save or load.
bool is_checkpoint_phase(const std::string& phase);

namespace detail {
/// Used by the communicator: a collective was issued (returns its sequence number), is
/// waited on, or finished waiting.
std::int64_t ledger_issue(const std::string& tag);
void ledger_wait(std::int64_t seq, const std::string& tag);
void ledger_done();
void ledger_set_rank(std::int64_t rank, std::int64_t node = 0);
}  // namespace detail

}  // namespace tessera::core
