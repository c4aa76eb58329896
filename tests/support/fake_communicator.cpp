#include "fake_communicator.hpp"

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include <ATen/ATen.h>

#include "tessera/sdk/error.hpp"

namespace tessera::testing {

namespace {

using Clock = std::chrono::steady_clock;
using Partition = std::vector<std::vector<std::int64_t>>;

enum class Kind { all_gather, reduce_scatter, all_reduce, broadcast, all_to_all, barrier, split };

const char* name_of(Kind kind) {
  switch (kind) {
    case Kind::all_gather: return "all_gather";
    case Kind::reduce_scatter: return "reduce_scatter";
    case Kind::all_reduce: return "all_reduce";
    case Kind::broadcast: return "broadcast";
    case Kind::all_to_all: return "all_to_all";
    case Kind::barrier: return "barrier";
    case Kind::split: return "split";
  }
  return "?";
}

/// What every rank of a group must agree on for one collective.
struct Call {
  Kind kind;
  std::string tag;
  std::int64_t numel = 0;  // of the input
  at::ScalarType dtype = at::kFloat;
  std::int64_t arg = 0;  // the reduce op, or the broadcast root
  Partition partition;   // split only

  bool matches(const Call& other) const {
    return kind == other.kind && numel == other.numel && dtype == other.dtype && arg == other.arg &&
           partition == other.partition;
  }
  std::string describe() const {
    std::ostringstream out;
    out << name_of(kind) << " '" << tag << "'";
    if (kind == Kind::split) out << " into " << partition.size() << " group(s)";
    else if (kind != Kind::barrier) out << " of " << numel << " " << dtype << " element(s)";
    if (kind == Kind::broadcast) out << " from rank " << arg;
    if (kind == Kind::reduce_scatter || kind == Kind::all_reduce) out << " (reduce op " << arg << ")";
    return out.str();
  }
};

/// The threads of one run_fake_ranks call.
struct World {
  World(int n, std::chrono::seconds timeout) : done(static_cast<std::size_t>(n)), timeout(timeout) {}
  std::vector<std::atomic<bool>> done;  ///< by world rank: its body has returned or thrown
  std::atomic<bool> failed{false};      ///< some rank threw: everyone stops waiting
  std::chrono::seconds timeout;
};

struct Group;

/// One collective of a group, from the first rank that starts it until every rank has
/// completed it.
struct Op {
  Call call;
  std::int64_t first_rank = 0;
  std::vector<at::Tensor> inputs;  ///< by group rank, copied when the rank started
  std::vector<bool> arrived;
  std::int64_t count = 0, finished = 0;
  std::vector<std::shared_ptr<Group>> children;  ///< split only
};

/// State shared by the communicators of one group's ranks.
struct Group {
  Group(std::shared_ptr<World> world, std::vector<std::int64_t> members, std::string name)
      : world(std::move(world)), members(std::move(members)), name(std::move(name)) {}
  std::shared_ptr<World> world;
  std::vector<std::int64_t> members;  ///< world ranks, by group rank
  std::string name;
  std::mutex mutex;
  std::condition_variable arrived;
  std::map<std::uint64_t, Op> ops;  ///< by sequence number
};

class FakeHandle final : public core::CommHandle {
 public:
  explicit FakeHandle(std::function<void()> complete) : complete_(std::move(complete)) {}
  void wait() override {
    if (complete_) std::exchange(complete_, nullptr)();
  }

 private:
  std::function<void()> complete_;
};

class FakeCommunicator final : public core::Communicator {
 public:
  FakeCommunicator(std::shared_ptr<Group> group, std::int64_t rank) : group_(std::move(group)), rank_(rank) {}

  std::int64_t rank() const override { return rank_; }
  std::int64_t size() const override { return static_cast<std::int64_t>(group_->members.size()); }
  const core::CommStats& stats() const override { return stats_; }

  core::CommHandlePtr all_gather(at::Tensor output, const at::Tensor& input, const std::string& tag) override {
    TESSERA_CHECK(output.is_contiguous() && output.numel() == input.numel() * size(), "all_gather (", tag,
                  "): output must be contiguous with ", input.numel() * size(), " elements, has ", output.numel());
    count(stats_.all_gather_bytes, bytes_of(input) * (size() - 1));
    return start({Kind::all_gather, tag, input.numel(), input.scalar_type()}, flat_copy(input),
                 [output](const Op& op, std::int64_t) mutable {
                   at::Tensor out = output.view({-1});
                   for (std::size_t r = 0; r < op.inputs.size(); ++r)
                     out.narrow(0, static_cast<std::int64_t>(r) * op.call.numel, op.call.numel).copy_(op.inputs[r]);
                 });
  }

