#include "runtime/comm/communicator.h"
#include "runtime/base/env_vars.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "runtime/base/check.h"

namespace strata {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kF64: return 8;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kU8: return 1;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kF64: return "f64";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
    case DType::kU8: return "u8";
  }
  return "unknown";
}

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "unknown";
}

Status Communicator::SetBucketSizes(const BucketSizes& sizes) {
  STRATA_CHECK(sizes.allgather >= 1, "zero_optimization.allgather_bucket_size=", sizes.allgather,
               ": must be >= 1 element (DeepSpeed's default is 5e8)");
  STRATA_CHECK(sizes.reduce >= 1, "zero_optimization.reduce_bucket_size=", sizes.reduce,
               ": must be >= 1 element (DeepSpeed's default is 5e8)");
  buckets_ = sizes;
  return Status::Ok();
}

template <typename F>
Status Communicator::Run(const char* what, F&& call) {
  if (!broken_.ok()) {
    return FailedPrecondition(StrCat(backend(), " ", what, " on rank ", rank_,
                                     ": the communicator failed earlier and cannot be used; "
                                     "restart every rank of the job; first error: ",
                                     broken_.ToString()));
  }
  ++backend_calls_;
  Status s = call();
  if (!s.ok()) {
    s = s.WithContext(StrCat(backend(), " ", what, " (rank ", rank_, " of ", world_size_, ")"));
    // A peer that gave up is the cause, whatever the transport made of it (Note [giving up]).
    if (const std::string notes = PeerAbortNotes(); !notes.empty()) {
      s = Status(StatusCode::kCancelled,
                 StrCat(notes, " (", backend(), " ", what, " on rank ", rank_, " ended with it)"));
      peer_gave_up_ = true;
    }
    broken_ = s;
  }
  return s;
}

// Note [giving up]
// A rank whose engine start fails part-way has issued fewer collectives than its peers, which
// wait in the next one until the timeout (300 s by default) and then report only that it timed
// out; the rank that knows why may be another process's log away, or may never exit (a script
// that catches the error). So a rank that gives up first writes its reason to the rendezvous
// store, under strata/abort/<rank>, reads it back (a round trip, so the note is there before
// anything below can be seen), and then closes its connections. A peer waiting on it fails at
// once with the transport's "connection closed"; every failed call reads the peers' notes
// before it returns, and where one gave up, the call's error is CANCELLED with that rank's
// reason first. A rank that gives up because a peer did (its reason is that CANCELLED) writes
// no note of its own: the others are to read the first cause, not a chain of echoes. It still
// closes its connections, releasing whoever waits on it.
void Communicator::Abort(const Status& why) {
  const Status reason = why.ok() ? Internal("Communicator::Abort with an OK status") : why;
  if (broken_.ok()) broken_ = reason;
  if (world_size_ == 1 || aborted_) return;
  aborted_ = true;
  AbortImpl(peer_gave_up_ ? std::string()
                          : StrCat("rank ", rank_, " of ", world_size_,
                                   " gave up the job's collectives: ", reason.ToString()));
}

Status Communicator::CheckArgs(const char* what, const void* a, const void* b,
                               int64_t count) const {
  STRATA_CHECK(count >= 0, what, ": count=", count, ": must be >= 0");
  STRATA_CHECK(count == 0 || (a != nullptr && b != nullptr), what, ": null buffer for ", count,
               " elements");
  return Status::Ok();
}

Status Communicator::AllGather(const void* shard, void* full, int64_t shard_count, DType dtype) {
  STRATA_RETURN_IF_ERROR(CheckArgs("all_gather", shard, full, shard_count));
  const int64_t per_call = std::max<int64_t>(1, buckets_.allgather / world_size_);
  const size_t esize = DTypeSize(dtype);
  for (int64_t off = 0; off < shard_count; off += per_call) {
    const int64_t n = std::min(per_call, shard_count - off);
    STRATA_RETURN_IF_ERROR(Run("all_gather", [&] {
      return AllGatherImpl(static_cast<const char*>(shard) + off * esize,
                           static_cast<char*>(full) + off * esize, n, shard_count, dtype);
    }));
  }
  return Status::Ok();
}

Status Communicator::ReduceScatter(const void* full, void* shard, int64_t shard_count, DType dtype,
                                   ReduceOp op) {
  STRATA_RETURN_IF_ERROR(CheckArgs("reduce_scatter", full, shard, shard_count));
  const int64_t per_call = std::max<int64_t>(1, buckets_.reduce / world_size_);
  const size_t esize = DTypeSize(dtype);
  for (int64_t off = 0; off < shard_count; off += per_call) {
    const int64_t n = std::min(per_call, shard_count - off);
    STRATA_RETURN_IF_ERROR(Run("reduce_scatter", [&] {
      return ReduceScatterImpl(static_cast<const char*>(full) + off * esize, shard_count,
                               static_cast<char*>(shard) + off * esize, n, dtype, op);
    }));
  }
  return Status::Ok();
}

