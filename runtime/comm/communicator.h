// Communicator: the collectives the partitioner and the optimizer need, over raw buffers.
//
// Buffers are raw pointers plus element counts plus a dtype, never LibTorch types, so the core
// (tier manager, optimizer) can call collectives without LibTorch. Which memory the pointers name
// depends on the backend: host memory for `single` and `gloo`, device memory for `nccl`
// (memory_kind() says which).
//
// Semantics (N = world_size, every rank calls every collective in the same order with the same
// counts and dtype — a mismatch is undefined, exactly as in MPI/NCCL):
// - AllGather(shard, full, shard_count): rank r's `shard` lands at full[r·shard_count, ...).
// - ReduceScatter(full, shard, shard_count, op): shard = op over ranks of
//   full[rank·shard_count, (rank+1)·shard_count). kAvg is the sum divided by N.
// - AllReduce(buf, count, op): in place; every rank ends with op over ranks.
// - Broadcast(buf, count, root): in place; every rank ends with root's buffer.
// - Barrier(): returns once every rank has entered it.
// All calls are blocking: when they return OK the output buffer is complete and the input may be
// reused. `shard` may alias its slice of `full` (in-place gather/scatter).
//
// Bucketing: a call larger than its bucket (allgather_bucket_size / reduce_bucket_size, in
// elements of the full buffer, as DeepSpeed counts them) is split into several backend calls of
// at most that many elements, bounding the transport's staging memory. Results are identical.
//
// Failure: a peer that dies or hangs, or a store that cannot be reached, makes the call return a
// non-OK Status (DEADLINE_EXCEEDED, UNAVAILABLE, ABORTED-like INTERNAL from the transport) within
// the communicator's timeout — never a hang. After a failed collective the communicator is
// broken: later calls fail fast with FAILED_PRECONDITION naming the first error. A rank that
// cannot go on with the job's sequence of calls gives up with Abort: its peers' calls then fail
// at once, CANCELLED, naming that rank and its reason (Note [giving up] in communicator.cc).
//
// Thread safety: a Communicator is used by one thread at a time (collectives are ordered; two
// threads issuing them concurrently would interleave differently on different ranks).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "runtime/base/status.h"

namespace strata {

enum class DType : int { kF32 = 0, kF64, kBF16, kF16, kI32, kI64, kU8 };
enum class ReduceOp : int { kSum = 0, kAvg, kMax, kMin };
enum class MemoryKind : int { kHost = 0, kDevice };

size_t DTypeSize(DType dtype);
const char* DTypeName(DType dtype);    // "f32", "bf16", ...
const char* ReduceOpName(ReduceOp op);  // "sum", "avg", ...

struct BucketSizes {
  int64_t allgather = 500000000;  // elements of the full (gathered) buffer per backend call
  int64_t reduce = 500000000;     // elements of the full (reduced) buffer per backend call

  // From the config's zero_optimization sizes; 0 there (accepted, as DeepSpeed does) means one
  // call per buffer, whatever its size.
  static BucketSizes FromConfig(int64_t allgather_bucket_size, int64_t reduce_bucket_size) {
    constexpr int64_t kUnbounded = int64_t{1} << 60;
    return {allgather_bucket_size > 0 ? allgather_bucket_size : kUnbounded,
            reduce_bucket_size > 0 ? reduce_bucket_size : kUnbounded};
  }
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  virtual std::string_view backend() const = 0;
  virtual MemoryKind memory_kind() const = 0;

  // Bucket sizes must be >= 1; the defaults are DeepSpeed's 5e8 elements.
  Status SetBucketSizes(const BucketSizes& sizes);
  const BucketSizes& bucket_sizes() const { return buckets_; }

  Status AllGather(const void* shard, void* full, int64_t shard_count, DType dtype);
  Status ReduceScatter(const void* full, void* shard, int64_t shard_count, DType dtype,
                       ReduceOp op = ReduceOp::kAvg);
  Status AllReduce(void* buf, int64_t count, DType dtype, ReduceOp op);
  Status Broadcast(void* buf, int64_t count, DType dtype, int root);
  Status Barrier();

