// NCCL directly on a private CUDA stream. Collectives are enqueued and then waited for by polling,
// so that a dead peer turns into an error instead of a hang (Note [nccl timeouts]).
#include <chrono>
#include <cstring>
#include <thread>

#include <cuda_runtime.h>
#include <nccl.h>

#include "runtime/base/check.h"
#include "runtime/base/cuda_check.h"
#include "runtime/base/logging.h"
#include "runtime/comm/backends.h"

// Note [nccl timeouts]
// A blocking NCCL communicator waits forever for a peer that died. Strata creates its
// communicator non-blocking (ncclConfig_t::blocking = 0): calls return ncclInProgress while
// NCCL works in the background, and every wait here polls cudaStreamQuery and
// ncclCommGetAsyncError against a deadline. When the deadline passes, ncclCommAbort frees the
// stuck kernels and the call returns DEADLINE_EXCEEDED; the communicator is then unusable, as
// the Communicator contract says.

namespace strata {

namespace {

Status NcclError(ncclResult_t r, const char* what, ncclComm_t comm) {
  const char* last = comm != nullptr ? ncclGetLastError(comm) : ncclGetLastError(nullptr);
  std::string msg = StrCat(what, ": ", ncclGetErrorString(r));
  if (last != nullptr && *last != '\0') msg += StrCat(" (", last, ")");
  if (r == ncclRemoteError || r == ncclSystemError) {
    return Unavailable(StrCat(msg, "; a peer rank may have exited"));
  }
  if (r == ncclInvalidArgument || r == ncclInvalidUsage) return InvalidArgument(msg);
  return Internal(msg);
}

ncclDataType_t ToNccl(DType d) {
  switch (d) {
    case DType::kF32: return ncclFloat32;
    case DType::kF64: return ncclFloat64;
    case DType::kBF16: return ncclBfloat16;
    case DType::kF16: return ncclFloat16;
    case DType::kI32: return ncclInt32;
    case DType::kI64: return ncclInt64;
    case DType::kU8: return ncclUint8;
  }
  return ncclUint8;
}

ncclRedOp_t ToNccl(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
  }
  return ncclSum;
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const DistEnv& env, int device, std::shared_ptr<RendezvousStore> store,
                   double timeout_s)
      : Communicator(env.rank, env.world_size),
        device_(device),
        store_(std::move(store)),
        timeout_s_(timeout_s) {}

