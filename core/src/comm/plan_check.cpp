#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "tessera/core/comm.hpp"
#include "tessera/sdk/error.hpp"

namespace tessera::core {

namespace {
// FNV-1a: the same on every rank and build (std::hash need not be).
std::int64_t stable_hash(const std::string& text) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return static_cast<std::int64_t>(h >> 1);
}
}  // namespace

void check_plan_agreement(Communicator& group, const std::vector<std::string>& entries, c10::Device device,
                          const std::string& owner, const std::string& item) {
  if (group.size() == 1) return;
  const auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  std::string all_text;
  for (const auto& e : entries) all_text += e + ";";
  at::Tensor mine = at::tensor({static_cast<std::int64_t>(entries.size()), stable_hash(all_text)}, opts.device(at::kCPU))
                        .to(device);
  at::Tensor all = at::empty({2 * group.size()}, opts);
  group.all_gather(all, mine, owner + " " + item + " plan check")->wait();
  all = all.cpu().view({group.size(), 2});
  std::int64_t most = 0;
  bool same = true;
  for (std::int64_t r = 0; r < group.size(); ++r) {
    most = std::max(most, all[r][0].item<std::int64_t>());
    same = same && all[r][1].item<std::int64_t>() == all[0][1].item<std::int64_t>();
  }
  if (same) return;
  // Every rank saw the mismatch, so every rank joins this second gather: per-unit hashes.
  at::Tensor each = at::zeros({most}, opts.device(at::kCPU));
  for (std::size_t i = 0; i < entries.size(); ++i) each[static_cast<std::int64_t>(i)] = stable_hash(entries[i]);
  at::Tensor every = at::empty({most * group.size()}, opts);
  group.all_gather(every, each.to(device), owner + " " + item + " plan comparison")->wait();
  every = every.cpu().view({group.size(), most});
  const auto count = static_cast<std::int64_t>(entries.size());
  for (std::int64_t i = 0; i < most; ++i)
    for (std::int64_t r = 0; r < group.size(); ++r) {
      if (every[r][i].item<std::int64_t>() == (i < count ? each[i].item<std::int64_t>() : 0)) continue;
      const std::string here = i < count ? "'" + entries[static_cast<std::size_t>(i)] + "'" : "nothing";
      TESSERA_FAIL(owner, ": the ranks planned different ", item, "s; the first difference is ", item, " #", i,
                   ": this rank (", group.rank(), " of its group) has ", here, ", rank ", r, " of the group has ",
                   every[r][i].item<std::int64_t>() == 0 ? "nothing" : "a different " + item,
                   "; every rank must build the same model with the same [strategy] settings (this rank's ", item,
                   "s: ", all_text, ")");
    }
  TESSERA_FAIL(owner, ": the ranks planned different ", item, "s (this rank: ", all_text, ")");
}

}  // namespace tessera::core