Status Communicator::AllReduce(void* buf, int64_t count, DType dtype, ReduceOp op) {
  STRATA_RETURN_IF_ERROR(CheckArgs("all_reduce", buf, buf, count));
  const size_t esize = DTypeSize(dtype);
  for (int64_t off = 0; off < count; off += buckets_.reduce) {
    const int64_t n = std::min(buckets_.reduce, count - off);
    STRATA_RETURN_IF_ERROR(Run("all_reduce", [&] {
      return AllReduceImpl(static_cast<char*>(buf) + off * esize, n, dtype, op);
    }));
  }
  return Status::Ok();
}

Status Communicator::Broadcast(void* buf, int64_t count, DType dtype, int root) {
  STRATA_RETURN_IF_ERROR(CheckArgs("broadcast", buf, buf, count));
  STRATA_CHECK(root >= 0 && root < world_size_, "broadcast root=", root, ": must be in [0, ",
               world_size_, ")");
  const size_t esize = DTypeSize(dtype);
  for (int64_t off = 0; off < count; off += buckets_.allgather) {
    const int64_t n = std::min(buckets_.allgather, count - off);
    STRATA_RETURN_IF_ERROR(Run("broadcast", [&] {
      return BroadcastImpl(static_cast<char*>(buf) + off * esize, n, dtype, root);
    }));
  }
  return Status::Ok();
}

Status Communicator::Barrier() {
  return Run("barrier", [&] { return BarrierImpl(); });
}

// ---------------------------------------------------------------------------------------------
// Environment

namespace {

// The variables are declared in runtime/base/env_vars.h.

constexpr const char* kEnvFix =
    "; launch ranks with strata-launch, torchrun, or a Slurm/mpirun wrapper that sets WORLD_SIZE, "
    "RANK, MASTER_ADDR and MASTER_PORT";

// Parses an integer variable in [lo, hi]. Absent: `fallback` when given, else an error.
StatusOr<int> EnvInt(const EnvVar& var, int lo, int hi, const int* fallback) {
  const char* name = var.name;
  const char* text = GetEnv(var);
  if (text == nullptr || *text == '\0') {
    if (fallback != nullptr) return *fallback;
    return InvalidArgument(StrCat(name, " is not set but WORLD_SIZE > 1 needs it", kEnvFix));
  }
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v < lo || v > hi) {
    return InvalidArgument(
        StrCat(name, "='", text, "': must be an integer in [", lo, ", ", hi, "]", kEnvFix));
  }
  return static_cast<int>(v);
}

}  // namespace

StatusOr<DistEnv> ReadDistEnv() {
  DistEnv env;
  const char* ws = GetEnv(kEnvWorldSize);
  env.from_env = ws != nullptr && *ws != '\0';
  const int one = 1, zero = 0;
  STRATA_ASSIGN_OR_RETURN(env.world_size, EnvInt(kEnvWorldSize, 1, 1 << 20, &one));
  const bool multi = env.world_size > 1;
  STRATA_ASSIGN_OR_RETURN(env.rank, EnvInt(kEnvRank, 0, env.world_size - 1, multi ? nullptr : &zero));
  STRATA_ASSIGN_OR_RETURN(env.local_rank,
                          EnvInt(kEnvLocalRank, 0, env.world_size - 1, &env.rank));
  STRATA_ASSIGN_OR_RETURN(env.local_world_size,
                          EnvInt(kEnvLocalWorldSize, 1, env.world_size, &env.world_size));
  const int default_port = 29500;
  STRATA_ASSIGN_OR_RETURN(env.master_port,
                          EnvInt(kEnvMasterPort, 1, 65535, multi ? nullptr : &default_port));
  const char* addr = GetEnv(kEnvMasterAddr);
  if (addr != nullptr && *addr != '\0') {
    env.master_addr = addr;
  } else if (multi) {
    return InvalidArgument(StrCat(kEnvMasterAddr.name, " is not set but WORLD_SIZE=", env.world_size,
                                  " needs the address of rank 0's store", kEnvFix));
  }
  return env;
}

// ---------------------------------------------------------------------------------------------
// single

namespace {

class SingleCommunicator final : public Communicator {
 public:
  SingleCommunicator() : Communicator(0, 1) {}
  std::string_view backend() const override { return "single"; }
  MemoryKind memory_kind() const override { return MemoryKind::kHost; }

 protected:
  // With one rank every collective is the identity: copy only when output and input differ.
  Status AllGatherImpl(const void* src, void* dst, int64_t count, int64_t, DType dtype) override {
    if (src != dst) std::memmove(dst, src, count * DTypeSize(dtype));
    return Status::Ok();
  }
  Status ReduceScatterImpl(const void* src, int64_t, void* dst, int64_t count, DType dtype,
                           ReduceOp) override {
    if (src != dst) std::memmove(dst, src, count * DTypeSize(dtype));
    return Status::Ok();
  }
  Status AllReduceImpl(void*, int64_t, DType, ReduceOp) override { return Status::Ok(); }
  Status BroadcastImpl(void*, int64_t, DType, int) override { return Status::Ok(); }
  Status BarrierImpl() override { return Status::Ok(); }
};

}  // namespace

std::unique_ptr<Communicator> CreateSingleCommunicator() {
  return std::make_unique<SingleCommunicator>();
}

}  // namespace strata
