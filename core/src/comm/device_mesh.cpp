#include "tessera/core/device_mesh.hpp"

#include <algorithm>
#include <sstream>

#include "tessera/sdk/error.hpp"

namespace tessera::core {

namespace {

std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::ostringstream out;
  out << "(";
  for (std::size_t d = 0; d < shape.size(); ++d) out << (d ? ", " : "") << shape[d];
  out << (shape.size() == 1 ? ",)" : ")");
  return out.str();
}

}  // namespace

DeviceMesh::DeviceMesh(CommunicatorPtr world, std::vector<std::int64_t> shape, std::vector<std::string> dim_names)
    : world_(std::move(world)), shape_(std::move(shape)), dim_names_(std::move(dim_names)) {
  TESSERA_CHECK(world_, "DeviceMesh needs a world communicator");
  TESSERA_CHECK(!shape_.empty(), "DeviceMesh needs at least one dimension");
  TESSERA_CHECK(dim_names_.size() == shape_.size(), "DeviceMesh shape ", shape_string(shape_), " has ", shape_.size(),
                " dimension(s) but ", dim_names_.size(), " name(s) were given (", sdk::join(dim_names_),
                "): give one name per dimension");
  std::int64_t product = 1;
  for (std::size_t d = 0; d < shape_.size(); ++d) {
    TESSERA_CHECK(shape_[d] >= 1, "DeviceMesh shape ", shape_string(shape_), ": dimension '", dim_names_[d],
                  "' has size ", shape_[d], "; every size must be at least 1");
    TESSERA_CHECK(!dim_names_[d].empty(), "DeviceMesh dimension ", d, " has an empty name");
    TESSERA_CHECK(std::count(dim_names_.begin(), dim_names_.end(), dim_names_[d]) == 1, "DeviceMesh dimension name '",
                  dim_names_[d], "' is used twice in (", sdk::join(dim_names_), ")");
    product *= shape_[d];
  }
  TESSERA_CHECK(product == world_->size(), "DeviceMesh shape ", shape_string(shape_), " over (", sdk::join(dim_names_),
                ") has ", product, " ranks but the world has ", world_->size(),
                ": the product of the shape must equal the world size");

  coordinate_.assign(shape_.size(), 0);
  std::int64_t rest = world_->rank();
  for (std::int64_t d = ndim() - 1; d >= 0; --d) {
    coordinate_[d] = rest % shape_[d];
    rest /= shape_[d];
  }
  for (std::int64_t d = 0; d < ndim(); ++d) dim_groups_.push_back(make_group({d}));
}

std::int64_t DeviceMesh::index_of(const std::string& dim) const {
  auto it = std::find(dim_names_.begin(), dim_names_.end(), dim);
  TESSERA_CHECK(it != dim_names_.end(), "DeviceMesh ", to_string(), " has no dimension '", dim, "'",
                sdk::did_you_mean(dim, dim_names_), "; its dimensions: ", sdk::join(dim_names_));
  return it - dim_names_.begin();
}

std::int64_t DeviceMesh::size(const std::string& dim) const { return shape_[index_of(dim)]; }
std::int64_t DeviceMesh::rank(const std::string& dim) const { return coordinate_[index_of(dim)]; }
const CommunicatorPtr& DeviceMesh::group(const std::string& dim) const { return dim_groups_[index_of(dim)]; }

std::int64_t DeviceMesh::world_rank_at(const std::vector<std::int64_t>& coordinate) const {
  TESSERA_CHECK(coordinate.size() == shape_.size(), "DeviceMesh ", to_string(), ": a coordinate needs ", ndim(),
                " entries, got ", coordinate.size());
  std::int64_t rank = 0;
  for (std::size_t d = 0; d < shape_.size(); ++d) {
    TESSERA_CHECK(coordinate[d] >= 0 && coordinate[d] < shape_[d], "DeviceMesh ", to_string(), ": coordinate ",
                  coordinate[d], " along '", dim_names_[d], "' is outside [0, ", shape_[d], ")");
    rank = rank * shape_[d] + coordinate[d];
  }
  return rank;
}

