#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>

#include "runtime/base/check.h"
#include "runtime/base/logging.h"
#include "runtime/comm/backends.h"

namespace strata {

namespace {

class InProcessStore final : public RendezvousStore {
 public:
  explicit InProcessStore(double timeout_s) : timeout_s_(timeout_s) {}
  Status Set(const std::string& key, const std::string& value) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      values_[key] = value;
    }
    cv_.notify_all();
    return Status::Ok();
  }
  StatusOr<std::string> Get(const std::string& key) override {
    std::unique_lock<std::mutex> lock(mu_);
    const bool found = cv_.wait_for(lock, std::chrono::duration<double>(timeout_s_),
                                    [&] { return values_.count(key) != 0; });
    if (!found) {
      return DeadlineExceeded(StrCat("store key '", key, "' not set within ", timeout_s_, " s"));
    }
    return values_[key];
  }
  StatusOr<bool> Has(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    return values_.count(key) != 0;
  }

 private:
  const double timeout_s_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> values_;  // GUARDED_BY(mu_)
};

}  // namespace

std::shared_ptr<RendezvousStore> CreateInProcessStore(double timeout_s) {
  return std::make_shared<InProcessStore>(timeout_s);
}

StatusOr<std::unique_ptr<Communicator>> CreateCommunicator(const CommOptions& o) {
  STRATA_CHECK(o.backend == "auto" || o.backend == "single" || o.backend == "gloo" ||
                   o.backend == "nccl",
               "strata.comm_backend='", o.backend, "': must be auto, single, gloo or nccl");
  STRATA_CHECK(o.device == "cpu" || o.device == "cuda", "communicator device='", o.device,
               "': must be cpu or cuda");
  STRATA_CHECK(o.timeout_s > 0 && o.timeout_s <= 86400, "strata.comm_timeout_s=", o.timeout_s,
               ": must be in (0, 86400] seconds");
  STRATA_ASSIGN_OR_RETURN(DistEnv env, ReadDistEnv());

  std::string backend = o.backend;
  if (backend == "auto") {
    backend = env.world_size == 1 ? "single" : (o.device == "cuda" ? "nccl" : "gloo");
  }
  if (backend == "single" && env.world_size != 1) {
    return InvalidArgument(StrCat("strata.comm_backend=single but WORLD_SIZE=", env.world_size,
                                  ": use gloo (CPU) or nccl (GPU), or auto"));
  }

  std::unique_ptr<Communicator> comm;
  if (backend == "single") {
    comm = CreateSingleCommunicator();
  } else if (backend == "gloo") {
    STRATA_ASSIGN_OR_RETURN(comm, CreateGlooCommunicator(env, o.timeout_s));
  } else {
    std::shared_ptr<RendezvousStore> store;
    if (env.world_size == 1) {
      store = CreateInProcessStore(o.timeout_s);
    } else {
      STRATA_ASSIGN_OR_RETURN(store, ConnectTcpStore(env, o.timeout_s));
    }
    const int device = o.cuda_device >= 0 ? o.cuda_device : env.local_rank;
    STRATA_ASSIGN_OR_RETURN(comm, CreateNcclCommunicator(env, store, o.timeout_s, device));
  }
  STRATA_RETURN_IF_ERROR(comm->SetBucketSizes(o.buckets));
  STRATA_LOG(DEBUG) << "communicator backend=" << comm->backend() << " rank=" << comm->rank()
                    << " world_size=" << comm->world_size() << " timeout_s=" << o.timeout_s;
  return comm;
}

}  // namespace strata
