#pragma once
/// DeviceMesh: the job's ranks as an n-dimensional array with named dimensions, like
/// PyTorch's `init_device_mesh(device, shape, mesh_dim_names)`. Row-major: world rank r sits
/// at the coordinate of r in `shape`, the last dimension varying fastest, so a
/// (replicate = 2, shard = 2) mesh of 4 ranks is [[0, 1], [2, 3]]: shard groups {0, 1} and
/// {2, 3}, replicate groups {0, 2} and {1, 3}. Each dimension has the communicator of the
/// ranks that differ only in that coordinate; several dimensions flatten into one group
/// (dp = replicate x shard). FSDP's sharding strategies are (replicate, shard) meshes:
/// see fsdp_mesh().
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "tessera/core/comm.hpp"

namespace tessera::core {

class DeviceMesh {
 public:
  /// Collective over `world`: every rank calls it with the same `shape` and `dim_names`.
  /// Creates each dimension's group (Communicator::split; a dimension of size 1 gets a
  /// one-rank communicator, one spanning the whole world reuses `world`). Throws
  /// sdk::Error if the shape's product is not the world size, a size is < 1, or the names
  /// are not one distinct, non-empty name per dimension.
  DeviceMesh(CommunicatorPtr world, std::vector<std::int64_t> shape, std::vector<std::string> dim_names);

  DeviceMesh(DeviceMesh&&) = default;
  DeviceMesh& operator=(DeviceMesh&&) = default;
  DeviceMesh(const DeviceMesh&) = delete;
  DeviceMesh& operator=(const DeviceMesh&) = delete;

  std::int64_t ndim() const { return static_cast<std::int64_t>(shape_.size()); }
  const std::vector<std::int64_t>& shape() const { return shape_; }
  const std::vector<std::string>& dim_names() const { return dim_names_; }
  /// The number of ranks in the mesh (the world size).
  std::int64_t size() const { return world_->size(); }
  /// The extent of dimension `dim`; throws sdk::Error naming the mesh's dimensions if unknown.
  std::int64_t size(const std::string& dim) const;
  /// This rank's coordinate along `dim` (= its rank in group(dim)).
  std::int64_t rank(const std::string& dim) const;
  /// This rank's coordinate in every dimension.
  const std::vector<std::int64_t>& coordinate() const { return coordinate_; }
  /// The world rank at `coordinate` (one entry per dimension, each in range).
  std::int64_t world_rank_at(const std::vector<std::int64_t>& coordinate) const;
  /// The world communicator the mesh was built over.
  const CommunicatorPtr& world() const { return world_; }

  /// The communicator of the ranks that differ from this one only along `dim`, ranked by
  /// their coordinate along it. Not collective.
  const CommunicatorPtr& group(const std::string& dim) const;
  /// The flattened sub-mesh over `dims` (given in mesh order, e.g. {"replicate", "shard"}):
  /// the ranks that differ from this one only along those dimensions, ranked row-major over
  /// them. One dimension is group(dim). The first call for a set of dimensions is
  /// collective over the world (every rank, in the same order); later calls return the same
  /// communicator.
  const CommunicatorPtr& group(const std::vector<std::string>& dims);

  /// "DeviceMesh([[0, 1], [2, 3]], mesh_dim_names=(replicate, shard))", as PyTorch prints
  /// it; the same on every rank.
  std::string to_string() const;

 private:
  std::int64_t index_of(const std::string& dim) const;
  /// The partition of the world into groups that vary only along `dims` (sorted indices),
  /// each group's ranks in row-major order over those dims.
  std::vector<std::vector<std::int64_t>> partition(const std::vector<std::int64_t>& dims) const;
  CommunicatorPtr make_group(const std::vector<std::int64_t>& dims);

  CommunicatorPtr world_;
  std::vector<std::int64_t> shape_;
  std::vector<std::string> dim_names_;
  std::vector<std::int64_t> coordinate_;
  std::vector<CommunicatorPtr> dim_groups_;
  std::map<std::vector<std::int64_t>, CommunicatorPtr> flattened_;
};

/// PyTorch FSDP's sharding strategies as a (replicate, shard) mesh over `world`:
/// FULL_SHARD and SHARD_GRAD_OP (1, world), NO_SHARD (world, 1), HYBRID_SHARD
/// (world / shard_size, shard_size): shards within groups of `shard_size` consecutive ranks
/// (a node, typically), replicated across them. `shard_size` applies to HYBRID_SHARD only
/// and must divide the world size. Collective over `world`.
DeviceMesh fsdp_mesh(CommunicatorPtr world, const std::string& sharding_strategy, std::int64_t shard_size = 0);

}  // namespace tessera::core