  core::CommHandlePtr reduce_scatter(at::Tensor output, const at::Tensor& input, sdk::ReduceOp op,
                                     const std::string& tag) override {
    TESSERA_CHECK(input.numel() == output.numel() * size(), "reduce_scatter (", tag, "): input has ", input.numel(),
                  " elements, expected ", output.numel() * size(), " (world ", size(), " x output)");
    count(stats_.reduce_scatter_bytes, bytes_of(output) * (size() - 1));
    return start({Kind::reduce_scatter, tag, input.numel(), input.scalar_type(), static_cast<std::int64_t>(op)},
                 flat_copy(input), [output, op](const Op& o, std::int64_t me) mutable {
                   // Every rank's copy of this rank's chunk, in rank order: what the all-to-all of
                   // the c10d reduce-scatter receives, reduced the same way.
                   const std::int64_t chunk = o.call.numel / static_cast<std::int64_t>(o.inputs.size());
                   std::vector<at::Tensor> rows;
                   for (const at::Tensor& in : o.inputs) rows.push_back(in.narrow(0, me * chunk, chunk));
                   core::reduce_rows(at::stack(rows), output, op);
                 });
  }

  core::CommHandlePtr all_reduce(at::Tensor tensor, sdk::ReduceOp op, const std::string& tag) override {
    count(stats_.all_reduce_bytes, bytes_of(tensor));
    return start({Kind::all_reduce, tag, tensor.numel(), tensor.scalar_type(), static_cast<std::int64_t>(op)},
                 flat_copy(tensor), [tensor, op](const Op& o, std::int64_t) mutable {
                   // As over Gloo: half types travel and reduce as fp32, mean divides the sum.
                   at::Tensor rows = at::stack(o.inputs);
                   if (rows.scalar_type() == at::kBFloat16 || rows.scalar_type() == at::kHalf) rows = rows.to(at::kFloat);
                   at::Tensor reduced = op == sdk::ReduceOp::max   ? std::get<0>(rows.max(0))
                                        : op == sdk::ReduceOp::min ? std::get<0>(rows.min(0))
                                                                   : rows.sum(0, false, rows.scalar_type());
                   if (op == sdk::ReduceOp::mean) reduced.div_(static_cast<double>(o.inputs.size()));
                   tensor.copy_(reduced.view(tensor.sizes()));
                 });
  }

  core::CommHandlePtr broadcast(at::Tensor tensor, std::int64_t src, const std::string& tag) override {
    TESSERA_CHECK(src >= 0 && src < size(), "broadcast (", tag, "): root ", src, " is not a rank of this group of ",
                  size());
    if (rank_ == src) count(stats_.broadcast_bytes, bytes_of(tensor));
    return start({Kind::broadcast, tag, tensor.numel(), tensor.scalar_type(), src},
                 rank_ == src ? flat_copy(tensor) : at::Tensor(), [tensor, src](const Op& o, std::int64_t me) mutable {
                   if (me != src) tensor.copy_(o.inputs[src].view(tensor.sizes()));
                 });
  }

  core::CommHandlePtr all_to_all(at::Tensor output, const at::Tensor& input, const std::string& tag) override {
    TESSERA_CHECK(input.numel() % size() == 0 && output.numel() == input.numel() && output.is_contiguous(),
                  "all_to_all (", tag, "): input (", input.numel(), " elements) must split evenly into ", size(),
                  " chunks and output must be contiguous with as many elements, has ", output.numel());
    count(stats_.all_to_all_bytes, bytes_of(input) / size() * (size() - 1));
    return start({Kind::all_to_all, tag, input.numel(), input.scalar_type()}, flat_copy(input),
                 [output](const Op& o, std::int64_t me) mutable {
                   const std::int64_t chunk = o.call.numel / static_cast<std::int64_t>(o.inputs.size());
                   at::Tensor out = output.view({-1});
                   for (std::size_t s = 0; s < o.inputs.size(); ++s)
                     out.narrow(0, static_cast<std::int64_t>(s) * chunk, chunk).copy_(o.inputs[s].narrow(0, me * chunk, chunk));
                 });
  }

  void barrier(const std::string& tag) override {
    ++stats_.calls;
    start({Kind::barrier, "barrier " + tag}, at::Tensor(), nullptr)->wait();
  }

  std::shared_ptr<core::Communicator> split(const Partition& groups) override {
    std::shared_ptr<core::Communicator> mine;
    start({Kind::split, "split", 0, at::kFloat, 0, groups}, at::Tensor(), [&](const Op& o, std::int64_t me) {
      for (std::size_t g = 0; g < groups.size(); ++g) {
        auto it = std::find(groups[g].begin(), groups[g].end(), me);
        if (it != groups[g].end()) mine = std::make_shared<FakeCommunicator>(o.children[g], it - groups[g].begin());
      }
    })->wait();
    TESSERA_CHECK(mine, "split(): rank ", rank_, " is in none of the ", groups.size(), " groups");
    return mine;
  }

 private:
  using Complete = std::function<void(const Op& op, std::int64_t me)>;

  static std::int64_t bytes_of(const at::Tensor& t) { return t.numel() * static_cast<std::int64_t>(t.element_size()); }
  static at::Tensor flat_copy(const at::Tensor& t) { return t.detach().reshape({-1}).clone(); }
  void count(std::int64_t& bytes, std::int64_t n) {
    bytes += n;
    ++stats_.calls;
  }

