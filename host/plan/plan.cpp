#include "plan/plan.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <string>

#include <c10/core/ScalarType.h>
#include <nlohmann/json.hpp>

namespace tessera::host {

std::string mb(double bytes) {
  char out[32];
  std::snprintf(out, sizeof(out), "%.0f MB", bytes / 1048576.0);
  return out;
}

namespace {

/// Bytes as a whole number: the plan's figures are estimates, not fractions of a byte.
std::int64_t whole(double bytes) { return std::llround(bytes); }

}  // namespace

double ring_bytes_sent(const std::string& kind, double bytes, std::int64_t group) {
  if (group <= 1) return 0;
  const double share = static_cast<double>(group - 1) / static_cast<double>(group);
  return (kind == "all_reduce" ? 2.0 : 1.0) * share * bytes;
}

double crossing_hosts_bytes(const std::string& kind, double data_bytes, std::int64_t world, std::int64_t local_ranks,
                            bool two_levels, bool cuda) {
  if (cuda) return -1;
  const auto n = static_cast<double>(world), per_host = static_cast<double>(local_ranks);
  const std::int64_t hosts = world / std::max<std::int64_t>(1, local_ranks);
  if (hosts <= 1) return 0;
  if (local_ranks <= 1) return ring_bytes_sent(kind, data_bytes, world);  // every rank its own host
  if (two_levels) return ring_bytes_sent(kind, data_bytes / per_host, hosts);
  if (kind == "reduce_scatter") return data_bytes / n * (n - per_host);
  return ring_bytes_sent(kind, data_bytes, world) * static_cast<double>(hosts) / n;
}

int optimizer_moments(const std::string& optimizer, double momentum) {
  if (optimizer == "sgd") return momentum > 0 ? 1 : 0;
  return 2;  // adam, adamw: exp_avg and exp_avg_sq
}

/// The host's and the device's peaks from the rows: a CUDA job's device rows are not RSS.
void sum_rows(MemoryPlan& plan, double baseline_bytes, double setup_bytes, std::int64_t local_ranks) {
  double host = 0;
  for (const auto& row : plan.rows) (row.on_device ? plan.device_peak : host) += row.bytes;
  plan.baseline = baseline_bytes;
  plan.training_peak = baseline_bytes + host;
  plan.setup_peak = baseline_bytes + setup_bytes;
  plan.peak = std::max(plan.training_peak, plan.setup_peak);
  plan.job_bytes = plan.peak * static_cast<double>(local_ranks);
}

double cublas_workspace_bytes(const char* config, int compute_major) {
  if (config != nullptr) {
    const std::string text(config);
    const std::regex segment(":([0-9]+):([0-9]+)");
    double total = 0;
    bool parsed = false;
    for (std::sregex_iterator it(text.begin(), text.end(), segment), end; it != end; ++it, parsed = true)
      total += std::stod((*it)[1].str()) * 1024.0 * std::stod((*it)[2].str());
    if (parsed) return total;
  }
  return compute_major < 0 || compute_major >= 9 ? 32.0 * 1048576.0 : 8.0 * 1048576.0 + 128.0 * 1024.0;
}

MemoryPlan make_plan(const PlanInputs& in) {
  MemoryPlan plan;
  plan.known = in.layout.has_value();
  plan.cuda = in.cuda;
  const std::string activations_detail = in.activation_method;
  if (!plan.known) {
    plan.description = "strategy '" + in.strategy + "' does not describe its layout";
    plan.rows.push_back({"activations", in.activation_bytes, activations_detail, in.cuda});
    plan.notes.push_back("the strategy plugin '" + in.strategy + "' does not implement sdk::StrategyMemoryLayout: "
                         "parameters, gradients, optimizer state, gathered units and traffic are unknown, and the "
                         "peak below counts the baseline and the activations only (a lower bound)");
    sum_rows(plan, in.baseline_bytes, 0, in.local_ranks);
    return plan;
  }
  const sdk::MemoryLayout& l = *in.layout;
  plan.description = l.description;
  const int moments = optimizer_moments(in.optimizer, in.momentum);
  const double optimizer_bytes = static_cast<double>(moments) * static_cast<double>(l.optimizer_numel) *
                                 static_cast<double>(c10::elementSize(l.optimizer_dtype));
  auto add = [&](const std::string& name, double bytes, const std::string& detail, bool on_device) {
    plan.rows.push_back({name, bytes, detail, on_device});
  };
  const bool state_on_device = in.cuda && !in.cpu_offload;
  add("parameters", l.param_bytes, "what the optimizer steps on (this rank's shards under FSDP)", state_on_device);
  const bool gradients_come_in_backward = state_on_device && in.gradients_freed_after_step;
  add("gradients", l.grad_bytes,
      gradients_come_in_backward ? "their gradients, freed after each step; backward allocates them as activations go"
                                 : "their gradients",
      state_on_device);
  add("optimizer state", optimizer_bytes,
      in.optimizer + ": " + std::to_string(moments) + " moment(s) x " + std::to_string(l.optimizer_numel) +
          " elements",
      state_on_device);
  if (in.weight_averaging) {
    const bool low = l.optimizer_dtype == at::kHalf || l.optimizer_dtype == at::kBFloat16;
    const double average_bytes = static_cast<double>(l.optimizer_numel) *
                                 static_cast<double>(low ? 4 : c10::elementSize(l.optimizer_dtype));
    add("weight average", average_bytes + in.averaged_buffer_bytes,
        std::string("a copy of what the optimizer steps") + (low ? " in fp32" : "") +
            (in.averaged_buffer_bytes > 0 ? " and of the buffers" : ""),
        state_on_device);
  }
  if (l.persistent_buffer_bytes > 0)
    add("gradient buckets", l.persistent_buffer_bytes, "DDP's flat all-reduce buffers", in.cuda);
  if (l.gathered_bytes > 0 || l.units > 0)
    add("gathered units", l.gathered_bytes, "unsharded parameters alive at once; largest unit " + l.largest_unit, in.cuda);
  if (l.unsharded_grad_bytes > 0)
    add("unsharded gradients", l.unsharded_grad_bytes, "in backward, before their reduce-scatter", in.cuda);
  if (l.collective_buffer_bytes > 0)
    add("collective buffers", l.collective_buffer_bytes, "all-gather / reduce-scatter buffers alive at once", in.cuda);
  add("activations", in.activation_bytes, activations_detail, in.cuda);
  if (in.loss_bytes > 0) add("loss workspace", in.loss_bytes, in.loss_method, in.cuda);
  if (in.cuda && in.cublas_workspace_bytes > 0)
    add("cuBLAS workspace", 2 * in.cublas_workspace_bytes,
        "LibTorch's, 2 x " + mb(in.cublas_workspace_bytes) + ": forward's thread's and autograd's device thread's", true);
  if (in.runtime_bytes > 0)
    add("trainer runtime", in.runtime_bytes, "trainer, loggers, c10d, allocator caches (measured)", false);
  // Setup builds the model in host memory (eagerly, or a unit at a time under deferred init).
  sum_rows(plan, in.baseline_bytes, l.setup_bytes, in.local_ranks);
  if (gradients_come_in_backward) {
    // Forward peaks without the gradients; backward's end holds them and few activations.
    plan.device_peak -= std::min(l.grad_bytes, in.activation_bytes);
    plan.notes.push_back("the gradients and the activations do not peak together on the device: peak CUDA per "
                         "rank counts the larger of the two");
  }

  for (const auto& c : l.collectives) {
    PlanTraffic t;
    t.kind = c.kind;
    t.what = c.what;
    t.group_size = c.group_size;
    // All-gathers run every micro-batch; gradients are reduced once per optimizer step.
    t.data_bytes = c.bytes * (c.kind == "all_gather" ? static_cast<double>(in.accumulate_grad_batches) : 1.0);
    t.sent_bytes = ring_bytes_sent(c.kind, t.data_bytes, c.group_size);
    plan.sent_per_step += t.sent_bytes;
    // Which ranks a smaller group holds is the strategy's: only groups of every rank are known.
    if (c.group_size == in.world_size)
      t.crossing_bytes = crossing_hosts_bytes(c.kind, t.data_bytes, in.world_size, in.local_ranks,
                                              in.two_level_collectives, in.cuda);
    plan.traffic.push_back(t);
  }
  if (in.world_size > in.local_ranks && !in.cuda) {
    plan.crossing_per_step = 0;
    for (const auto& t : plan.traffic) {
      if (t.crossing_bytes < 0 && t.group_size > 1) {
        plan.crossing_per_step = -1;  // a group of some ranks only
        break;
      }
      plan.crossing_per_step += std::max(0.0, t.crossing_bytes);
    }
    plan.crossing_how = in.two_level_collectives && in.local_ranks > 1 ? "two levels: shared memory within a host"
                                                                       : "Gloo alone";
  }
  if (!l.notes.empty()) plan.notes.push_back(l.notes);
  if (in.accumulate_grad_batches > 1 && !in.layout_of_micro_batches)
    plan.notes.push_back("accumulate_grad_batches = " + std::to_string(in.accumulate_grad_batches) +
                         ": the strategy laid out one micro-batch; gradients it keeps unreduced between micro-batches, "
                         "beyond its gradients row, are not counted");
  return plan;
}

std::string format_plan(const MemoryPlan& plan, std::int64_t world_size, std::int64_t local_ranks) {
  std::string out = "memory plan: " + plan.description + "\n";
  out += "  " + std::to_string(world_size) + " rank(s), " + std::to_string(local_ranks) +
         " on this machine; every rank alike (the largest shard where they differ by padding)\n\n";
  char line[512];
  // A CUDA job's rows say where they live: its device rows add up to a peak of their own.
  auto row = [&](const std::string& name, const std::string& bytes, bool on_device, const std::string& detail) {
    const char* where = !plan.cuda ? "" : on_device ? "device  " : "host    ";
    std::snprintf(line, sizeof(line), "  %-22s %12s  %s%s", name.c_str(), bytes.c_str(), where, detail.c_str());
    out += std::string(line, std::string(line).find_last_not_of(' ') + 1) + "\n";
  };
  std::snprintf(line, sizeof(line), "  %-22s %12s  %s\n", "", "per rank", plan.cuda ? "in" : "");
  out += line;
  for (const auto& r : plan.rows) row(r.name, mb(r.bytes), r.on_device, r.detail);
  row("runtime baseline", mb(plan.baseline), false, "this process with LibTorch, the plugins and the data loaded");
  out += "  " + std::string(22 + 1 + 12, '-') + "\n";
  row("training peak", mb(plan.training_peak), false, "");
  row("setup peak", mb(plan.setup_peak), false, "building and sharding the model");
  row("peak RSS per rank", mb(plan.peak), false, plan.known ? "" : "(a lower bound: the layout is unknown)");
  row("this machine", mb(plan.job_bytes), false, "peak x " + std::to_string(local_ranks) + " local rank(s)");
  if (plan.cuda)
    row("peak CUDA per rank", mb(plan.device_peak), true,
        "tensors at the peak of a step, as the trainer's peak_cuda_mb metric counts them");
  if (plan.largest_batch_size) {  // a count, in host or device memory alike
    const bool limit = *plan.largest_batch_size >= kBatchSizeSearchLimit;  // the search stopped, memory did not
    std::snprintf(line, sizeof(line), "  %-22s %12s  ", "largest batch_size",
                  ((limit ? ">= " : "") + std::to_string(*plan.largest_batch_size)).c_str());
    out += line + ("[data] batch_size per rank within " + plan.batch_size_bound) + "\n";
  }
  if (plan.known) {
    out += "\n  sent per rank per optimizer step (ring algorithm: all-gather and reduce-scatter send (g-1)/g of the data,"
           " all-reduce 2(g-1)/g):\n";
    if (plan.traffic.empty()) out += "    nothing\n";
    for (const auto& t : plan.traffic) {
      std::snprintf(line, sizeof(line), "    %-15s %10s of %10s over %3lld rank(s)  %s\n", t.kind.c_str(),
                    mb(t.sent_bytes).c_str(), mb(t.data_bytes).c_str(), static_cast<long long>(t.group_size),
                    t.what.c_str());
      out += line;
    }
    std::snprintf(line, sizeof(line), "    %-15s %10s\n", "total", mb(plan.sent_per_step).c_str());
    out += line;
    if (plan.crossing_per_step >= 0) {
      std::snprintf(line, sizeof(line), "    %-15s %10s  per rank on average (%lld hosts; %s)\n", "between hosts",
                    mb(plan.crossing_per_step).c_str(), static_cast<long long>(world_size / local_ranks),
                    plan.crossing_how.c_str());
      out += line;
    }
  }
  for (const auto& note : plan.notes) out += "  note: " + note + "\n";
  return out;
}

std::string plan_json(const MemoryPlan& plan, std::int64_t world_size, std::int64_t local_ranks) {
  nlohmann::ordered_json rows = nlohmann::ordered_json::object(), on_device = nlohmann::ordered_json::array();
  for (const auto& row : plan.rows) {
    rows[row.name] = whole(row.bytes);
    if (row.on_device) on_device.push_back(row.name);
  }
  rows["runtime baseline"] = whole(plan.baseline);
  nlohmann::ordered_json traffic = nlohmann::ordered_json::array();
  for (const auto& t : plan.traffic)
    traffic.push_back({{"kind", t.kind},
                       {"what", t.what},
                       {"group_size", t.group_size},
                       {"data_bytes", whole(t.data_bytes)},
                       {"sent_bytes", whole(t.sent_bytes)}});
  const nlohmann::ordered_json out = {{"known", plan.known},
                                      {"description", plan.description},
                                      {"world_size", world_size},
                                      {"local_ranks", local_ranks},
                                      {"per_rank_bytes", rows},
                                      {"training_peak_bytes", whole(plan.training_peak)},
                                      {"setup_peak_bytes", whole(plan.setup_peak)},
                                      {"peak_rss_per_rank_bytes", whole(plan.peak)},
                                      {"machine_bytes", whole(plan.job_bytes)},
                                      {"cuda", plan.cuda},
                                      {"on_device", on_device},
                                      {"peak_cuda_per_rank_bytes", whole(plan.device_peak)},
                                      {"sent_per_step_bytes", whole(plan.sent_per_step)},
                                      {"between_hosts_per_step_bytes", plan.crossing_per_step >= 0
                                                                           ? nlohmann::ordered_json(whole(plan.crossing_per_step))
                                                                           : nlohmann::ordered_json()},
                                      {"largest_batch_size", plan.largest_batch_size
                                                                 ? nlohmann::ordered_json(*plan.largest_batch_size)
                                                                 : nlohmann::ordered_json()},
                                      {"traffic", traffic},
                                      {"notes", plan.notes}};
  return out.dump() + "\n";
}

std::int64_t largest_batch_size(const PlanInputs& in, std::int64_t traced_batch_size, double available,
                                double device_bytes) {
  auto fits = [&](std::int64_t batch_size) {
    PlanInputs scaled = in;
    const double ratio = static_cast<double>(batch_size) / static_cast<double>(traced_batch_size);
    scaled.activation_bytes *= ratio;
    if (in.loss_bytes_per_sample) scaled.loss_bytes *= ratio;
    const MemoryPlan plan = make_plan(scaled);
    return (available < 0 || plan.job_bytes <= available) &&
           (!plan.cuda || device_bytes <= 0 || plan.device_peak <= device_bytes);
  };
  // The plan grows with the batch: the largest fitting size by bisection.
  std::int64_t fitting = 0, failing = kBatchSizeSearchLimit;
  if (fits(failing)) return failing;
  while (failing - fitting > 1) {
    const std::int64_t middle = fitting + (failing - fitting) / 2;
    (fits(middle) ? fitting : failing) = middle;
  }
  return fitting;
}

double memory_available_bytes() {
  if (const char* forced = std::getenv("TESSERA_MEMORY_AVAILABLE_MB")) return std::strtod(forced, nullptr) * 1048576.0;
  std::ifstream in("/proc/meminfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("MemAvailable:", 0) == 0) return 1024.0 * std::strtod(line.c_str() + 13, nullptr);
  return -1;
}

std::int64_t proc_status_kb(const std::string& field) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind(field + ":", 0) == 0) return std::strtoll(line.c_str() + field.size() + 1, nullptr, 10);
  return 0;
}

