// ThreadPoolEngine: the pread/pwrite fallback of IoEngine (see io_engine.h for the contract).
//
// Used only when io_uring cannot be set up, when a directory does not support O_DIRECT (tmpfs),
// or when forced. 2 × aio.intra_op_parallelism worker threads each run one piece at a time to
// completion (finishing short transfers and retrying EAGAIN in place, after its backoff), so at
// most that many pieces are in flight; the rest wait in a FIFO queue.
#pragma once

#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "tiers/nvme/io_engine.h"

namespace strata::nvme {

class ThreadPoolEngine final : public IoEngine {
 public:
  static StatusOr<std::unique_ptr<ThreadPoolEngine>> Create(const IoEngineOptions& options,
                                                            std::string reason);
  ~ThreadPoolEngine() override;

  std::string_view name() const override { return "fallback"; }
  Status SetFiles(std::vector<IoFile> files) override;
  Status RegisterBuffers(const std::vector<iovec>&) override { return Status::Ok(); }

 private:
  explicit ThreadPoolEngine(const IoEngineOptions& options);
  void Enqueue(std::vector<PiecePtr> pieces) override EXCLUDES(mu_);
  void Worker() EXCLUDES(mu_);

  std::vector<std::thread> threads_;
  Mutex mu_;
  CondVar cv_;
  std::deque<PiecePtr> queue_ GUARDED_BY(mu_);
  bool stopping_ GUARDED_BY(mu_) = false;
};

}  // namespace strata::nvme
