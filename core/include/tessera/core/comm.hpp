#pragma once
/// Collectives over a group of ranks: the one place Tessera talks to c10d (Gloo on CPU,
/// NCCL on CUDA). Every method is collective over the group and returns at once with a
/// handle, so communication overlaps compute; `tag` names the collective ("forward
/// all-gather of blocks.3") for the timeout report.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "tessera/core/ledger.hpp"
#include "tessera/sdk/types.hpp"

namespace tessera::core {

/// An in-flight collective. wait() blocks until it is done (including any local
/// post-processing such as the sum of a reduce-scatter) and throws sdk::Error on failure.
class CommHandle {
 public:
  virtual ~CommHandle() = default;
  virtual void wait() = 0;
};
using CommHandlePtr = std::shared_ptr<CommHandle>;

/// Bytes this rank put on the wire, per collective kind (for tests and benchmarks).
struct CommStats {
  std::int64_t all_gather_bytes = 0;
  std::int64_t reduce_scatter_bytes = 0;
  std::int64_t all_reduce_bytes = 0;
  std::int64_t broadcast_bytes = 0;
  std::int64_t all_to_all_bytes = 0;
  std::int64_t calls = 0;
  std::int64_t shared_memory_calls = 0;  ///< of `calls`, those carried by shared memory (ranks of one host)
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual std::int64_t rank() const = 0;
  virtual std::int64_t size() const = 0;

  /// `output` (contiguous, numel = size() * input.numel()) := every rank's `input`
  /// concatenated in rank order. Any dtype, bf16 included.
  virtual CommHandlePtr all_gather(at::Tensor output, const at::Tensor& input, const std::string& tag) = 0;
  /// `output` (numel = input.numel() / size()) := `op` over ranks of this rank's chunk of
  /// `input` (contiguous, chunks in rank order). Low-precision inputs accumulate in fp32.
  virtual CommHandlePtr reduce_scatter(at::Tensor output, const at::Tensor& input, sdk::ReduceOp op,
                                       const std::string& tag) = 0;
  /// In place.
  virtual CommHandlePtr all_reduce(at::Tensor tensor, sdk::ReduceOp op, const std::string& tag) = 0;
  /// In place, from group rank `src`.
  virtual CommHandlePtr broadcast(at::Tensor tensor, std::int64_t src, const std::string& tag) = 0;
  /// Equal splits: chunk r of `input` goes to rank r; chunk r of `output` comes from rank r.
  virtual CommHandlePtr all_to_all(at::Tensor output, const at::Tensor& input, const std::string& tag) = 0;
  virtual void barrier(const std::string& tag) = 0;

  /// Splits the group: every rank calls with the same partition `groups` (lists of ranks of
  /// this group) and gets the communicator of the group it belongs to (with shared memory
  /// when CommSettings allow it now and that group's ranks share a host).
  virtual std::shared_ptr<Communicator> split(const std::vector<std::vector<std::int64_t>>& groups) = 0;