namespace {
/// "name 12 MB, name 3 MB" of the rows in host memory (or on the device).
std::string listed_rows(const MemoryPlan& plan, bool on_device) {
  std::string out;
  for (const auto& r : plan.rows)
    if (r.bytes > 0 && r.on_device == on_device) out += (out.empty() ? "" : ", ") + r.name + " " + mb(r.bytes);
  return out;
}
}  // namespace

std::string device_memory_warning(const MemoryPlan& plan, double device_bytes, bool activations_traced) {
  if (!plan.cuda || device_bytes <= 0 || plan.device_peak <= device_bytes) return "";
  return "warning: the memory plan needs " + std::string(activations_traced ? "" : "at least ") + mb(plan.device_peak) +
         " of CUDA memory per rank (" + listed_rows(plan, true) +
         (activations_traced ? "" : "; activations not counted") + ") but the GPU has " + mb(device_bytes) +
         "; the job will run out of device memory. Shard more (fsdp FULL_SHARD, fsdp2, more ranks), keep the state "
         "on the host ([strategy] cpu_offload, fsdp2 offload_policy = \"cpu\"), lower the precision or [data] "
         "batch_size, or see `tessera plan`";
}

std::string memory_warning(const MemoryPlan& plan, double available, std::int64_t local_ranks) {
  if (available < 0 || plan.job_bytes <= available) return "";
  const std::string rows = listed_rows(plan, false);
  std::string out = "warning: the memory plan needs " + mb(plan.job_bytes) + " on this machine (" + mb(plan.peak) +
                    " peak RSS per rank x " + std::to_string(local_ranks) + " local rank(s): " + rows +
                    (rows.empty() ? "" : ", ");
  out += "baseline " + mb(plan.baseline) + ") but only " + mb(available) + " is available (MemAvailable); the job may be killed for memory. "
         "Shard more (fsdp FULL_SHARD, more ranks), lower [data] batch_size" +
         (!plan.largest_batch_size       ? std::string()
          : *plan.largest_batch_size > 0 ? " (at most " + std::to_string(*plan.largest_batch_size) + " fits)"
                                         : std::string(" (even 1 does not fit)")) +
         ", or see `tessera plan`";
  if (plan.job_bytes > 2 * available) out += " (the plan is more than twice what is available)";
  return out;
}

}  // namespace tessera::host