  // Gives up on the job's collectives, for a rank that can no longer follow the others' sequence
  // of calls (an engine start that failed part-way): this rank's later calls fail fast naming
  // `why`; a peer waiting in a call with this rank is released now instead of at the timeout,
  // and its error names this rank and `why`. The first failure stays the one named. Called by
  // the thread that issues the collectives, with none of them in flight. A communicator of one
  // rank has no peers to release but is broken all the same.
  void Abort(const Status& why);

  // OK, or the failure that broke this communicator (a failed call or Abort), and whether that
  // failure is a peer's note: another rank gave up first.
  const Status& failure() const { return broken_; }
  bool peer_gave_up() const { return peer_gave_up_; }

  // COUNT: backend calls issued since construction (buckets count one each). For tests and stats.
  int64_t backend_calls() const { return backend_calls_; }

 protected:
  Communicator(int rank, int world_size) : rank_(rank), world_size_(world_size) {}

  // One backend call each; no bucketing. Strided forms let a bucket name a slice of every rank's
  // segment without copying: segment r of the full buffer starts at element r·stride.
  //   AllGatherImpl: src (count elements) -> dst + r·dst_stride for every rank r.
  //   ReduceScatterImpl: src + r·src_stride (count elements, every r) -> dst (count elements).
  // dst may alias src + rank·stride in both.
  virtual Status AllGatherImpl(const void* src, void* dst, int64_t count, int64_t dst_stride,
                               DType dtype) = 0;
  virtual Status ReduceScatterImpl(const void* src, int64_t src_stride, void* dst, int64_t count,
                                   DType dtype, ReduceOp op) = 0;
  virtual Status AllReduceImpl(void* buf, int64_t count, DType dtype, ReduceOp op) = 0;
  virtual Status BroadcastImpl(void* buf, int64_t count, DType dtype, int root) = 0;
  virtual Status BarrierImpl() = 0;

  // Abort's transport part: publish `note` where the peers can read it (the rendezvous store;
  // nothing when it is empty), then close this rank's connections so that a peer's pending call
  // ends. Called at most once. Default: nothing, for backends without peers.
  virtual void AbortImpl(const std::string& note) { (void)note; }
  // The notes peers published with AbortImpl, "" when none (or no store to read them from):
  // read once a call has failed, to name the rank that gave up.
  virtual std::string PeerAbortNotes() { return ""; }

 private:
  // Runs one backend call and latches the first failure (see the header comment).
  template <typename F>
  Status Run(const char* what, F&& call);
  Status CheckArgs(const char* what, const void* a, const void* b, int64_t count) const;

  const int rank_;
  const int world_size_;
  BucketSizes buckets_;
  Status broken_;
  bool peer_gave_up_ = false;  // broken_ is a peer's note, CANCELLED (Note [giving up])
  bool aborted_ = false;       // AbortImpl has run
  int64_t backend_calls_ = 0;
};

// The ranks' environment, as torchrun, Slurm wrappers, mpirun wrappers and strata-launch set it.
struct DistEnv {
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  bool from_env = false;  // true when WORLD_SIZE was set
};

// Reads WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT, LOCAL_RANK, LOCAL_WORLD_SIZE. WORLD_SIZE unset
// means one rank (the other variables are then optional). With WORLD_SIZE > 1, RANK, MASTER_ADDR
// and MASTER_PORT are required. A missing or malformed value is INVALID_ARGUMENT naming the
// variable, its value and the fix.
StatusOr<DistEnv> ReadDistEnv();

// A key-value rendezvous store shared by the ranks (c10d's TCPStore behind it). Get waits until
// the key exists or the store's timeout passes (DEADLINE_EXCEEDED). Thread-safe.
class RendezvousStore {
 public:
  virtual ~RendezvousStore() = default;
  virtual Status Set(const std::string& key, const std::string& value) = 0;
  virtual StatusOr<std::string> Get(const std::string& key) = 0;
  // Whether the key exists now, without waiting; a round trip to the store, so a Set this
  // client made before has landed when it returns.
  virtual StatusOr<bool> Has(const std::string& key) = 0;
};

// Single-rank communicator: every collective is a copy at most (none when in place).
std::unique_ptr<Communicator> CreateSingleCommunicator();

}  // namespace strata
