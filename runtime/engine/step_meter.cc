#include "runtime/engine/step_meter.h"

#include <algorithm>

namespace strata {

namespace {
double Since(StepMeter::Clock::time_point t0) {
  return std::chrono::duration<double>(StepMeter::Clock::now() - t0).count();
}
}  // namespace

void StepMeter::OpenWindow(const BlockStoreStats& store_now) {
  window_open_ = true;
  step_start_ = Clock::now();
  compute_s = copy_s = comm_s = stall_s = waits_in_compute_s = update_wait_s = 0;
  bytes_h2d = bytes_d2h = 0;
  store_at_start_ = store_now;
}

void StepMeter::BeginForward() {
  forward_start_ = Clock::now();
  waits_at_forward_start_ = WaitsSoFar();
}

void StepMeter::EndForward(int64_t trace_step) {
  trace.Add(Lane::kCompute, "forward", forward_start_, Clock::now(), trace_step);
  compute_s += Since(forward_start_);
  waits_in_compute_s += WaitsSoFar() - waits_at_forward_start_;
}

void StepMeter::Fill(StepReport* rep, const BlockStoreStats& now) const {
  rep->step_time_s = Since(step_start_);
  rep->compute_s = std::max(0.0, compute_s - waits_in_compute_s);
  rep->copy_s += copy_s;
  rep->comm_s += comm_s;
  rep->nvme_s = now.nvme_busy_s - store_at_start_.nvme_busy_s;
  rep->stall_s = stall_s;  // the compute lane's waits; the optimizer lane's are in optimizer_s
  rep->update_wait_s = update_wait_s;
  rep->bytes_host_to_device = bytes_h2d;
  rep->bytes_device_to_host = bytes_d2h;
  rep->bytes_nvme_to_host = now.bytes_nvme_to_host - store_at_start_.bytes_nvme_to_host;
  rep->bytes_host_to_nvme = now.bytes_host_to_nvme - store_at_start_.bytes_host_to_nvme;
  rep->peak_host_bytes = now.peak_bytes_host;
}

}  // namespace strata