const CommunicatorPtr& DeviceMesh::group(const std::vector<std::string>& dims) {
  TESSERA_CHECK(!dims.empty(), "DeviceMesh::group needs at least one dimension name");
  std::vector<std::int64_t> indices;
  for (const std::string& dim : dims) indices.push_back(index_of(dim));
  TESSERA_CHECK(std::is_sorted(indices.begin(), indices.end()) &&
                    std::adjacent_find(indices.begin(), indices.end()) == indices.end(),
                "DeviceMesh ", to_string(), ": flatten dimensions (", sdk::join(dims),
                ") once each and in mesh order (", sdk::join(dim_names_), ")");
  if (indices.size() == 1) return dim_groups_[indices.front()];
  auto it = flattened_.find(indices);
  if (it == flattened_.end()) it = flattened_.emplace(indices, make_group(indices)).first;
  return it->second;
}

std::vector<std::vector<std::int64_t>> DeviceMesh::partition(const std::vector<std::int64_t>& dims) const {
  // Ranks agreeing on every other coordinate form one group; visiting ranks in increasing
  // order lists each group row-major over `dims`.
  std::map<std::vector<std::int64_t>, std::size_t> group_of;
  std::vector<std::vector<std::int64_t>> groups;
  for (std::int64_t r = 0; r < size(); ++r) {
    std::vector<std::int64_t> key;
    std::int64_t rest = r;
    for (std::int64_t d = ndim() - 1; d >= 0; --d) {
      if (!std::binary_search(dims.begin(), dims.end(), d)) key.push_back(rest % shape_[d]);
      rest /= shape_[d];
    }
    auto [it, added] = group_of.emplace(key, groups.size());
    if (added) groups.emplace_back();
    groups[it->second].push_back(r);
  }
  return groups;
}

CommunicatorPtr DeviceMesh::make_group(const std::vector<std::int64_t>& dims) {
  std::int64_t group_size = 1;
  for (std::int64_t d : dims) group_size *= shape_[d];
  // Every rank decides alike, so the splits below stay matched across ranks.
  if (group_size == 1) return make_local_communicator();
  if (group_size == size()) return world_;
  return world_->split(partition(dims));
}

std::string DeviceMesh::to_string() const {
  // Nested lists of world ranks, row-major, as PyTorch's DeviceMesh repr.
  std::ostringstream out;
  out << "DeviceMesh(";
  for (std::int64_t r = 0; r < size(); ++r) {
    std::int64_t stride = 1;
    for (std::int64_t d = ndim() - 1; d >= 0; --d) {
      stride *= shape_[d];
      if (r % stride == 0) out << "[";
    }
    out << r;
    stride = 1;
    for (std::int64_t d = ndim() - 1; d >= 0; --d) {
      stride *= shape_[d];
      if ((r + 1) % stride == 0) out << "]";
    }
    if (r + 1 < size()) out << ", ";
  }
  out << ", mesh_dim_names=(" << sdk::join(dim_names_) << "))";
  return out.str();
}

DeviceMesh fsdp_mesh(CommunicatorPtr world, const std::string& sharding_strategy, std::int64_t shard_size) {
  TESSERA_CHECK(world, "fsdp_mesh needs a world communicator");
  const std::vector<std::string> valid{"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"};
  TESSERA_CHECK(std::find(valid.begin(), valid.end(), sharding_strategy) != valid.end(), "sharding strategy '",
                sharding_strategy, "' is not one of ", sdk::join(valid), sdk::did_you_mean(sharding_strategy, valid));
  const std::int64_t n = world->size();
  if (sharding_strategy != "HYBRID_SHARD") {
    TESSERA_CHECK(shard_size == 0, "a shard group size (", shard_size, ") applies to HYBRID_SHARD only, not ",
                  sharding_strategy);
    return DeviceMesh(std::move(world), {sharding_strategy == "NO_SHARD" ? n : 1, sharding_strategy == "NO_SHARD" ? 1 : n},
                      {"replicate", "shard"});
  }
  TESSERA_CHECK(shard_size >= 1 && n % shard_size == 0, "HYBRID_SHARD shard group size ", shard_size,
                " does not divide the world size ", n, "; choose a divisor of ", n);
  return DeviceMesh(std::move(world), {n / shard_size, shard_size}, {"replicate", "shard"});
}

}  // namespace tessera::core