  static std::string who(const Group& g, std::int64_t group_rank) {
    return "rank " + std::to_string(group_rank) + " (world rank " + std::to_string(g.members[group_rank]) +
           ") of group " + g.name;
  }

  /// Deposits this rank's input for the group's next collective and returns the handle whose
  /// wait() completes it once every rank has started it.
  core::CommHandlePtr start(Call call, at::Tensor input, Complete complete) {
    const std::uint64_t seq = next_++;
    Group& g = *group_;
    {
      std::lock_guard<std::mutex> lock(g.mutex);
      Op& op = g.ops[seq];
      if (op.count == 0) {
        if (call.kind == Kind::split) op.children = make_children(call.partition, seq);
        op.call = call;
        op.first_rank = rank_;
        op.inputs.resize(g.members.size());
        op.arrived.assign(g.members.size(), false);
      }
      TESSERA_CHECK(op.call.matches(call), who(g, rank_), " called ", call.describe(), " as collective #", seq,
                    ", but ", who(g, op.first_rank), " called ", op.call.describe());
      op.inputs[rank_] = std::move(input);
      op.arrived[rank_] = true;
      ++op.count;
    }
    g.arrived.notify_all();
    auto group = group_;
    const std::int64_t me = rank_;
    return std::make_shared<FakeHandle>([group, seq, me, complete = std::move(complete)] {
      std::unique_lock<std::mutex> lock(group->mutex);
      Op& op = group->ops.at(seq);
      const auto deadline = Clock::now() + group->world->timeout;
      while (op.count < static_cast<std::int64_t>(group->members.size())) {
        TESSERA_CHECK(!group->world->failed, who(*group, me), ": gave up waiting for ", op.call.describe(),
                      ": another rank failed");
        for (std::size_t r = 0; r < op.arrived.size(); ++r)
          TESSERA_CHECK(op.arrived[r] || !group->world->done[group->members[r]], who(*group, me), " waits in ",
                        op.call.describe(), " (collective #", seq, "), but ", who(*group, static_cast<std::int64_t>(r)),
                        " returned without calling it");
        TESSERA_CHECK(Clock::now() < deadline, who(*group, me), ": ", op.call.describe(), " (collective #", seq,
                      ") timed out after ", group->world->timeout.count(), " s: some ranks never called it");
        group->arrived.wait_for(lock, std::chrono::milliseconds(20));
      }
      if (complete) complete(op, me);
      if (++op.finished == static_cast<std::int64_t>(group->members.size())) group->ops.erase(seq);
    });
  }

  std::vector<std::shared_ptr<Group>> make_children(const Partition& groups, std::uint64_t seq) const {
    std::vector<std::int64_t> seen(group_->members.size(), 0);
    for (const auto& members : groups)
      for (std::int64_t r : members) {
        TESSERA_CHECK(r >= 0 && r < size(), "split(): rank ", r, " is not in this group of ", size());
        TESSERA_CHECK(++seen[r] == 1, "split(): rank ", r, " is in more than one group");
      }
    std::vector<std::shared_ptr<Group>> children;
    for (std::size_t g = 0; g < groups.size(); ++g) {
      std::vector<std::int64_t> world_ranks;
      for (std::int64_t r : groups[g]) world_ranks.push_back(group_->members[r]);
      children.push_back(std::make_shared<Group>(group_->world, std::move(world_ranks),
                                                 group_->name + "/split" + std::to_string(seq) + "/" + std::to_string(g)));
    }
    return children;
  }

  std::shared_ptr<Group> group_;
  std::int64_t rank_;
  std::uint64_t next_ = 0;
  core::CommStats stats_;
};

}  // namespace

void run_fake_ranks(int world_size, const std::function<void(core::CommunicatorPtr world)>& body,
                    std::chrono::seconds timeout) {
  TESSERA_CHECK(world_size >= 1, "run_fake_ranks needs at least one rank, got ", world_size);
  auto world = std::make_shared<World>(world_size, timeout);
  std::vector<std::int64_t> ranks;
  for (int r = 0; r < world_size; ++r) ranks.push_back(r);
  auto group = std::make_shared<Group>(world, ranks, "world");
  std::vector<std::string> errors(static_cast<std::size_t>(world_size));
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r)
    threads.emplace_back([&, r] {
      try {
        body(std::make_shared<FakeCommunicator>(group, r));
      } catch (const std::exception& e) {
        errors[r] = e.what();
        world->failed = true;
      }
      world->done[r] = true;
    });
  for (auto& t : threads) t.join();
  std::vector<std::string> failures;
  for (int r = 0; r < world_size; ++r)
    if (!errors[r].empty()) failures.push_back("rank " + std::to_string(r) + ": " + errors[r]);
  TESSERA_CHECK(failures.empty(), "fake world of ", world_size, " rank(s) failed:\n  ", sdk::join(failures, "\n  "));
}

}  // namespace tessera::testing