  virtual const CommStats& stats() const = 0;
};

using CommunicatorPtr = std::shared_ptr<Communicator>;

/// The local half of a reduce-scatter built on all-to-all: `rows` ([ranks, chunk], in rank
/// order) holds every rank's copy of this rank's chunk; writes `op` over the rows into
/// `output` (low-precision values accumulate in fp32). Every Communicator reduces through
/// it, so all of them sum in the same order.
void reduce_rows(const at::Tensor& rows, at::Tensor output, sdk::ReduceOp op);
/// Throws unless every rank of `group` passed the same `entries`, a plan of the collectives
/// to come (FSDP's units, DDP's gradient buckets), naming the first `item` that differs:
/// ranks with different plans would deadlock or exchange mismatched tensors. Collective over
/// `group` (tensors through `device`); `owner` ("FSDP", "DDP") starts the message.
void check_plan_agreement(Communicator& group, const std::vector<std::string>& entries, c10::Device device,
                          const std::string& owner, const std::string& item);
/// The settings beside ClusterInfo::collective_timeout_s ([launch] keys); the host sets them
/// before make_communicator.
struct CommSettings {
  double rendezvous_s = 300;   ///< joining the store and creating the process groups
  double checkpoint_s = 1800;  ///< collectives while a checkpoint is saved or loaded (LedgerPhase)
  /// CPU groups whose ranks share a host move all-gathers, reduce-scatters and all-reduces
  /// through shared memory (comm/shared_memory_channel.hpp); Gloo carries the rest.
  bool shared_memory = true;
  /// The network interface every Gloo group binds ([launch] interface; GLOO_SOCKET_IFNAME when
  /// empty; neither: the one that reaches the master).
  std::string interface;
};
void set_comm_settings(const CommSettings& settings);

/// Whether make_communicator gives this job's CPU groups the shared-memory channel, as far as
/// the cluster tells before any rank starts: more than one rank, all of them on this host, and
/// CommSettings::shared_memory (for `tessera plan`).
bool shared_memory_collectives(const sdk::ClusterInfo& cluster);
/// Bytes of the shared-memory segment a group of `ranks` maps (each rank touches all of it).
double shared_memory_segment_bytes(std::int64_t ranks);

/// Rendezvous through a TCPStore at cluster.master_addr:master_port and create the world
/// group: Gloo for CPU devices (with shared memory beside it when every rank is on this host,
/// see CommSettings), NCCL for CUDA devices (when built with CUDA). With
/// TORCHELASTIC_USE_AGENT_STORE=True (torchrun's default, and tessera's own launcher) every
/// rank joins the launcher's store as a client, under the prefix /worker/attempt_N;
/// otherwise rank 0 hosts it. Each collective waits up to the collective timeout (the
/// checkpoint timeout in a checkpoint phase); when one fails or times out, the error carries
/// the hang report built from every rank's ledger (see ledger.hpp).
/// `cuda_over_gloo` (a CUDA `device`): Gloo groups carry the CUDA tensors, each collective
/// staged through host memory (comm/host_staged_communicator.hpp) instead of NCCL, so that
/// several ranks can share one GPU; slow, for tests and for machines without NCCL.
CommunicatorPtr make_communicator(const sdk::ClusterInfo& cluster, const c10::Device& device,
                                  bool cuda_over_gloo = false);

/// What carries the collectives of the world group make_communicator made ("Gloo", "Gloo over
/// 10.0.0.5", "NCCL", "shared memory among the 2 ranks of this host ..."), then each split group
/// whose path differs ("; group ranks 0-1: shared memory among ..."); empty before it.
std::string world_transport();

/// The diagnosis made by this process's last failed collective, if any.
std::optional<Diagnosis> last_collective_failure();

/// Records this rank's failure in the rendezvous store (if this process joined one) so that
/// the launcher tells the root cause from its consequences, and returns the record: a
/// failure that came from a broken or timed-out collective is a consequence of the rank its
/// hang report blamed. Bounded: a store that does not answer is skipped.
FailureRecord report_failure(const std::string& message);

/// Called by the collective watchdog with its report just before it ends the process, in
/// place of report_failure (the host's reporter calls it and writes torchrun's error file).
void set_fatal_reporter(std::function<void(const std::string& message)> reporter);

/// The rendezvous store a launcher hosts for its ranks, as torchrun's agent does; the ranks
/// join it as clients (TORCHELASTIC_USE_AGENT_STORE=True, TORCHELASTIC_RESTART_COUNT=0).
class AgentStore {
 public:
  /// Hosts the store on `port` (0: a free port) when `server`, else connects to it.
  AgentStore(const std::string& host, std::int64_t port, bool server, double timeout_s);
  ~AgentStore();
  std::int64_t port() const;
  /// The failure records of ranks 0..world_size-1 found in the store (bounded).
  std::map<std::int64_t, FailureRecord> failures(std::int64_t world_size);
  /// The last published ledger of ranks 0..world_size-1 (nullopt: none), bounded.
  std::vector<std::optional<LedgerEntry>> ledgers(std::int64_t world_size);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// A one-rank group with no process group at all (single device and unit tests).
CommunicatorPtr make_local_communicator();

}  // namespace tessera::core