  ~NcclCommunicator() override {
    if (comm_ != nullptr) {
      // A failed communicator may have kernels stuck on a dead peer: abort instead of destroy.
      if (!aborted_) {
        if (failed_) {
          ncclCommAbort(comm_);
        } else {
          ncclCommDestroy(comm_);
        }
      }
    }
    if (scratch_ != nullptr) cudaFree(scratch_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  std::string_view backend() const override { return "nccl"; }
  MemoryKind memory_kind() const override { return MemoryKind::kDevice; }

  Status Init() {
    RendezvousStore& store = *store_;
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    STRATA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    STRATA_CUDA_RETURN_IF_ERROR(cudaMalloc(&scratch_, sizeof(int32_t)));
    ncclUniqueId id;
    const std::string key = "strata/nccl/unique_id";
    if (rank() == 0) {
      const ncclResult_t r = ncclGetUniqueId(&id);
      if (r != ncclSuccess) return NcclError(r, "ncclGetUniqueId", nullptr);
      STRATA_RETURN_IF_ERROR(store.Set(key, std::string(id.internal, sizeof(id.internal))));
    } else {
      STRATA_ASSIGN_OR_RETURN(std::string bytes, store.Get(key));
      if (bytes.size() != sizeof(id.internal)) {
        return Internal(StrCat("store key ", key, " holds ", bytes.size(), " bytes, expected ",
                               sizeof(id.internal)));
      }
      std::memcpy(id.internal, bytes.data(), bytes.size());
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t r = ncclCommInitRankConfig(&comm_, world_size(), id, rank(), &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      comm_ = nullptr;
      return NcclError(r, "ncclCommInitRankConfig", nullptr);
    }
    return WaitComm("ncclCommInitRankConfig");
  }

 protected:
  Status AllGatherImpl(const void* src, void* dst, int64_t count, int64_t dst_stride,
                       DType dtype) override {
    const size_t esize = DTypeSize(dtype);
    if (dst_stride == count) {
      return Issue("ncclAllGather", [&] {
        return ncclAllGather(src, dst, count, ToNccl(dtype), comm_, stream_);
      });
    }
    // A bucket: each rank's slice lands at its own offset, so one broadcast per root.
    return Issue("ncclBroadcast(group)", [&] {
      ncclResult_t r = ncclGroupStart();
      for (int root = 0; root < world_size() && (r == ncclSuccess || r == ncclInProgress); ++root) {
        r = ncclBroadcast(src, static_cast<char*>(dst) + root * dst_stride * esize, count,
                          ToNccl(dtype), root, comm_, stream_);
      }
      const ncclResult_t e = ncclGroupEnd();
      return r == ncclSuccess ? e : r;
    });
  }

  Status ReduceScatterImpl(const void* src, int64_t src_stride, void* dst, int64_t count,
                           DType dtype, ReduceOp op) override {
    const size_t esize = DTypeSize(dtype);
    if (src_stride == count) {
      return Issue("ncclReduceScatter", [&] {
        return ncclReduceScatter(src, dst, count, ToNccl(dtype), ToNccl(op), comm_, stream_);
      });
    }
    return Issue("ncclReduce(group)", [&] {
      ncclResult_t r = ncclGroupStart();
      for (int root = 0; root < world_size() && (r == ncclSuccess || r == ncclInProgress); ++root) {
        r = ncclReduce(static_cast<const char*>(src) + root * src_stride * esize, dst, count,
                       ToNccl(dtype), ToNccl(op), root, comm_, stream_);
      }
      const ncclResult_t e = ncclGroupEnd();
      return r == ncclSuccess ? e : r;
    });
  }

  Status AllReduceImpl(void* buf, int64_t count, DType dtype, ReduceOp op) override {
    return Issue("ncclAllReduce", [&] {
      return ncclAllReduce(buf, buf, count, ToNccl(dtype), ToNccl(op), comm_, stream_);
    });
  }

  Status BroadcastImpl(void* buf, int64_t count, DType dtype, int root) override {
    return Issue("ncclBroadcast", [&] {
      return ncclBroadcast(buf, buf, count, ToNccl(dtype), root, comm_, stream_);
    });
  }

  Status BarrierImpl() override {
    return Issue("barrier", [&] {
      return ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, comm_, stream_);
    });
  }

 private:
  template <typename F>
  Status Issue(const char* what, F&& enqueue) {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    const ncclResult_t r = enqueue();
    if (r != ncclSuccess && r != ncclInProgress) return Fail(NcclError(r, what, comm_));
    STRATA_RETURN_IF_ERROR(WaitComm(what));
    return WaitStream(what);
  }

  std::chrono::steady_clock::time_point Deadline() const {
    return std::chrono::steady_clock::now() +
           std::chrono::microseconds(static_cast<int64_t>(timeout_s_ * 1e6));
  }

  // Waits until the non-blocking communicator has finished the pending call (enqueueing, or init).
  Status WaitComm(const char* what) {
    const auto deadline = Deadline();
    for (;;) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
      if (r != ncclSuccess) return Fail(NcclError(r, "ncclCommGetAsyncError", comm_));
      if (state == ncclSuccess) return Status::Ok();
      if (state != ncclInProgress) return Fail(NcclError(state, what, comm_));
      if (std::chrono::steady_clock::now() > deadline) return TimedOut(what);
      if (Status gone = PeerGaveUp(what); !gone.ok()) return gone;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  Status WaitStream(const char* what) {
    const auto deadline = Deadline();
    for (;;) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return Status::Ok();
      if (q != cudaErrorNotReady) {
        (void)cudaGetLastError();
        return Fail(CudaToStatus(q, StrCat(what, ": cudaStreamQuery").c_str()));
      }
      ncclResult_t state = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state != ncclSuccess &&
          state != ncclInProgress) {
        return Fail(NcclError(state, what, comm_));
      }
      if (std::chrono::steady_clock::now() > deadline) return TimedOut(what);
      if (Status gone = PeerGaveUp(what); !gone.ok()) return gone;
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  // A kernel waiting on a peer that gave up would wait out the deadline: NCCL does not tell the
  // ranks left behind. So a wait looks for the peers' notes (Note [giving up] in
  // communicator.cc) once a second and aborts its own communicator on finding one; Run then
  // names the note.
  Status PeerGaveUp(const char* what) {
    const auto now = std::chrono::steady_clock::now();
    if (world_size() == 1 || now - last_note_check_ < std::chrono::seconds(1)) return Status::Ok();
    last_note_check_ = now;
    if (ReadAbortNotes(*store_, rank(), world_size()).empty()) return Status::Ok();
    AbortComm();
    return Cancelled(StrCat(what, " abandoned: a peer rank gave up"));
  }

  void AbortImpl(const std::string& note) override {
    PublishAbortNote(*store_, rank(), note);
    AbortComm();
  }

  std::string PeerAbortNotes() override { return ReadAbortNotes(*store_, rank(), world_size()); }

  Status Fail(Status s) {
    failed_ = true;
    return s;
  }

  // Frees this rank's kernels from a peer that will not come; once.
  void AbortComm() {
    failed_ = true;
    if (comm_ != nullptr && !aborted_) {
      ncclCommAbort(comm_);
      aborted_ = true;
    }
  }

  Status TimedOut(const char* what) {
    AbortComm();
    return DeadlineExceeded(StrCat(what, " did not complete within strata.comm_timeout_s=",
                                   timeout_s_, " s; the NCCL communicator was aborted (a peer rank "
                                   "may have died or stalled)"));
  }

  const int device_;
  std::shared_ptr<RendezvousStore> store_;  // the ncclUniqueId's, then the peers' notes
  const double timeout_s_;
  std::chrono::steady_clock::time_point last_note_check_{};
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
  void* scratch_ = nullptr;  // 4 bytes of device memory for the barrier's all-reduce
  bool failed_ = false;
  bool aborted_ = false;
};

}  // namespace

StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    const DistEnv& env, std::shared_ptr<RendezvousStore> store, double timeout_s,
    int cuda_device) {
  STRATA_CHECK(store != nullptr, "CreateNcclCommunicator: null store");
  STRATA_CHECK(timeout_s > 0, "strata.comm_timeout_s=", timeout_s, ": must be > 0");
  int count = 0;
  const cudaError_t ce = cudaGetDeviceCount(&count);
  if (ce != cudaSuccess) {
    (void)cudaGetLastError();
    count = 0;  // no driver or no GPU: same as zero devices
  }
  if (count == 0) {
    return FailedPrecondition(
        "strata.comm_backend=nccl needs a CUDA GPU and none is usable here; use gloo (or auto "
        "with device=cpu)");
  }
  STRATA_CHECK(cuda_device >= 0 && cuda_device < count, "CUDA device ", cuda_device,
               " for rank ", env.rank, ": this host has ", count,
               " GPU(s); set LOCAL_RANK below the GPU count (one rank per GPU)");
  auto comm = std::make_unique<NcclCommunicator>(env, cuda_device, std::move(store), timeout_s);
  STRATA_RETURN_IF_ERROR(comm->Init().WithContext(
      StrCat("nccl init of rank ", env.rank, " of ", env.world_size, " on cuda:", cuda_device)));
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace strata
