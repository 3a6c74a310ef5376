// The only translation unit of the communicators that includes LibTorch (c10d): the TCPStore
// rendezvous and the Gloo backend. Exceptions from c10d stop here and become Status.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <vector>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <ATen/ATen.h>

#include "runtime/base/check.h"
#include "runtime/base/env_vars.h"
#include "runtime/base/logging.h"
#include "runtime/comm/backends.h"
#include "runtime/comm/host_reduce.h"

namespace strata {

namespace {

std::chrono::milliseconds ToMillis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

// c10d reports every failure (peer closed the connection, timeout, bad argument) by throwing;
// the messages say which, so they are kept. A timeout reads as DEADLINE_EXCEEDED so callers can
// tell a slow or dead peer from a broken one.
Status FromException(const std::exception& e, std::string_view what) {
  // c10::Error::what() appends a C++ backtrace of our own frames: noise in a user's log.
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  const std::string cause = c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
  const std::string msg = StrCat(what, ": ", cause);
  // Only c10d's words decide: the context names strata.comm_timeout_s and would always match.
  if (cause.find("imeout") != std::string::npos || cause.find("imed out") != std::string::npos) {
    return DeadlineExceeded(msg);
  }
  return Unavailable(StrCat(msg, " (a peer rank may have exited; check the other ranks' logs)"));
}

class TcpRendezvousStore final : public RendezvousStore {
 public:
  explicit TcpRendezvousStore(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  Status Set(const std::string& key, const std::string& value) override {
    try {
      store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
      return Status::Ok();
    } catch (const std::exception& e) {
      return FromException(e, StrCat("store set '", key, "'"));
    }
  }
  StatusOr<std::string> Get(const std::string& key) override {
    try {
      const std::vector<uint8_t> v = store_->get(key);
      return std::string(v.begin(), v.end());
    } catch (const std::exception& e) {
      return FromException(e, StrCat("store get '", key, "'"));
    }
  }
  StatusOr<bool> Has(const std::string& key) override {
    try {
      return store_->check({key});
    } catch (const std::exception& e) {
      return FromException(e, StrCat("store check '", key, "'"));
    }
  }
  const c10::intrusive_ptr<c10d::Store>& c10d_store() const { return store_; }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

// LibTorch 2.4+ defaults TCPStore to its libuv backend and throws when it was built without
// libuv (Debian's 2.6 is); the classic backend exists in every version. 1.x has no such option.
template <typename Options>
auto UseClassicTcpStore(Options& o, int) -> decltype(o.useLibUV = false, void()) {
  o.useLibUV = false;
}
template <typename Options>
void UseClassicTcpStore(Options&, long) {}

StatusOr<c10::intrusive_ptr<c10d::Store>> ConnectC10dStore(const DistEnv& env, double timeout_s) {
  c10d::TCPStoreOptions opts;
  UseClassicTcpStore(opts, 0);
  opts.port = static_cast<uint16_t>(env.master_port);
  opts.isServer = env.rank == 0;
  opts.numWorkers = static_cast<size_t>(env.world_size);
  opts.waitWorkers = true;  // rank 0 fails here, early, when a rank never shows up
  opts.timeout = ToMillis(timeout_s);
  try {
    return c10::intrusive_ptr<c10d::Store>(c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts));
  } catch (const std::exception& e) {
    Status s = FromException(
        e, StrCat("rank ", env.rank, " of ", env.world_size, ": TCPStore at ", env.master_addr, ":",
                  env.master_port, (env.rank == 0 ? " (serving)" : ""),
                  " within strata.comm_timeout_s=", timeout_s));
    return Status(s.code(), StrCat(s.message(), "; check MASTER_ADDR/MASTER_PORT and that every "
                                                "rank was started"));
  }
}

bool IsLoopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

at::ScalarType ToScalarType(DType d) {
  switch (d) {
    case DType::kF32: return at::kFloat;
    case DType::kF64: return at::kDouble;
    case DType::kBF16: return at::kBFloat16;
    case DType::kF16: return at::kHalf;
    case DType::kI32: return at::kInt;
    case DType::kI64: return at::kLong;
    case DType::kU8: return at::kByte;
  }
  return at::kByte;
}

at::Tensor Wrap(const void* p, int64_t count, at::ScalarType type) {
  // from_blob neither copies, owns nor frees: the caller's buffer outlives the blocking collective.
  return at::from_blob(const_cast<void*>(p), {count}, at::TensorOptions().dtype(type));
}

// Moves that do not reduce (all-gather, all-to-all, broadcast) go as bytes. Which 16-bit types a
// Gloo build accepts varies (LibTorch 1.13's lacks bf16; Debian's 2.14 refuses bf16, fp16 and
// int16 with "Invalid scalar type"), while every build moves uint8.
at::Tensor WrapBytes(const void* p, int64_t count, DType d) {
  return Wrap(p, count * static_cast<int64_t>(DTypeSize(d)), at::kByte);
}

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(const DistEnv& env, c10::intrusive_ptr<c10d::ProcessGroupGloo> pg,
                   std::shared_ptr<RendezvousStore> store, double timeout_s)
      : Communicator(env.rank, env.world_size),
        pg_(std::move(pg)),
        store_(std::move(store)),
        timeout_(ToMillis(timeout_s)) {}

  std::string_view backend() const override { return "gloo"; }
  MemoryKind memory_kind() const override { return MemoryKind::kHost; }

 protected:
  Status AllGatherImpl(const void* src, void* dst, int64_t count, int64_t dst_stride,
                       DType dtype) override {
    const size_t esize = DTypeSize(dtype);
    std::vector<at::Tensor> inputs = {WrapBytes(src, count, dtype)};
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int r = 0; r < world_size(); ++r) {
      char* slot = static_cast<char*>(dst) + r * dst_stride * esize;
      outputs[0].push_back(WrapBytes(slot, count, dtype));
    }
    return Wait("allgather", [&] { return pg_->allgather(outputs, inputs); });
  }

  // Gloo 1.13 has no reduce-scatter: an all-to-all sends each owner its slice from every rank
  // (the same (N-1)/N bytes per rank as a ring reduce-scatter), and the owner reduces locally.
  Status ReduceScatterImpl(const void* src, int64_t src_stride, void* dst, int64_t count,
                           DType dtype, ReduceOp op) override {
    const int n = world_size();
    const size_t esize = DTypeSize(dtype);
    const size_t seg = count * esize;
    const void* send = src;
    if (src_stride != count) {  // a bucket: gather this slice of every segment contiguously
      send_.resize(n * seg);
      for (int r = 0; r < n; ++r) {
        std::memcpy(send_.data() + r * seg, static_cast<const char*>(src) + r * src_stride * esize,
                    seg);
      }
      send = send_.data();
    }
    recv_.resize(n * seg);
    at::Tensor in = WrapBytes(send, count * n, dtype);
    at::Tensor out = WrapBytes(recv_.data(), count * n, dtype);
    std::vector<int64_t> splits;  // empty: equal splits
    STRATA_RETURN_IF_ERROR(
        Wait("alltoall", [&] { return pg_->alltoall_base(out, in, splits, splits); }));
    std::vector<const void*> parts(n);
    for (int r = 0; r < n; ++r) parts[r] = recv_.data() + r * seg;
    ReduceHostBuffers(parts.data(), n, dst, count, dtype, op);
    return Status::Ok();
  }

  Status AllReduceImpl(void* buf, int64_t count, DType dtype, ReduceOp op) override {
    c10d::AllreduceOptions opts;
    opts.reduceOp = op == ReduceOp::kMax   ? c10d::ReduceOp::MAX
                    : op == ReduceOp::kMin ? c10d::ReduceOp::MIN
                                           : c10d::ReduceOp::SUM;
    opts.timeout = timeout_;
    if (dtype == DType::kBF16 || dtype == DType::kF16) {
      // Not every Gloo build adds 16-bit floats (see WrapBytes): reduce in fp32 (exact for the
      // sums and maxima of norms and flags this is used for) and round once.
      const bool bf16 = dtype == DType::kBF16;
      widened_.resize(count);
      const uint16_t* p = static_cast<const uint16_t*>(buf);
      for (int64_t i = 0; i < count; ++i) {
        widened_[i] = bf16 ? Bf16ToFloat(p[i]) : Fp16ToFloat(p[i]);
      }
      std::vector<at::Tensor> tensors = {Wrap(widened_.data(), count, at::kFloat)};
      STRATA_RETURN_IF_ERROR(Wait("allreduce", [&] { return pg_->allreduce(tensors, opts); }));
      if (op == ReduceOp::kAvg) DivideHostBuffer(widened_.data(), count, DType::kF32, world_size());
      uint16_t* q = static_cast<uint16_t*>(buf);
      for (int64_t i = 0; i < count; ++i) {
        q[i] = bf16 ? FloatToBf16(widened_[i]) : FloatToFp16(widened_[i]);
      }
      return Status::Ok();
    }
    std::vector<at::Tensor> tensors = {Wrap(buf, count, ToScalarType(dtype))};
    STRATA_RETURN_IF_ERROR(Wait("allreduce", [&] { return pg_->allreduce(tensors, opts); }));
    if (op == ReduceOp::kAvg) DivideHostBuffer(buf, count, dtype, world_size());
    return Status::Ok();
  }

  Status BroadcastImpl(void* buf, int64_t count, DType dtype, int root) override {
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.timeout = timeout_;
    std::vector<at::Tensor> tensors = {WrapBytes(buf, count, dtype)};
    return Wait("broadcast", [&] { return pg_->broadcast(tensors, opts); });
  }

  Status BarrierImpl() override {
    c10d::BarrierOptions opts;
    opts.timeout = timeout_;
    return Wait("barrier", [&] { return pg_->barrier(opts); });
  }

  // The group goes, and with it every connection to the peers: a peer receiving from this rank
  // gets "connection closed" at once. No call is in flight (Abort's contract), so its worker
  // threads have nothing left to finish. The store stays: rank 0's serves the others.
  void AbortImpl(const std::string& note) override {
    PublishAbortNote(*store_, rank(), note);
    pg_.reset();
  }

  std::string PeerAbortNotes() override { return ReadAbortNotes(*store_, rank(), world_size()); }

 private:
  // Issues one c10d call and waits for it, bounded by the timeout (Gloo's own timeout covers the
  // transport; the bounded wait covers everything else).
  template <typename F>
  Status Wait(const char* what, F&& issue) {
    try {
      c10::intrusive_ptr<c10d::Work> work = issue();
      if (!work->wait(timeout_)) {
        return DeadlineExceeded(StrCat(what, " did not complete within ", timeout_.count(), " ms"));
      }
      return Status::Ok();
    } catch (const std::exception& e) {
      return FromException(e, what);
    }
  }

  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;  // null once given up
  std::shared_ptr<RendezvousStore> store_;         // the job's TCPStore, unprefixed
  const std::chrono::milliseconds timeout_;
  // Staging for reduce-scatter and bf16 all-reduce; bounded by the bucket sizes.
  std::vector<char> send_;
  std::vector<char> recv_;
  std::vector<float> widened_;
};

}  // namespace

StatusOr<std::shared_ptr<RendezvousStore>> ConnectTcpStore(const DistEnv& env, double timeout_s) {
  STRATA_ASSIGN_OR_RETURN(c10::intrusive_ptr<c10d::Store> store, ConnectC10dStore(env, timeout_s));
  return std::shared_ptr<RendezvousStore>(std::make_shared<TcpRendezvousStore>(std::move(store)));
}

bool GlooAvailable() { return true; }

StatusOr<std::unique_ptr<Communicator>> CreateGlooCommunicator(const DistEnv& env,
                                                               double timeout_s) {
  STRATA_CHECK(timeout_s > 0, "strata.comm_timeout_s=", timeout_s, ": must be > 0");
  STRATA_ASSIGN_OR_RETURN(c10::intrusive_ptr<c10d::Store> tcp, ConnectC10dStore(env, timeout_s));
  try {
    auto store = c10::make_intrusive<c10d::PrefixStore>("strata/gloo", tcp);
    auto options = c10d::ProcessGroupGloo::Options::create(ToMillis(timeout_s));
    const char* ifname = GetEnv(kEnvGlooSocketIfname);
    if (ifname != nullptr && *ifname != '\0') {
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    } else if (IsLoopback(env.master_addr)) {
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    } else {
      options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
    options->threads = 2;
    auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, env.rank, env.world_size, options);
    return std::unique_ptr<Communicator>(std::make_unique<GlooCommunicator>(
        env, pg, std::make_shared<TcpRendezvousStore>(tcp), timeout_s));
  } catch (const std::exception& e) {
    return FromException(e, StrCat("gloo rendezvous of rank ", env.rank, " of ", env.world_size,
                                   " via ", env.master_addr, ":", env.master_port));
  }
}

}  // namespace strata
